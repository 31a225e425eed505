"""The S3 source against Ceph radosgw (a real S3 server: signatures checked, If-Match enforced, multipart and
versioning its own): listing, pinning, multipart objects, versions, what verified each file, wrong credentials."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.faultproxy import FaultProxy
from tests.grants import granted
from tests_objstores.conftest import Bucket, wc
from tests_objstores.servers import Rgw
from weightcache.errors import IntegrityError, ObjectChangedError, SourceAccessDeniedError
from weightcache.fetch import Fetcher
from weightcache.sources import ClientPool, open_source
from weightcache.store import Store
from weightcache.uri import parse_ref

MiB = 1 << 20


def test_listing_skips_markers_and_keeps_nested_keys(rgw_bucket: Bucket) -> None:
    for key in ("m/config.json", "m/sub/w.bin", "m/sub/", "m2/other.bin", "mother.bin"):
        rgw_bucket.put(key, b"x" * len(key))
    source = open_source(parse_ref(rgw_bucket.uri("m/")), endpoint_url=rgw_bucket.endpoint_url)
    try:
        listed = source.list()
    finally:
        source.close()
    assert [(o.relpath, o.size) for o in listed] == [("config.json", 13), ("sub/w.bin", 11)]
    assert all(o.etag and len(o.etag) == 32 for o in listed)  # single part: MD5 ETags


def test_a_read_pinned_to_the_listed_etag_gets_412_after_a_change(rgw_bucket: Bucket) -> None:
    rgw_bucket.put("m/w.bin", b"a" * 1000)
    source = open_source(parse_ref(rgw_bucket.uri("m/")), endpoint_url=rgw_bucket.endpoint_url, max_attempts=1)
    try:
        [obj] = source.list()
        buf = bytearray(10)
        source.read_into(obj, 0, memoryview(buf))
        assert bytes(buf) == b"a" * 10
        rgw_bucket.put("m/w.bin", b"b" * 1000)  # same size, another version
        with pytest.raises(ObjectChangedError, match="PreconditionFailed"):
            source.read_into(obj, 10, memoryview(buf))
    finally:
        source.close()


def test_multipart_objects_are_checked_by_their_part_md5s(rgw_bucket: Bucket, tmp_path: Path) -> None:
    parts = [os.urandom(5 * MiB), os.urandom(MiB + 7)]
    out = rgw_bucket.put_multipart("m/big.bin", parts)
    del out  # radosgw 16 answers CompleteMultipartUpload with an empty ETag; HEAD and the listing have it
    rgw_bucket.put("m/config.json", b"{}")
    store = Store(tmp_path / "root")
    snap = Fetcher(store, endpoint_url=rgw_bucket.endpoint_url).ensure(granted(rgw_bucket.uri("m/")))
    assert (snap.path / "big.bin").read_bytes() == b"".join(parts)
    # radosgw 16 keeps no flexible checksums: the ETags are what there is
    assert store.source_checks(snap.id) == {"big.bin": "multipart-md5", "config.json": "md5-etag"}


def test_a_bit_flipped_in_a_two_part_object_is_refused(rgw_bucket: Bucket, rgw: Rgw, tmp_path: Path,
                                                       tier_env: Callable[..., dict[str, str]]) -> None:
    rgw_bucket.put_multipart("m/big.bin", [os.urandom(5 * MiB), os.urandom(MiB)])
    with FaultProxy(rgw.endpoint_url) as proxy:
        proxy.add("flip", method="GET", path=f"/{rgw_bucket.name}/m/big.bin", at=MiB, count=-1)
        done = wc("prefetch", rgw_bucket.uri("m/"), "--root", str(tmp_path / "root"), "-q",
                  env=tier_env(AWS_ENDPOINT_URL=proxy.endpoint_url))
    assert done.returncode == 7, done.stderr
    assert "big.bin: md5-parts" in done.stderr and "does not match" in done.stderr
    with FaultProxy(rgw.endpoint_url) as proxy, pytest.raises(IntegrityError):  # and in-process, the same
        proxy.add("flip", method="GET", path=f"/{rgw_bucket.name}/m/big.bin", at=7, count=-1)
        Fetcher(Store(tmp_path / "r2"), endpoint_url=proxy.endpoint_url).ensure(granted(rgw_bucket.uri("m/")))


def test_parts_of_a_size_not_tried_are_refused_saying_the_part_size_was_guessed(
        rgw_bucket: Bucket, tmp_path: Path, tier_env: Callable[..., dict[str, str]]) -> None:
    """radosgw 16 ignores ?partNumber=, so the part size is guessed (s3.PART_SIZES); valid bytes uploaded in 6 MiB
    parts match no guess. Before, exit 7 said only "md5-parts:5242880 ... does not match the source's ...-3", which
    reads as corruption (the issue 35 audit, by hand against radosgw); now it says the size was guessed."""
    rgw_bucket.put_multipart("m/odd.bin", [os.urandom(6 * MiB), os.urandom(6 * MiB), b"x" * 10])
    done = wc("prefetch", rgw_bucket.uri("m/"), "--root", str(tmp_path / "root"), "-q", env=tier_env())
    assert done.returncode == 7, done.stderr
    assert "odd.bin: md5-parts:5242880" in done.stderr, done.stderr
    assert "the store does not say its part size; tried 5 MiB" in done.stderr, done.stderr


def test_a_versioned_bucket_lists_the_current_versions(rgw_bucket: Bucket, tmp_path: Path) -> None:
    rgw_bucket.client.put_bucket_versioning(Bucket=rgw_bucket.name, VersioningConfiguration={"Status": "Enabled"})
    rgw_bucket.put("m/w.bin", b"old")
    rgw_bucket.put("m/w.bin", b"current")
    rgw_bucket.put("m/gone.bin", b"deleted")
    rgw_bucket.client.delete_object(Bucket=rgw_bucket.name, Key="m/gone.bin")  # a delete marker
    versions = rgw_bucket.client.list_object_versions(Bucket=rgw_bucket.name, Prefix="m/")
    assert len(versions["Versions"]) == 3 and len(versions["DeleteMarkers"]) == 1
    snap = Fetcher(Store(tmp_path / "root"), endpoint_url=rgw_bucket.endpoint_url).ensure(
        granted(rgw_bucket.uri("m/")))
    assert [f.path for f in snap.files] == ["w.bin"]
    assert (snap.path / "w.bin").read_bytes() == b"current"


def test_a_checksum_asked_for_on_upload(rgw_bucket: Bucket, tmp_path: Path) -> None:
    """boto3 asks for a CRC32 on every upload; radosgw 16 takes the upload but keeps no flexible checksum, so the
    MD5 ETag verifies the bytes (a store that keeps one: tests/test_fetch_source_checks.py, moto)."""
    rgw_bucket.put("m/w.bin", b"weights", ChecksumAlgorithm="SHA256")
    store = Store(tmp_path / "root")
    snap = Fetcher(store, endpoint_url=rgw_bucket.endpoint_url).ensure(granted(rgw_bucket.uri("m/")))
    assert (snap.path / "w.bin").read_bytes() == b"weights"
    assert store.source_checks(snap.id)["w.bin"] in ("sha256", "md5-etag")


def test_wrong_credentials_exit_6_without_the_secret(rgw_bucket: Bucket, tmp_path: Path,
                                                     tier_env: Callable[..., dict[str, str]]) -> None:
    rgw_bucket.put("m/config.json", b"{}")
    wrong = "not-the-secret-7f3a9b"
    for env in (tier_env(AWS_SECRET_ACCESS_KEY=wrong), tier_env(AWS_ACCESS_KEY_ID="AKIANOSUCHUSER0000",
                                                                AWS_SECRET_ACCESS_KEY=wrong)):
        done = wc("prefetch", rgw_bucket.uri("m/"), "--root", str(tmp_path / "root"), "-q", env=env)
        assert done.returncode == 6, done.stderr
        assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
        assert wrong not in done.stderr
        assert "SignatureDoesNotMatch" in done.stderr or "InvalidAccessKeyId" in done.stderr, done.stderr


def test_a_kept_client_serves_the_next_source_only_with_the_same_credentials(rgw_bucket: Bucket,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon's next fetch takes the botocore client the last one gave back (its connections open), never one
    another source holds, and credentials rotated in between get a client of their own: radosgw refuses the wrong
    secret, then the right one works again."""
    rgw_bucket.put("m/config.json", b"{}")
    pool = ClientPool()  # the daemon's, handed to each of its sources

    def listing() -> tuple[object, list[str]]:
        source = open_source(parse_ref(rgw_bucket.uri("m/")), endpoint_url=rgw_bucket.endpoint_url, max_attempts=1,
                             clients=pool)
        try:
            return source._client, [o.relpath for o in source.list()]  # type: ignore[attr-defined]
        finally:
            source.close()

    first, names = listing()
    assert names == ["config.json"]
    assert listing()[0] is first
    held = open_source(parse_ref(rgw_bucket.uri("m/")), endpoint_url=rgw_bucket.endpoint_url, clients=pool)
    try:
        assert held._client is first  # type: ignore[attr-defined]
        assert listing()[0] is not first  # held: the other source gets a client of its own
    finally:
        held.close()
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "rotated-but-wrong-7f3a")
    with pytest.raises(SourceAccessDeniedError, match="SignatureDoesNotMatch"):
        listing()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    assert listing() == (first, ["config.json"])
