"""What verified each file against its source, recorded in the manifest (docs/fetch.md, "What verified a file"):
shown by `ls -o json` and `verify`, refused by requireSourceChecksum when it is `none`; multipart objects without
a checksum checked by the MD5 of their part MD5s. Before: a multipart object had no check at all, a bit flipped in
transit was published, and nothing said so. Against moto (its fault proxy flips the byte); the same against Ceph
radosgw: tests_objstores/test_rgw.py."""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.command import weightcache
from tests.faultproxy import FaultProxy
from tests.fixtures_s3 import S3
from tests.grants import granted
from weightcache.errors import IntegrityError, NotAllowedError
from weightcache.fetch import Fetcher
from weightcache.peers.identity import CompositeMD5
from weightcache.store import Store

MiB = 1 << 20


def put_multipart(s3: S3, bucket: str, key: str, parts: list[bytes]) -> str:
    """One multipart upload of `parts` without any checksum asked for; returns its ETag (md5-of-md5s-N)."""
    s3.create_bucket(bucket)
    up = s3.client.create_multipart_upload(Bucket=bucket, Key=key)
    done = []
    for n, data in enumerate(parts, 1):
        r = s3.client.upload_part(Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=n, Body=data)
        done.append({"PartNumber": n, "ETag": r["ETag"]})
    out = s3.client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up["UploadId"],
                                              MultipartUpload={"Parts": done})
    return str(out["ETag"]).strip('"')


@pytest.fixture
def plain(s3: S3) -> Iterator[Any]:
    """A client that asks for no checksum (boto3 adds a CRC32 to every upload by default; most S3-compatible
    stores, and objects written by older tools, keep none)."""
    import boto3
    from botocore.config import Config

    client = boto3.session.Session().client("s3", endpoint_url=s3.endpoint_url, config=Config(
        s3={"addressing_style": "path"}, request_checksum_calculation="when_required"))
    s3.create_bucket("models")
    yield client
    client.close()


def two_parts() -> list[bytes]:
    return [os.urandom(5 * MiB), os.urandom(MiB + 123)]


def test_each_file_records_what_verified_it(tmp_path: Path, s3: S3, plain: Any) -> None:
    plain.put_object(Bucket="models", Key="m/config.json", Body=b"{}")  # single part: its ETag is the MD5
    s3.put("models", "m/crc.bin", b"boto3's default CRC32")
    s3.put("models", "m/sum.bin", b"with a checksum", ChecksumAlgorithm="SHA256")
    body = b"claimed by a sidecar"
    plain.put_object(Bucket="models", Key="m/w.bin", Body=body)
    plain.put_object(Bucket="models", Key="m/w.bin.sha256", Body=hashlib.sha256(body).hexdigest().encode())
    etag = put_multipart(s3, "models", "m/big.bin", two_parts())
    assert etag.endswith("-2")
    store = Store(tmp_path / "root")
    snap = Fetcher(store, endpoint_url=s3.endpoint_url).ensure(granted("s3://models/m/"))

    checks = store.source_checks(snap.id)
    assert checks == {"config.json": "md5-etag", "crc.bin": "crc32", "sum.bin": "sha256", "w.bin": "sidecar",
                      "w.bin.sha256": "md5-etag", "big.bin": "multipart-md5"}
    manifest = json.loads(store.layout.manifest(snap.id).read_bytes())
    assert manifest["checks"] == dict(sorted(checks.items()))
    assert all(set(f) <= {"path", "size", "sha256", "etag", "version_id"} for f in manifest["files"]), \
        "a file entry with a new field is refused by the release before (records.file_entry)"

    env = {**os.environ, "WEIGHTCACHE_SOCKET": "/nonexistent/wc.sock", "KUBECONFIG": "/nonexistent"}
    ls = weightcache("ls", "-o", "json", "--root", str(store.root), env=env)
    assert json.loads(ls.stdout)[0]["source_checks"] == {"md5-etag": 2, "crc32": 1, "sha256": 1, "sidecar": 1,
                                                         "multipart-md5": 1}
    verify = weightcache("verify", "-o", "json", "--root", str(store.root), env=env)
    assert json.loads(verify.stdout)["snapshots"][0]["source_checks"] == checks
    table = weightcache("verify", "--root", str(store.root), env=env)
    assert "checked against the source by crc32 1, md5-etag 2, multipart-md5 1, sha256 1, sidecar 1" in table.stdout


def test_a_bit_flipped_in_a_two_part_object_is_refused(tmp_path: Path, s3: S3, fault_proxy: FaultProxy) -> None:
    parts = two_parts()
    put_multipart(s3, "models", "m/big.bin", parts)
    # every GET of its bytes (both rounds) flips one byte of the second part; HEADs pass untouched
    fault_proxy.add("flip", method="GET", path="/models/m/big.bin", at=5, count=-1)
    fetcher = Fetcher(Store(tmp_path / "root"), endpoint_url=fault_proxy.endpoint_url, chunk_size=8 * MiB)
    with pytest.raises(IntegrityError, match=r"big\.bin: md5-parts:5242880 .* does not match"):
        fetcher.ensure(granted("s3://models/m/"))
    assert fetcher.store.list() == []

    good = Fetcher(Store(tmp_path / "good"), endpoint_url=s3.endpoint_url).ensure(granted("s3://models/m/"))
    assert (good.path / "big.bin").read_bytes() == b"".join(parts)


