"""Integrity per store semantics: S3 full-object checksums, ETags that are no MD5s, file:// rewritten mid-read."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config

import weightcache.sources.fsspec as fsspec_source
from tests.faultproxy import FaultProxy
from tests.fixtures_s3 import S3
from tests.grants import granted
from weightcache.errors import IntegrityError
from weightcache.fetch import Fetcher
from weightcache.store import Store

BODY = bytes(range(256)) * 1024  # 256 KiB


def _plain_client(endpoint: str) -> Any:
    """An uploader that sends no checksum (older SDKs, other tools): S3 then keeps only the ETag."""
    config = Config(s3={"addressing_style": "path"}, request_checksum_calculation="when_required")
    return boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)


def test_a_full_object_crc32_catches_corruption_without_an_md5(tmp_path: Path, s3: S3, fault_proxy: FaultProxy) -> None:
    s3.put("models", "m/w.bin", BODY)  # botocore adds a full-object CRC32
    fault_proxy.reverse_etags = True  # and the ETag is no MD5 (as with SSE-KMS): only the CRC32 can tell
    fault_proxy.add("flip", method="GET", path="w.bin", ranged_only=True, count=-1, at=7)
    f = Fetcher(Store(tmp_path / "root"), endpoint_url=fault_proxy.endpoint_url)
    with pytest.raises(IntegrityError, match=r"w\.bin: crc32"):
        f.ensure(granted("s3://models/m/"))
    assert f.store.list() == []


def test_sse_kms_etags_are_not_checked_as_md5s(tmp_path: Path, s3: S3, fault_proxy: FaultProxy) -> None:
    s3.create_bucket("models")
    _plain_client(s3.endpoint_url).put_object(Bucket="models", Key="m/w.bin", Body=BODY, ServerSideEncryption="aws:kms")
    fault_proxy.reverse_etags = True  # 32 hex digits that are not the MD5 of the body, as KMS ETags are
    snap = Fetcher(Store(tmp_path / "root"), endpoint_url=fault_proxy.endpoint_url).ensure(granted("s3://models/m/"))
    assert (snap.path / "w.bin").read_bytes() == BODY


def test_an_md5_etag_still_catches_corruption_when_nothing_else_does(tmp_path: Path, s3: S3,
                                                                     fault_proxy: FaultProxy) -> None:
    s3.create_bucket("models")
    _plain_client(s3.endpoint_url).put_object(Bucket="models", Key="m/w.bin", Body=BODY)
    fault_proxy.add("flip", method="GET", path="w.bin", ranged_only=True, count=-1, at=7)
    with pytest.raises(IntegrityError, match=r"w\.bin: md5"):
        Fetcher(Store(tmp_path / "root"), endpoint_url=fault_proxy.endpoint_url).ensure(granted("s3://models/m/"))


def test_a_local_file_rewritten_in_place_mid_read_is_refetched_whole(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "model"
    src.mkdir()
    path = src / "w.bin"
    path.write_bytes(BODY)
    os.utime(path, ns=(10**18, 10**18))  # an old mtime: the rewrite surely changes it, whatever the clock's tick
    new = bytes(reversed(BODY))
    real_fill = fsspec_source._pread_fill
    rewritten: list[bool] = []

    def fill_then_rewrite(fd: int, view: memoryview, pos: int) -> int:
        """Read half, rewrite the file in place (same inode, same size), read the rest: a torn read."""
        if rewritten:
            return real_fill(fd, view, pos)
        half = real_fill(fd, view[: len(view) // 2], pos)
        with open(path, "r+b") as out:
            out.write(new)
        rewritten.append(True)
        return half + real_fill(fd, view[half:], pos + half)

    monkeypatch.setattr(fsspec_source, "_pread_fill", fill_then_rewrite)
    snap = Fetcher(Store(tmp_path / "root"), chunk_size=1 << 20).ensure(granted(f"file://{src}/"))
    assert rewritten
    assert (snap.path / "w.bin").read_bytes() == new, "a mix of two versions was published"


def test_the_stores_sha256_is_verified_not_only_trusted(tmp_path: Path, s3: S3, fault_proxy: FaultProxy) -> None:
    s3.put("models", "m/w.bin", BODY, ChecksumAlgorithm="SHA256")
    fault_proxy.add("flip", method="GET", path="w.bin", ranged_only=True, count=-1, at=7)
    f = Fetcher(Store(tmp_path / "root"), endpoint_url=fault_proxy.endpoint_url)
    with pytest.raises(IntegrityError, match=r"w\.bin: sha256 .* does not match"):
        f.ensure(granted("s3://models/m/"))
    assert f.store.list() == []
