"""The S3 source against a real S3 server (moto), with faults injected by a proxy in between."""

from __future__ import annotations

import hashlib
import logging
import os
import random
import threading
import time
import zlib
from pathlib import Path

import botocore.exceptions
import pytest

from tests.faultproxy import FaultProxy
from tests.fixtures_s3 import S3
from tests.sample import make_model
from weightcache import retry
from weightcache.errors import (
    ObjectChangedError,
    RetriesExceededError,
    SourceAccessDeniedError,
    SourceNotFoundError,
)
from weightcache.sources import ClientPool, ObjectInfo, SourceOptions, open_source
from weightcache.sources.s3 import S3Source
from weightcache.uri import parse_ref

DATA = random.Random(7).randbytes(300_000)


def source(endpoint: str, uri: str = "s3://models/m/", **options: object) -> S3Source:
    options = {"max_attempts": 4, "backoff": 0.01, **options}
    ref = parse_ref(uri, **{k: options.pop(k) for k in ("include", "exclude") if k in options})  # type: ignore[arg-type]
    return S3Source(ref, SourceOptions(endpoint_url=endpoint, **options))  # type: ignore[arg-type]


def listed(src: S3Source, relpath: str) -> ObjectInfo:
    return next(o for o in src.list() if o.relpath == relpath)


def test_list_is_recursive_sorted_and_skips_directory_markers(s3: S3) -> None:
    etag = s3.put("models", "m/b.bin", b"bb")["ETag"].strip('"')
    s3.put("models", "m/a/c.json", b"{}")
    s3.put("models", "m/a/", b"")  # a console's "folder"
    s3.put("models", "m2/not-under-prefix", b"x")
    s3.put("models", "other/x", b"x")

    objects = source(s3.endpoint_url).list()

    assert [(o.key, o.relpath, o.size) for o in objects] == [("m/a/c.json", "a/c.json", 2), ("m/b.bin", "b.bin", 2)]
    assert objects[1].etag == etag
    assert objects[1].checksum == ("crc32", f"{zlib.crc32(b'bb'):08x}")  # botocore adds CRC32 to every upload


def test_a_client_pool_keeps_a_client_for_the_next_source_and_none_is_shared(s3: S3) -> None:
    """The composition's ClientPool (the daemon's) hands the client a closed source gave back to the next one with
    the same settings, never one another source holds; without a pool nothing is kept (a CLI fetch)."""
    s3.put("models", "m/a.bin", b"a")
    pool = ClientPool()

    def opened(**options: object) -> S3Source:
        return source(s3.endpoint_url, **options)

    first = opened(clients=pool)
    assert [o.relpath for o in first.list()] == ["a.bin"]
    client = first._client
    first.close()
    held = opened(clients=pool)
    assert held._client is client
    other = opened(clients=pool)
    assert other._client is not client  # held: the other source gets a client of its own
    other.close()
    held.close()
    assert opened(clients=pool)._client is client  # the last given back
    assert opened(clients=pool, read_timeout=3.0)._client is not client  # other settings: another client
    alone = opened()
    alone.close()
    assert opened()._client is not alone._client
    pool.close()
    assert pool.take(first._key) is None


def test_list_reads_every_page(s3: S3, fault_proxy: FaultProxy) -> None:
    for i in range(5):
        s3.put("models", f"m/{i}.bin", b"x")
    src = source(fault_proxy.endpoint_url)
    src.page_size = 2
    assert [o.relpath for o in src.list()] == [f"{i}.bin" for i in range(5)]
    assert len(fault_proxy.requests_for("GET", "/models")) == 3


def test_list_applies_include_and_exclude_globs(s3: S3, tmp_path: Path) -> None:
    make_model(tmp_path, shards=2)
    s3.upload_dir(tmp_path, "models", "m/")

    objects = source(s3.endpoint_url, include=("*.safetensors", "*.json"), exclude=("tokenizer*",)).list()

    assert [o.relpath for o in objects] == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert all(o.size == (tmp_path / o.relpath).stat().st_size for o in objects)


def test_empty_prefix_is_not_found_with_a_hint(s3: S3) -> None:
    s3.put("models", "elsewhere/a", b"x")
    with pytest.raises(SourceNotFoundError, match=r"no objects under s3://models/m/; .*aws s3 ls s3://models/m/"):
        source(s3.endpoint_url).list()


def test_globs_that_exclude_everything_say_so(s3: S3) -> None:
    s3.put("models", "m/a.bin", b"x")
    with pytest.raises(SourceNotFoundError, match=r"1 objects exist there but none pass the globs"):
        source(s3.endpoint_url, include=("*.safetensors",)).list()


