"""Validate a .safetensors header before a file is published or loaded.

A safetensors file is

    [8 bytes: n, little-endian u64][n bytes: UTF-8 JSON header, may end in spaces][data: exactly the tensors' bytes]

and the header maps tensor names to `{"dtype", "shape", "data_offsets": [begin, end]}` with offsets relative to
the start of the data, plus an optional `"__metadata__"` str -> str map. A file that passes here can be mapped
and sliced without any further bounds check: every tensor lies inside the file, tensors are contiguous and do not
overlap, and the data has no gap and no trailing bytes (the rules the reference Rust implementation enforces).

Only the standard library: the daemon and the fetch engine call this without torch or numpy.

The header is untrusted input of up to 100 MB: the check is linear in its size (one C JSON parse, then one pass
that never multiplies unbounded numbers: every dimension and offset is range-checked first, and an element
count stops growing once it exceeds what the file could hold), errors quote at most a few dozen characters of
what they found, and every failure is a SafetensorsHeaderError naming the tensor (never OverflowError or
RecursionError). scripts/bench_header_check.py times a 100 MB header.
"""

from __future__ import annotations

import gc
import json
import os
import struct
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain, repeat
from math import prod
from operator import mul, sub
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from weightcache.errors import SafetensorsHeaderError

MAX_HEADER_BYTES = 100_000_000  # the reference implementation's limit
MAX_DIM = 2**63 - 1  # torch sizes are int64; the reference implementation parses them as usize
MAX_NDIM = 64  # numpy's limit; no tool writes more dimensions
QUOTE = 60  # characters of a found value an error message shows
_FIELDS = frozenset({"dtype", "shape", "data_offsets"})

# Size in bits: the sub-byte float formats (F4, F6_*) pack several elements per byte.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}


class TensorSpec(NamedTuple):
    """One tensor. `start`/`end` are ABSOLUTE byte offsets in the file (data_start + data_offsets).
    A NamedTuple: a 100 MB header holds over a million of them, built at C speed."""

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
            return _parse(fh, file_size, build=True)
    return _parse(f, file_size, build=True)


def check_file(path: str | os.PathLike[str]) -> None:
    """Validate a safetensors file on disk (its header and that the data region matches the file's size): the
    same rules as parse_header, without building the tensor table nobody reads (the fetch engine's check)."""
    with open(path, "rb") as fh:
        _parse(fh, os.fstat(fh.fileno()).st_size, build=False)


def _parse(f: BinaryIO, file_size: int, *, build: bool) -> Header:
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
    with _gc_paused():  # millions of new containers, none cyclic: collections would cost 20x the parse itself
        obj = _decode(name, raw)
        del raw
        metadata = _metadata(name, obj.pop("__metadata__", None))
        data_size = file_size - 8 - n
        ordered = _fast_specs(obj, 8 + n, data_size, build=build)
        if ordered is None:  # something is wrong: find it, one tensor at a time, and say which
            tensors = {key: _tensor(name, key, value, 8 + n, data_size) for key, value in obj.items()}
            ordered = dict(sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)))
            _check_layout(name, ordered, 8 + n, data_size)
        del obj  # freed while collections are off: the first one after would otherwise walk all of it
    return Header(header_len=n, data_start=8 + n, file_size=file_size, tensors=ordered, metadata=metadata)