@pytest.mark.parametrize("concurrency", [1, 8])
def test_a_bit_flipped_in_a_part_hashed_as_it_arrived_is_refused(tmp_path: Path, s3: S3, fault_proxy: FaultProxy,
                                                                 concurrency: int) -> None:
    """Ranges of 1 MiB pieces (journalled): each part's MD5 takes the pieces that continue it as they arrive, on
    the worker that read them (one worker: every piece; eight: those in order within their part), the in-order
    pass the rest. A flipped byte in any range is refused all the same, and the same fetch of good bytes passes."""
    parts = [os.urandom(5 * MiB), os.urandom(5 * MiB), os.urandom(MiB + 123)]
    put_multipart(s3, "models", "m/big.bin", parts)
    fault_proxy.add("flip", method="GET", path="/models/m/big.bin", at=MiB + 5, count=-1)
    settings: dict[str, Any] = {"chunk_size": MiB, "concurrency": concurrency}
    fetcher = Fetcher(Store(tmp_path / "root"), endpoint_url=fault_proxy.endpoint_url, **settings)
    with pytest.raises(IntegrityError, match=r"big\.bin: md5-parts:5242880 .* does not match"):
        fetcher.ensure(granted("s3://models/m/"))
    assert fetcher.store.list() == []

    good = Fetcher(Store(tmp_path / "good"), endpoint_url=s3.endpoint_url, **settings)
    snap = good.ensure(granted("s3://models/m/"))
    assert (snap.path / "big.bin").read_bytes() == b"".join(parts)
    assert good.store.source_checks(snap.id) == {"big.bin": "multipart-md5"}


@pytest.mark.parametrize("piece", [MiB, 3 * MiB, 7 * MiB])
def test_part_md5s_taken_as_pieces_arrive_in_any_order_give_the_multipart_etag(piece: int) -> None:
    parts = [os.urandom(5 * MiB), os.urandom(5 * MiB), os.urandom(MiB + 123)]
    body = b"".join(parts)
    etag = hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest() + "-3"
    pieces = [(at, memoryview(body)[at:at + piece]) for at in range(0, len(body), piece)]
    for seed in range(6):
        check = CompositeMD5(5 * MiB)
        for at, view in random.Random(seed).sample(pieces, len(pieces))[:seed]:  # the first `seed` to arrive
            check.update_at(at, view)
        for at in range(0, len(body), 2 * MiB + 1):  # the in-order pass, in steps that match no piece
            check.update(memoryview(body)[at:at + 2 * MiB + 1])
        assert check.hexdigest() == etag

    flipped = bytearray(body)
    flipped[6 * MiB] ^= 1
    check = CompositeMD5(5 * MiB)
    for at, _ in pieces:
        check.update_at(at, memoryview(flipped)[at:at + piece])
    check.update(flipped)
    assert check.hexdigest() != etag


def test_the_in_order_pass_is_pending_only_where_the_part_md5s_left_bytes() -> None:
    """`pending`: the in-order pass of bytes every part took as they arrived has nothing to hash, so the hashing
    worker does not hand it to a thread (download.PartialFile._feed: ~100 hand-overs of nothing per 88 MB)."""
    parts = [os.urandom(5 * MiB), os.urandom(5 * MiB), os.urandom(MiB + 123)]
    body = memoryview(b"".join(parts))
    etag = hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest() + "-3"
    check = CompositeMD5(5 * MiB)
    for at in range(0, 5 * MiB, MiB):  # the first part, as it arrived
        check.update_at(at, body[at:at + MiB])
    check.update_at(6 * MiB, body[6 * MiB:7 * MiB])  # the second part's second piece first: it continues nothing
    assert not check.pending(5 * MiB) and check.pending(5 * MiB + 1)
    check.update(body[:5 * MiB])
    assert check.pending(MiB)
    check.update_at(5 * MiB, body[5 * MiB:6 * MiB])
    assert not check.pending(MiB) and check.pending(MiB + 1)
    check.update(body[5 * MiB:])
    assert not check.pending(0) and check.hexdigest() == etag


def test_require_source_checksum_refuses_a_file_nothing_verifies(tmp_path: Path, s3: S3, plain: Any,
                                                                  fault_proxy: FaultProxy) -> None:
    plain.put_object(Bucket="models", Key="m/config.json", Body=b"{}")
    # parts of unequal sizes: their boundaries cannot be known from HEAD ?partNumber=1, so no check is possible
    put_multipart(s3, "models", "m/odd.bin", [os.urandom(5 * MiB), os.urandom(6 * MiB), b"tail"])
    strict = Fetcher(Store(tmp_path / "root"), endpoint_url=fault_proxy.endpoint_url, require_source_checksum=True)
    with pytest.raises(NotAllowedError, match=r"requireSourceChecksum refuses 1 file\(s\).*\(odd\.bin\)"):
        strict.ensure(granted("s3://models/m/"))
    assert not [r for r in fault_proxy.requests if r.method == "GET" and r.range], "refused before any download"

    lax = Fetcher(Store(tmp_path / "lax"), endpoint_url=s3.endpoint_url)
    snap = lax.ensure(granted("s3://models/m/"))
    assert lax.store.source_checks(snap.id) == {"config.json": "md5-etag", "odd.bin": "none"}


def test_require_source_checksum_from_the_environment_through_the_cli(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    env = {**os.environ, "WEIGHTCACHE_SOCKET": "/nonexistent/wc.sock", "KUBECONFIG": "/nonexistent",
           "WEIGHTCACHE_REQUIRE_SOURCE_CHECKSUM": "true"}
    done = weightcache("prefetch", f"file://{model}/", "--root", str(tmp_path / "root"), "-q", env=env)
    assert done.returncode == 8, done.stderr
    assert "requireSourceChecksum" in done.stderr and "Traceback" not in done.stderr