def test_missing_bucket_is_not_found(s3: S3) -> None:
    with pytest.raises(SourceNotFoundError, match=r"NoSuchBucket.*aws s3 ls") as info:
        source(s3.endpoint_url, "s3://no-such-bucket/m/").list()
    assert isinstance(info.value, FileNotFoundError)
    assert isinstance(info.value.__cause__, botocore.exceptions.ClientError)


def test_checksum_comes_from_a_full_object_sha256(s3: S3) -> None:
    s3.put("models", "m/with.bin", DATA, ChecksumAlgorithm="SHA256")
    s3.put("models", "m/without.bin", DATA)

    by_path = {o.relpath: o for o in source(s3.endpoint_url).list()}

    assert by_path["with.bin"].checksum == ("sha256", hashlib.sha256(DATA).hexdigest())
    assert by_path["with.bin"].size == len(DATA)
    assert by_path["without.bin"].checksum == ("crc32", f"{zlib.crc32(DATA):08x}")  # botocore's default


def test_a_multipart_composite_checksum_is_not_taken_for_a_digest(s3: S3) -> None:
    s3.create_bucket("models")
    upload = s3.client.create_multipart_upload(Bucket="models", Key="m/big.bin", ChecksumAlgorithm="SHA256")
    parts = []
    for number, data in enumerate([b"a" * (5 << 20), b"b"], 1):
        part = s3.client.upload_part(Bucket="models", Key="m/big.bin", UploadId=upload["UploadId"],
                                     PartNumber=number, Body=data, ChecksumAlgorithm="SHA256")
        parts.append({"PartNumber": number, "ETag": part["ETag"], "ChecksumSHA256": part["ChecksumSHA256"]})
    s3.client.complete_multipart_upload(Bucket="models", Key="m/big.bin", UploadId=upload["UploadId"],
                                        MultipartUpload={"Parts": parts})

    (obj,) = source(s3.endpoint_url).list()

    assert obj.size == (5 << 20) + 1
    assert obj.checksum is None


def test_a_versioned_object_replaced_after_listing_still_reads_the_listed_version(
    s3: S3, fault_proxy: FaultProxy
) -> None:
    s3.create_bucket("models", versioned=True)
    s3.put("models", "m/w.bin", DATA, ChecksumAlgorithm="SHA256")  # the checksum HEAD also reads the VersionId
    src = source(fault_proxy.endpoint_url)
    old = listed(src, "w.bin")
    s3.put("models", "m/w.bin", DATA[::-1])
    buf = bytearray(100)

    src.read_into(old, 0, memoryview(buf))

    assert old.version_id and buf == DATA[:100]
    assert fault_proxy.requests_for("GET", "/models/m/w.bin")[-1].query == f"versionId={old.version_id}"


@pytest.mark.parametrize(("offset", "length"), [(0, 1), (0, len(DATA)), (12_345, 100_000), (len(DATA) - 1, 1)])
def test_read_into_returns_exact_bytes(s3: S3, offset: int, length: int) -> None:
    s3.put("models", "m/w.bin", DATA)
    src = source(s3.endpoint_url)
    buf = bytearray(length)

    src.read_into(listed(src, "w.bin"), offset, memoryview(buf))

    assert buf == DATA[offset:offset + length]


def test_read_into_refuses_a_range_outside_the_object(s3: S3) -> None:
    s3.put("models", "m/w.bin", b"abc")
    src = source(s3.endpoint_url)
    with pytest.raises(ValueError, match="outside"):
        src.read_into(listed(src, "w.bin"), 2, memoryview(bytearray(2)))