_gc_lock = threading.Lock()
_gc_pausers = 0
_gc_was_enabled = True


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Cyclic GC off while any thread parses a header (it is process-wide: the last one out turns it back on)."""
    global _gc_pausers, _gc_was_enabled
    with _gc_lock:
        _gc_pausers += 1
        if _gc_pausers == 1:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()


def _fast_specs(obj: dict[str, Any], data_start: int, data_size: int, *,
                build: bool = True) -> dict[str, TensorSpec] | None:
    """The same rules as `_tensor` + `_check_layout`, column by column with builtins that loop in C (a million
    tensors in well under a second); None when any rule fails, and the slow path names the culprit."""
    try:
        return _columns(obj, data_start, data_size, build)
    except TypeError:  # an unhashable dtype, a list where a number belongs: the slow path says which
        return None


def _columns(obj: dict[str, Any], data_start: int, data_size: int, build: bool) -> dict[str, TensorSpec] | None:
    """The tensor table in file order, None when a rule fails; {} (valid, not built) when `build` is false."""
    if not obj:
        return {} if data_size == 0 else None
    entries = list(obj.values())  # each a tuple of (key, value) pairs, the JSON object as parsed
    if set(map(type, entries)) != {tuple} or set(map(len, entries)) != {3}:
        return None
    # Writers give every tensor's members in one order: take the first tensor's, and read all members from one
    # flat list (key, value, key, value, ...) by position instead of building a dict per tensor. Three distinct
    # keys per object also rules out a duplicate key inside a tensor.
    order = [key for key, _ in entries[0]]
    if set(order) != _FIELDS:
        return None
    flat = list(chain.from_iterable(chain.from_iterable(entries)))
    if flat[0::2] != order * len(entries):
        return None
    dtypes, shapes, offsets = (flat[2 * order.index(field) + 1::6] for field in ("dtype", "shape", "data_offsets"))
    del flat
    if not set(dtypes) <= DTYPE_BITS.keys() or set(map(type, shapes)) != {list} or set(map(type, offsets)) != {list}:
        return None
    if max(map(len, shapes)) > MAX_NDIM or set(map(len, offsets)) != {2}:
        return None
    dims, bounds = list(chain.from_iterable(shapes)), list(chain.from_iterable(offsets))
    for column, top in ((dims, MAX_DIM), (bounds, data_size)):
        if column and (not set(map(type, column)) <= {int} or min(column) < 0 or max(column) > top):
            return None
    del dims
    begins, ends = bounds[0::2], bounds[1::2]
    del bounds
    # at most MAX_NDIM dimensions below 2**63 each: products stay small enough for C-speed arithmetic
    bits = list(map(mul, map(prod, shapes), map(DTYPE_BITS.__getitem__, dtypes)))
    if list(map(mul, map(sub, ends, begins), repeat(8))) != bits:
        return None  # also catches end < begin: a negative extent never equals bits >= 0
    rank: list[int] = []
    if 0 in bits:  # empty tensors may share an offset with the next one: file order is by (begin, end)
        rank = sorted(range(len(begins)), key=list(zip(begins, ends, strict=True)).__getitem__)
        first, last = list(map(begins.__getitem__, rank)), list(map(ends.__getitem__, rank))
    else:  # all sizes > 0: each column sorted on its own tiles the data iff the tensors do (begins then distinct)
        first, last = sorted(begins), sorted(ends)
    if first[0] != 0 or last[-1] != data_size or first[1:] != last[:-1]:
        return None
    if not build:
        return {}
    rank = rank or sorted(range(len(begins)), key=begins.__getitem__)
    names = list(obj)
    rows = zip(dtypes, map(tuple, shapes), map(data_start.__add__, begins), map(data_start.__add__, ends),
               strict=True)
    specs = list(map(tuple.__new__, repeat(TensorSpec), rows))  # TensorSpec._make without a Python call each
    return dict(zip(map(names.__getitem__, rank), map(specs.__getitem__, rank), strict=True))


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
        # JSON objects become tuples of (key, value) pairs (a C builtin as the hook: no Python call per object),
        # JSON arrays stay lists; _object() turns pairs into a dict, refusing duplicate keys
        obj = json.loads(text, object_pairs_hook=tuple, parse_constant=_no_constants)
    except RecursionError:
        raise _err(name, "the header JSON is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError and our hooks
        raise _err(name, f"the header is not valid JSON ({exc})") from None
    if not isinstance(obj, tuple):
        raise _err(name, f"the header must be a JSON object, not {type(obj).__name__}")
    return _object(name, "the header", obj)


def _object(name: str, what: str, pairs: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise _err(name, f"{what} has a duplicate key {_quote(duplicate)}")
    return out


def _no_constants(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")


def _metadata(name: str, value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, tuple):
        raise _err(name, "__metadata__ must map strings to strings")
    meta = _object(name, "__metadata__", value)
    if set(map(type, meta)) | set(map(type, meta.values())) > {str}:
        raise _err(name, "__metadata__ must map strings to strings")
    return meta


def _tensor(name: str, key: str, value: Any, data_start: int, data_size: int) -> TensorSpec:
    label = f"tensor {_quote(key)}"
    if isinstance(value, tuple):
        value = _object(name, label, value)
    if not isinstance(value, Mapping):
        raise _err(name, f"{label} must be an object with dtype, shape and data_offsets")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise _err(name, f"{label} has unknown dtype {_quote(dtype)} (known: {', '.join(DTYPE_BITS)})")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_is_uint(d, MAX_DIM) for d in shape):
        raise _err(name, f"{label} shape must be a list of at most {MAX_NDIM} non-negative integers below 2**63, "
                         f"got {_quote(shape)}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_uint(o, data_size) for o in offsets):
        raise _err(name, f"{label} data_offsets must be [begin, end] within the {data_size} data bytes "
                         f"(truncated?), got {_quote(offsets)}")
    begin, end = offsets
    if begin > end:
        raise _err(name, f"{label} data_offsets [{begin}, {end}] end before they begin")
    bits = _bits(shape, DTYPE_BITS[dtype], limit=max(8 * data_size, 1 << 64))
    if bits is None or bits % 8 or bits // 8 != end - begin:
        needs = "more bytes than the file holds" if bits is None else f"{bits // 8}{'.5' if bits % 8 else ''} bytes"
        raise _err(name, f"{label}: shape {_quote(shape)} of {dtype} needs {needs} "
                         f"but data_offsets [{begin}, {end}] hold {end - begin}")
    return TensorSpec(dtype=dtype, shape=tuple(shape), start=data_start + begin, end=data_start + end)


def _bits(shape: list[int], dtype_bits: int, *, limit: int) -> int | None:
    """shape's element count x dtype_bits, or None once it passes `limit`: every step multiplies numbers below
    2**64 by one below 2**63, so a long shape costs linear time, never big-number arithmetic."""
    if 0 in shape:
        return 0
    total = dtype_bits
    for dim in shape:
        total *= dim
        if total > limit:
            return None
    return total


def _is_uint(value: Any, maximum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= maximum


def _quote(value: Any) -> str:
    """A short repr of untrusted input: an error message must not carry megabytes of it."""
    if isinstance(value, (str, list, tuple)) and len(value) > QUOTE:
        value = value[:QUOTE]  # repr of a slice: never of the whole thing
    text = repr(value)
    return text if len(text) <= QUOTE else f"{text[:QUOTE]}... ({len(text)} characters)"


def _check_layout(name: str, tensors: dict[str, TensorSpec], data_start: int, data_size: int) -> None:
    """Contiguous from the first data byte, no overlap, and the last tensor ends exactly at the end of the file."""
    pos = data_start
    for key, spec in tensors.items():
        if spec.start != pos:
            what = "overlaps the previous tensor" if spec.start < pos else f"leaves a gap of {spec.start - pos} bytes"
            raise _err(name, f"tensor {_quote(key)} at data offset {spec.start - data_start} {what}")
        pos = spec.end
    covered = pos - data_start
    if covered > data_size:
        raise _err(name, f"tensors need {covered} data bytes but the file holds {data_size} (truncated?)")
    if covered < data_size:
        raise _err(name, f"{data_size - covered} bytes after the last tensor belong to no tensor")
