"""Validate a .safetensors header before a file is published or loaded.

A safetensors file is

    [8 bytes: n, little-endian u64][n bytes: UTF-8 JSON header, may end in spaces][data: exactly the tensors' bytes]

and the header maps tensor names to `{"dtype", "shape", "data_offsets": [begin, end]}` with offsets relative to
the start of the data, plus an optional `"__metadata__"` str -> str map. A file that passes here can be mapped
and sliced without any further bounds check: every tensor lies inside the file, tensors are contiguous and do not
overlap, and the data has no gap and no trailing bytes (the rules the reference Rust implementation enforces).

Only the standard library: the daemon and the fetch engine call this without torch or numpy.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from weightcache.errors import SafetensorsHeaderError

MAX_HEADER_BYTES = 100_000_000  # the reference implementation's limit

# Size in bits: the sub-byte float formats (F4, F6_*) pack several elements per byte.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor. `start`/`end` are ABSOLUTE byte offsets in the file (data_start + data_offsets)."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    """A validated header. `tensors` is in file order (ascending `start`); treat it as read-only."""

    header_len: int  # n, the JSON header's length
    data_start: int  # 8 + n: where tensor data begins
    file_size: int
    tensors: dict[str, TensorSpec]
    metadata: dict[str, str]


def parse_header(f: BinaryIO | str | os.PathLike[str], file_size: int) -> Header:
    """Read and validate the header of a safetensors file of `file_size` bytes (a path or a binary file object)."""
    if isinstance(f, (str, os.PathLike)):
        with open(f, "rb") as fh:
            return parse_header(fh, file_size)
    name = str(getattr(f, "name", "<stream>"))
    f.seek(0)
    prefix = f.read(8)
    if len(prefix) < 8 or file_size < 8:
        raise _err(name, f"the file has {max(file_size, len(prefix))} bytes, fewer than the 8-byte header length")
    (n,) = struct.unpack("<Q", prefix)
    if n < 2 or n > MAX_HEADER_BYTES:
        raise _err(name, f"header length {n} is outside 2..{MAX_HEADER_BYTES} bytes")
    if 8 + n > file_size:
        raise _err(name, f"header length {n} runs past the end of the {file_size}-byte file (truncated?)")
    raw = f.read(n)
    if len(raw) != n:
        raise _err(name, f"the file ends inside the header ({len(raw)} of {n} bytes)")
    obj = _decode(name, raw)
    metadata = _metadata(name, obj.pop("__metadata__", None))
    data_size = file_size - 8 - n
    tensors = {key: _tensor(name, key, value, 8 + n) for key, value in obj.items()}
    ordered = dict(sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)))
    _check_layout(name, ordered, 8 + n, data_size)
    return Header(header_len=n, data_start=8 + n, file_size=file_size, tensors=ordered, metadata=metadata)


def check_file(path: str | os.PathLike[str]) -> Header:
    """Validate a safetensors file on disk (its header and that the data region matches the file's size)."""
    with open(path, "rb") as fh:
        return parse_header(fh, os.fstat(fh.fileno()).st_size)


def _err(name: str, problem: str) -> SafetensorsHeaderError:
    return SafetensorsHeaderError(
        f"{Path(name).name}: invalid safetensors file: {problem}; re-export or re-upload the file "
        f"(safetensors.torch.save_file writes valid ones)"
    )


def _decode(name: str, raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _err(name, f"the header is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except RecursionError:
        raise _err(name, "the header JSON is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError and our hooks
        raise _err(name, f"the header is not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise _err(name, f"the header must be a JSON object, not {type(obj).__name__}")
    return obj


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constants(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")


def _metadata(name: str, value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise _err(name, "__metadata__ must map strings to strings")
    return dict(value)


def _tensor(name: str, key: str, value: Any, data_start: int) -> TensorSpec:
    if not isinstance(value, Mapping):
        raise _err(name, f"tensor {key!r} must be an object with dtype, shape and data_offsets")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise _err(name, f"tensor {key!r} has unknown dtype {dtype!r} (known: {', '.join(DTYPE_BITS)})")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise _err(name, f"tensor {key!r} shape must be a list of non-negative integers, got {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_uint(o) for o in offsets):
        raise _err(name, f"tensor {key!r} data_offsets must be [begin, end] non-negative integers, got {offsets!r}")
    begin, end = offsets
    if begin > end:
        raise _err(name, f"tensor {key!r} data_offsets [{begin}, {end}] end before they begin")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != end - begin:
        raise _err(name, f"tensor {key!r}: shape {shape} of {dtype} needs {bits / 8:g} bytes "
                         f"but data_offsets [{begin}, {end}] hold {end - begin}")
    return TensorSpec(dtype=dtype, shape=tuple(shape), start=data_start + begin, end=data_start + end)


def _is_uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_layout(name: str, tensors: dict[str, TensorSpec], data_start: int, data_size: int) -> None:
    """Contiguous from the first data byte, no overlap, and the last tensor ends exactly at the end of the file."""
    pos = data_start
    for key, spec in tensors.items():
        if spec.start != pos:
            what = "overlaps the previous tensor" if spec.start < pos else f"leaves a gap of {spec.start - pos} bytes"
            raise _err(name, f"tensor {key!r} at data offset {spec.start - data_start} {what}")
        pos = spec.end
    covered = pos - data_start
    if covered > data_size:
        raise _err(name, f"tensors need {covered} data bytes but the file holds {data_size} (truncated?)")
    if covered < data_size:
        raise _err(name, f"{data_size - covered} bytes after the last tensor belong to no tensor")
