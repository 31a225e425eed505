"""Whole-object checksums an object store declares, computed incrementally over the bytes we download.

S3 keeps full-object CRC32, CRC32C, CRC64NVME or SHA-256 checksums (the digest as big-endian bytes, base64 in
headers; here lowercase hex); new AWS objects carry a CRC64NVME by default, boto3 uploads a CRC32. SHA-256 comes
from hashlib, the three CRCs from anycrc (carry-less multiplication in C, no dependencies, wheels for x86-64 and
arm64). Measured on the development VM (`scripts/bench_checksums.py --runs 5`, 1 MiB buffers, CPU s/GB): anycrc
CRC32 0.084, CRC32C 0.081, CRC64NVME 0.081; zlib's CRC32 0.28; awscrt CRC32C 0.051, CRC64NVME 0.082, CRC32 0.39
(and once installed, awscrt turns botocore's request signing over to the CRT); crc32c 0.049, google-crc32c 0.044
(CRC32C only); sha256 0.65, MD5 1.54. One package for the three: a CRC costs an eighth of the sha256 every blob
gets anyway, and an MD5 ETag is the check of last resort.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Protocol

import anycrc


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


class SourceCheck(Protocol):
    """A source's checksum over a download. `update` takes every byte in order; `update_at` is offered each
    piece as it arrives, in any order, and takes what the algorithm can (a multipart ETag's part MD5s:
    peers/identity.py, CompositeMD5), so that `update` then passes over it."""

    def update(self, data: bytes | memoryview, /) -> None: ...

    def update_at(self, offset: int, data: memoryview, /) -> None: ...

    def pending(self, length: int, /) -> bool:
        """Whether `update` of the next `length` bytes has any to hash (update_at took none or not all of them):
        False, and the caller need not hand them to a thread of their own."""
        ...

    def hexdigest(self) -> str: ...


class InOrder:
    """The SourceCheck of a hasher that takes bytes in order only (an MD5, a CRC): `update_at` leaves them all
    to `update`."""

    def __init__(self, hasher: Hasher) -> None:
        self._hasher = hasher

    def update(self, data: bytes | memoryview, /) -> None:
        self._hasher.update(data)

    def update_at(self, offset: int, data: memoryview, /) -> None:
        pass

    def pending(self, length: int, /) -> bool:
        return length > 0

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()


class Crc:
    """A CRC as a hashlib-style object. Cheap enough to run where the bytes are (no thread of its own:
    `CRCS` names the algorithms that are)."""

    def __init__(self, model: anycrc.Model, width: int) -> None:
        self._model, self._width, self._crc = model, width, 0

    def update(self, data: bytes | memoryview, /) -> None:
        if len(data):  # anycrc answers an empty buffer with the model's raw init, not the CRC so far
            self._crc = self._model.calc(data, self._crc)

    def hexdigest(self) -> str:
        return f"{self._crc:0{self._width // 4}x}"


#: S3's name (lowercase, without "Checksum") -> anycrc's catalogue name and the width in bits
_CRC_MODELS = {"crc32": ("CRC32-ISO-HDLC", 32), "crc32c": ("CRC32-ISCSI", 32), "crc64nvme": ("CRC64-NVME", 64)}
#: the algorithms that are CRCs: a few hundredths of a CPU second per GB, never worth a hand-over to a thread
CRCS = frozenset(_CRC_MODELS)


def _crc_factory(name: str, width: int) -> Callable[[], Hasher]:
    model = anycrc.Model(name)  # tables built once; calc keeps no state
    return lambda: Crc(model, width)


#: checksum name (lowercase, as S3 spells it without "Checksum") -> a new hasher
FACTORIES: dict[str, Callable[[], Hasher]] = {
    "sha256": hashlib.sha256,
    **{algorithm: _crc_factory(name, width) for algorithm, (name, width) in _CRC_MODELS.items()},
}


def new_hasher(algorithm: str) -> Hasher | None:
    """A hasher for `algorithm`, or None when this node cannot compute it."""
    factory = FACTORIES.get(algorithm)
    return factory() if factory is not None else None
