"""The CRCs S3 keeps (CRC32, CRC32C, CRC64NVME) are checked on every node, with no optional package: each against
the catalogue's check value and a bitwise reference written here from the CRC parameters (not the library under
test), across split updates; and end to end, an object whose only full-object checksum is a CRC64NVME or a CRC32C
(what new AWS objects carry) is verified by it, not by an MD5 of its ETag, and a flipped byte is refused. Before:
without awscrt those objects fell back to the MD5 ETag (1.5 CPU s/GB on top of sha256), or to nothing."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from tests.faultproxy import FaultProxy
from tests.fixtures_s3 import S3
from tests.grants import granted
from weightcache.checksums import CRCS, FACTORIES, new_hasher
from weightcache.errors import IntegrityError
from weightcache.fetch import Fetcher
from weightcache.store import Store

#: reflected polynomial, width (init and final xor are all ones for the three): the Rocksoft parameters that
#: reveng's catalogue gives for CRC-32/ISO-HDLC, CRC-32/ISCSI and CRC-64/NVME
PARAMS = {"crc32": (0xEDB88320, 32), "crc32c": (0x82F63B78, 32), "crc64nvme": (0x9A6C9329AC4BC9B5, 64)}
CHECK = {"crc32": 0xCBF43926, "crc32c": 0xE3069283, "crc64nvme": 0xAE8B14860A799888}  # of b"123456789"


def reference(algorithm: str, data: bytes) -> int:
    poly, width = PARAMS[algorithm]
    ones = (1 << width) - 1
    crc = ones
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ poly if crc & 1 else crc >> 1
    return crc ^ ones


@pytest.mark.parametrize("algorithm", sorted(PARAMS))
def test_each_crc_matches_its_catalogue_entry_across_split_updates(algorithm: str) -> None:
    assert algorithm in FACTORIES and algorithm in CRCS, "computable on every node: no optional package"
    hasher = new_hasher(algorithm)
    assert hasher is not None
    hasher.update(b"123456789")
    assert int(hasher.hexdigest(), 16) == CHECK[algorithm] == reference(algorithm, b"123456789")
    empty = new_hasher(algorithm)
    assert empty is not None and int(empty.hexdigest(), 16) == 0
    data = os.urandom(3000)
    split = new_hasher(algorithm)
    assert split is not None
    for piece in (data[:1], b"", data[1:1500], memoryview(data)[1500:]):
        split.update(piece)
    assert split.hexdigest() == f"{reference(algorithm, data):0{PARAMS[algorithm][1] // 4}x}"


def put_with(s3: S3, key: str, body: bytes, algorithm: str) -> None:
    """put_object naming the CRC the store keeps, its value computed by the reference above (S3 checks it)."""
    value = reference(algorithm, body).to_bytes(PARAMS[algorithm][1] // 8, "big")
    s3.put("models", key, body, ChecksumAlgorithm=algorithm.upper(),
           **{f"Checksum{algorithm.upper()}": base64.b64encode(value).decode()})


@pytest.mark.parametrize("algorithm", ["crc64nvme", "crc32c"])
def test_an_object_with_only_a_crc_is_verified_by_it_and_a_flipped_byte_refused(
        tmp_path: Path, s3: S3, fault_proxy: FaultProxy, algorithm: str) -> None:
    body = os.urandom(4096)
    put_with(s3, "m/w.bin", body, algorithm)
    head = s3.client.head_object(Bucket="models", Key="m/w.bin", ChecksumMode="ENABLED")
    assert head.get(f"Checksum{algorithm.upper()}"), "the store keeps the CRC it was given"
    store = Store(tmp_path / "root")
    snap = Fetcher(store, endpoint_url=s3.endpoint_url).ensure(granted("s3://models/m/"))
    assert store.source_checks(snap.id) == {"w.bin": algorithm}
    assert (snap.path / "w.bin").read_bytes() == body

    fault_proxy.add("flip", method="GET", path="/models/m/w.bin", at=100, count=-1)
    bad = Fetcher(Store(tmp_path / "bad"), endpoint_url=fault_proxy.endpoint_url)
    with pytest.raises(IntegrityError, match=rf"w\.bin: {algorithm} .* does not match"):
        bad.ensure(granted("s3://models/m/"))
    assert bad.store.list() == []
