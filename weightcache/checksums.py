"""Whole-object checksums an object store declares, computed incrementally over the bytes we download.

S3 keeps full-object CRC32, CRC32C, CRC64NVME or SHA-256 checksums (the digest as big-endian bytes, base64 in
headers; here lowercase hex). CRC32 comes from zlib and SHA-256 from hashlib; CRC32C and CRC64NVME need awscrt
(botocore's optional CRT extra), so without it those are not checked and MD5 ETags or nothing stand in.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable
from typing import Protocol


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    """zlib's CRC-32 (the one S3 calls CRC32), as a hashlib-style object."""

    def __init__(self) -> None:
        self._crc = 0

    def update(self, data: bytes | memoryview, /) -> None:
        self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        return f"{self._crc:08x}"


class _Crt:
    """awscrt's CRC32C/CRC64NVME (C implementations), as a hashlib-style object."""

    def __init__(self, fn: Callable[[bytes | memoryview, int], int], width: int) -> None:
        self._fn, self._width, self._crc = fn, width, 0

    def update(self, data: bytes | memoryview, /) -> None:
        self._crc = self._fn(data, self._crc)

    def hexdigest(self) -> str:
        return f"{self._crc:0{self._width}x}"


def _factories() -> dict[str, Callable[[], Hasher]]:
    out: dict[str, Callable[[], Hasher]] = {"sha256": hashlib.sha256, "crc32": _Crc32}
    try:
        from awscrt import checksums  # type: ignore[import-not-found]
    except ImportError:
        return out
    out["crc32c"] = lambda: _Crt(checksums.crc32c, 8)
    out["crc64nvme"] = lambda: _Crt(checksums.crc64nvme, 16)
    return out


#: checksum name (lowercase, as S3 spells it without "Checksum") -> a new hasher
FACTORIES: dict[str, Callable[[], Hasher]] = _factories()


def new_hasher(algorithm: str) -> Hasher | None:
    """A hasher for `algorithm`, or None when this node cannot compute it."""
    factory = FACTORIES.get(algorithm)
    return factory() if factory is not None else None