def test_concurrent_reads_from_many_threads_are_exact(s3: S3) -> None:
    s3.put("models", "m/w.bin", DATA)
    src = source(s3.endpoint_url, pool_size=8)
    obj = listed(src, "w.bin")
    out = bytearray(len(DATA))
    view = memoryview(out)
    step = 20_000
    threads = [threading.Thread(target=src.read_into, args=(obj, pos, view[pos:pos + step]))
               for pos in range(0, len(DATA), step)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == DATA


def test_read_pieces_yields_the_range_through_one_buffer_and_tells_bytes_as_they_arrive(s3: S3) -> None:
    s3.put("models", "m/w.bin", DATA)
    src = source(s3.endpoint_url)
    heard: list[int] = []
    buf = memoryview(bytearray(64_000))
    out = bytearray()
    for pos, view in src.read_pieces(listed(src, "w.bin"), 1000, len(DATA) - 1000, buf, heard.append):
        assert pos == 1000 + len(out)
        out += view
    assert out == DATA[1000:]
    assert sum(heard) == len(DATA) - 1000 and all(n > 0 for n in heard)


def test_reads_are_pinned_with_if_match(s3: S3, fault_proxy: FaultProxy) -> None:
    s3.put("models", "m/w.bin", DATA)
    src = source(fault_proxy.endpoint_url)
    old = listed(src, "w.bin")
    src.read_into(old, 0, memoryview(bytearray(10)))
    assert fault_proxy.requests_for("GET", "/models/m/w.bin")[-1].if_match == f'"{old.etag}"'

    s3.put("models", "m/w.bin", DATA[::-1])  # replaced after listing

    with pytest.raises(ObjectChangedError, match="replaced while downloading"):
        src.read_into(old, 0, memoryview(bytearray(10)))
    assert len(fault_proxy.requests_for("GET", "/models/m/w.bin")) == 2  # 412 is final, not retried


@pytest.mark.parametrize("fault", [
    {"kind": "slowdown"},
    {"kind": "slowdown", "retry_after": 0},
    {"kind": "status", "status": 500, "code": "InternalError"},
    {"kind": "status", "status": 429, "code": "TooManyRequests"},
    {"kind": "status", "status": 502, "code": "BadGateway"},
    {"kind": "reset", "keep": 0.5},
    {"kind": "truncate", "keep": 0.3},
    {"kind": "delay", "seconds": 1.0},
], ids=lambda f: "-".join(str(v) for v in f.values()))
def test_faults_are_retried_and_bytes_stay_exact(s3: S3, fault_proxy: FaultProxy, fault: dict) -> None:
    s3.put("models", "m/w.bin", DATA)
    # a short read timeout only where the fault is a delay: elsewhere a loaded machine's slow answer would time out
    # too, and be a second retry
    src = source(fault_proxy.endpoint_url, read_timeout=0.3 if fault["kind"] == "delay" else 10.0)
    obj = listed(src, "w.bin")
    injected = fault_proxy.add(fault.pop("kind"), method="GET", path="/models/m/w.bin", ranged_only=True, **fault)
    buf = bytearray(100_000)

    src.read_into(obj, 5_000, memoryview(buf))

    assert buf == DATA[5_000:105_000]
    assert injected.fired == 1
    assert len(fault_proxy.requests_for("GET", "/models/m/w.bin")) == 2


def test_retry_after_is_a_floor_for_the_pause(s3: S3, fault_proxy: FaultProxy) -> None:
    s3.put("models", "m/w.bin", DATA)
    src = source(fault_proxy.endpoint_url)  # backoff alone would wait at most 0.01 s
    obj = listed(src, "w.bin")
    fault_proxy.add("slowdown", method="GET", ranged_only=True, retry_after=1)
    start = time.monotonic()
    src.read_into(obj, 0, memoryview(bytearray(10)))
    assert time.monotonic() - start >= 1.0


def test_a_short_body_is_resumed_from_the_first_missing_byte(s3: S3, fault_proxy: FaultProxy) -> None:
    s3.put("models", "m/w.bin", DATA)
    src = source(fault_proxy.endpoint_url)
    obj = listed(src, "w.bin")
    fault_proxy.add("truncate", method="GET", ranged_only=True, keep=0.5, count=2)
    buf = bytearray(1000)

    src.read_into(obj, 100, memoryview(buf))

    assert buf == DATA[100:1100]
    ranges = [r.range for r in fault_proxy.requests_for("GET", "/models/m/w.bin")]
    assert ranges == ["bytes=100-1099", "bytes=600-1099", "bytes=850-1099"]


def test_retries_run_out_with_the_last_exception(s3: S3, fault_proxy: FaultProxy) -> None:
    s3.put("models", "m/w.bin", DATA)
    src = source(fault_proxy.endpoint_url, max_attempts=3)
    obj = listed(src, "w.bin")
    fault_proxy.add("status", method="GET", ranged_only=True, count=-1, status=500, code="InternalError")

    with pytest.raises(RetriesExceededError, match=r"failed 3 times, last: InternalError \(HTTP 500\)") as info:
        src.read_into(obj, 0, memoryview(bytearray(10)))

    last = info.value.last_exception
    assert isinstance(last, botocore.exceptions.ClientError)
    assert last.response["Error"]["Code"] == "InternalError"
    assert len(fault_proxy.requests_for("GET", "/models/m/w.bin")) == 3


def test_a_store_asking_to_slow_down_is_retried_for_a_while_not_for_a_few_attempts(
        s3: S3, fault_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """503 SlowDown is the store throttling the client: retried for THROTTLED_S whatever the attempts (a fleet
    starting behind an origin that throttled it for 10 s failed every fetch at its listing, 5 attempts in under
    3 s), then given up with the last exception."""
    s3.put("models", "m/w.bin", DATA)
    src = source(fault_proxy.endpoint_url, max_attempts=3)
    obj = listed(src, "w.bin")
    fault_proxy.add("slowdown", method="GET", ranged_only=True, count=8)
    buf = memoryview(bytearray(10))
    src.read_into(obj, 0, buf)  # 8 refusals, then the bytes: more than max_attempts
    assert bytes(buf) == DATA[:10]
    assert len(fault_proxy.requests_for("GET", "/models/m/w.bin")) == 9

    monkeypatch.setattr(retry, "THROTTLED_S", 0.3)
    fault_proxy.add("slowdown", method="GET", ranged_only=True, count=-1)
    with pytest.raises(RetriesExceededError, match=r"last: SlowDown \(HTTP 503\)") as info:
        src.read_into(obj, 0, buf)
    assert info.value.last_exception.response["Error"]["Code"] == "SlowDown"


def test_a_throttled_request_is_tried_again_within_two_seconds_however_long_the_throttling() -> None:
    """A store's throttling ends unannounced: each pause between "slow down" answers is at most
    THROTTLED_MAX_BACKOFF (2 s), not a backoff doubled to MAX_BACKOFF (10 s), so a request is through within 2 s
    of the store's recovery (a fleet behind an origin answering 503 for 10 s came back to it up to 9 s late)."""
    attempts = SourceOptions(backoff=1.0).retry("reading")  # doubled: 8 s by the 4th failure, 10 s after
    attempts.failures = 6  # six "slow down" answers already: the doubled backoff is past MAX_BACKOFF
    for _ in range(3):  # each would be uniform in 0-10 s before: all three within 2.2 s one time in a hundred
        start = time.monotonic()
        attempts.failed(retry.Retryable("SlowDown (HTTP 503)", throttled=True))
        assert time.monotonic() - start <= 2.2
    assert attempts.failures == 9


def test_listing_is_retried_too(s3: S3, fault_proxy: FaultProxy) -> None:
    s3.put("models", "m/w.bin", b"x")
    fault_proxy.add("slowdown", method="GET", path="/models", count=2)
    assert [o.relpath for o in source(fault_proxy.endpoint_url).list()] == ["w.bin"]
    assert len(fault_proxy.requests_for("GET", "/models")) == 3


@pytest.mark.parametrize("code", ["AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"])
def test_auth_failures_are_access_denied_without_retries(s3: S3, fault_proxy: FaultProxy, code: str) -> None:
    s3.put("models", "m/w.bin", b"x")
    fault_proxy.add("status", status=403, code=code, count=-1)

    with pytest.raises(SourceAccessDeniedError, match=rf"s3://models/m/: {code} \(HTTP 403\); give the node") as info:
        source(fault_proxy.endpoint_url).list()

    assert isinstance(info.value, PermissionError)
    assert isinstance(info.value.__cause__, botocore.exceptions.ClientError)
    assert len(fault_proxy.requests) == 1


def test_credentials_never_reach_errors_reprs_or_logs(
    s3: S3, fault_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    secrets = {"AWS_ACCESS_KEY_ID": "AKIASECRETKEYID0001", "AWS_SECRET_ACCESS_KEY": "wJalrSECRETsecretSECRET",
               "AWS_SESSION_TOKEN": "SESSIONTOKENsecret"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    s3.put("models", "m/w.bin", DATA)
    caplog.set_level(logging.INFO)  # botocore's own DEBUG output signs requests in the clear: never enable it
    caplog.set_level(logging.DEBUG, logger="weightcache")
    src = source(fault_proxy.endpoint_url, max_attempts=2)
    obj = listed(src, "w.bin")
    fault_proxy.add("slowdown", method="GET", ranged_only=True)
    fault_proxy.add("status", method="GET", ranged_only=True, status=403, code="SignatureDoesNotMatch")

    with pytest.raises(SourceAccessDeniedError) as info:
        src.read_into(obj, 0, memoryview(bytearray(10)))

    assert "Credential=AKIASECRETKEYID0001" in fault_proxy.requests[-1].headers["Authorization"]  # they were used
    texts = [str(info.value), repr(info.value), str(info.value.__cause__), repr(src), caplog.text]
    for text in texts:
        for value in secrets.values():
            assert value not in text


def test_repr_leaves_out_userinfo_of_the_endpoint() -> None:
    src = S3Source(parse_ref("s3://models/m/"), SourceOptions(endpoint_url="http://minio:hunter2@127.0.0.1:9000"))
    assert repr(src) == "S3Source('s3://models/m/', endpoint='http://***@127.0.0.1:9000')"  # weightcache.redact


def test_missing_credentials_say_how_to_provide_them(s3: S3, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance metadata lookups from a test
    with pytest.raises(SourceAccessDeniedError, match="no AWS credentials found; set AWS_ACCESS_KEY_ID"):
        source(s3.endpoint_url).list()


def test_endpoint_comes_from_aws_endpoint_url(s3: S3, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint_url)
    s3.put("models", "m/w.bin", b"abc")
    src = open_source(parse_ref("s3://models/m/"))
    try:
        assert src.name == "s3"
        assert [o.relpath for o in src.list()] == ["w.bin"]
        assert os.environ["AWS_ENDPOINT_URL"] in repr(src)
    finally:
        src.close()


def test_read_pieces_streams_one_range_and_resumes_a_cut_body_at_the_first_unyielded_byte(s3, fault_proxy) -> None:
    body = bytes(range(256)) * 4096  # 1 MiB
    s3.put("models", "big/blob.bin", body)
    source = open_source(parse_ref("s3://models/big/"), endpoint_url=fault_proxy.endpoint_url, backoff=0.01)
    try:
        (obj,) = source.list()
        # a FIN after 60%: those bytes surely arrive (after an RST the kernel may drop what is still unread)
        fault_proxy.add("truncate", method="GET", ranged_only=True, count=1, keep=0.6)
        buf = memoryview(bytearray(128 << 10))
        got = bytearray()
        for pos, view in source.read_pieces(obj, 0, obj.size, buf):
            assert pos == len(got)
            got += view
    finally:
        source.close()
    assert bytes(got) == body
    ranges = [r.range for r in fault_proxy.requests_for("GET", "/models/big/blob.bin")]
    assert ranges[0] == f"bytes=0-{len(body) - 1}", "the whole range must be one request"
    assert len(ranges) == 2
    restart = int(ranges[1].removeprefix("bytes=").split("-")[0])
    assert restart % len(buf) == 0 and 0 < restart <= int(len(body) * 0.6)


def test_the_s3_client_starts_without_pyopenssl_or_a_scan_of_every_service(tmp_path: Path) -> None:
    """A CLI fetch pays the client's start: botocore's import of urllib3.contrib.pyopenssl (pyOpenSSL and
    cryptography, for a class the stdlib has), asyncio's (the rate limiter's coroutine alone wants it), and its
    loader's scan of ~460 service directories are not paid, and its data files are decoded without an OrderedDict
    per object, while the credential chain's services still
    load, an unknown one still fails, and the data is what botocore's own decode gives."""
    import subprocess
    import sys

    code = """if True:
        import os, sys
        import weightcache.fetch, weightcache.sources.s3 as s3  # what a CLI fetch from S3 imports
        from botocore.exceptions import DataNotFoundError
        _, _, client = s3._client("http://127.0.0.1:9", s3.Config(region_name="us-east-1"), (), None)
        print("OpenSSL" in sys.modules, "urllib3.contrib.pyopenssl" in sys.modules, "asyncio" in sys.modules)
        listed = []
        real_listdir = os.listdir
        os.listdir = lambda p=".": listed.append(p) or real_listdir(p)
        s3._LOADER.load_service_model("sts", "service-2")
        try:
            s3._LOADER.load_service_model("no-such-service", "service-2")
        except DataNotFoundError:
            print("unknown refused")
        print(len(listed) < 10, client.meta.service_model.service_name)
        import botocore.loaders  # decoded by msgspec into plain dicts: the same data as botocore's own decode
        # fresh loaders: a client edits the model its loader cached
        ours, stock = s3._Loader(file_loader=s3._JsonFiles()), botocore.loaders.create_loader()
        print(all(ours.load_data(name) == stock.load_data(name) for name in ("endpoints", "partitions"))
              and ours.load_service_model("s3", "service-2") == stock.load_service_model("s3", "service-2"))
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "False", "unknown", "refused", "True", "s3", "True"]
