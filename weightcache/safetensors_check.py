"""Validate a .safetensors header before a file is published or loaded.

A safetensors file is

    [8 bytes: n, little-endian u64][n bytes: UTF-8 JSON header, may end in spaces][data: exactly the tensors' bytes]

and the header maps tensor names to `{"dtype", "shape", "data_offsets": [begin, end]}` with offsets relative to
the start of the data, plus an optional `"__metadata__"` str -> str map. A file that passes here can be mapped
and sliced without any further bounds check: every tensor lies inside the file, tensors are contiguous and do not
overlap, and the data has no gap and no trailing bytes (the rules the reference Rust implementation enforces).

No torch or numpy: the daemon and the fetch engine call this in worker threads, never on an event loop.

The header is untrusted input of up to 100 MB: the check is linear in its size and never multiplies unbounded
numbers (every dimension and offset is range-checked first, and an element count stops growing once it exceeds
what the file could hold); errors quote at most a few dozen characters of what they found, and every failure is
a SafetensorsHeaderError naming the tensor (never OverflowError or RecursionError).

Parsing (the standard library's json alone takes longer than the 2 s budget for 100 MB), three roads:
1. msgspec decodes the header straight into typed tensors, checking types and ranges in C as it reads; a few
   passes over columns check sizes and layout: a header of the usual form is decided here (_check_typed).
2. Anything else: msgspec's plain tree, checked column by column (_check_tree).
3. Where msgspec refuses the text (json reads lone surrogates and 1e400) or may have read it otherwise: the
   standard library's json decides, as it always did (_decode).
msgspec keeps the last of repeated keys where json refuses them, so roads 1 and 2 stand only when counting proves
that no key was dropped (_no_duplicates). All three give the same verdict and the same message on every header
(tests/test_safetensors_check_fast.py). scripts/bench_header_check.py times 100 MB headers.
"""

from __future__ import annotations

import gc
import json
import os
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from itertools import chain, compress, count, islice, repeat
from math import prod
from operator import and_, attrgetter, eq, gt, is_, itemgetter, le, mul, ne, not_, sub
from pathlib import Path
from typing import Annotated, Any, BinaryIO, Literal, NamedTuple, TypeGuard

import msgspec

from weightcache.errors import SafetensorsHeaderError

MAX_HEADER_BYTES = 100_000_000  # the reference implementation's limit
MAX_DIM = 2**63 - 1  # torch sizes are int64; the reference implementation parses them as usize
MAX_NDIM = 64  # numpy's limit; no tool writes more dimensions
CHILD_MIN_BYTES = 4 << 20  # check_file checks a header this long or longer in child processes
QUOTE = 60  # characters of a found value an error message shows
FAST_DEPTH = 32  # msgspec trees nested deeper (no real header is) are left to json, whose recursion guard decides
_DTYPE, _SHAPE, _OFFSETS = itemgetter("dtype"), itemgetter("shape"), itemgetter("data_offsets")
_BEGIN, _END = itemgetter(0), itemgetter(1)

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
    same rules as parse_header, without building the tensor table nobody reads (the fetch engine's check).
    A header of CHILD_MIN_BYTES or more is checked in child processes (weightcache/safetensors_split.py), so that
    its seconds of parsing never hold this process's GIL and its tree never grows this process."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        prefix = fh.read(8)
        n = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
        if CHILD_MIN_BYTES <= n <= MAX_HEADER_BYTES and 8 + n <= size:
            from weightcache.safetensors_split import check_in_children

            check_in_children(fh.fileno(), os.fspath(path), n, size)
        else:
            check_open(fh, os.fspath(path))


def check_open(fh: BinaryIO, name: str, *, repeated: bool = False) -> None:
    """check_file's rules on an open file, in this process; `name` is the file's, for messages. `repeated`: a key
    is known to repeat, so the roads that cannot name it are skipped (json, the reference, decides at once)."""
    _parse(fh, os.fstat(fh.fileno()).st_size, build=False, name=name, reference=repeated)


def _parse(f: BinaryIO, file_size: int, *, build: bool, name: str | None = None, reference: bool = False) -> Header:
    name = name or str(getattr(f, "name", "<stream>"))
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
    where = _Where(name, 8 + n, file_size - 8 - n)
    refusal: SafetensorsHeaderError | None = None
    with _gc_paused():  # millions of new containers, none cyclic: collections would cost 20x the parse itself
        try:
            metadata, tensors = _decide(where, raw, build, reference)
        except SafetensorsHeaderError as exc:
            refusal = exc.with_traceback(None)  # its frames hold the tree: freed now, while collections are off
        del raw
    if refusal is not None:
        raise refusal
    return Header(header_len=n, data_start=8 + n, file_size=file_size, tensors=tensors, metadata=metadata)


def _decide(where: _Where, raw: bytes, build: bool,
            reference: bool = False) -> tuple[dict[str, str], dict[str, TensorSpec]]:
    checked: tuple[dict[str, str], dict[str, TensorSpec]] | _Next | int | None = (
        None if reference else _check_typed(where, raw, build))
    if checked is _Next.TREE:  # unusual or wrong: msgspec's plain tree
        checked = _check_tree(where, raw, build)
    if not isinstance(checked, tuple):  # msgspec could not read it, or its tree may not be json's: json decides
        tree = _decode(where.name, raw, keys=checked if isinstance(checked, int) else None)
        meta = tree.pop("__metadata__", None)
        checked = _check(where, tree, meta, _columns(tree), build)
    return checked


class _Where(NamedTuple):
    name: str  # the file's, for messages
    data_start: int  # 8 + header length
    data_size: int  # the bytes after the header


class _Next(Enum):
    """Where a road that cannot decide sends the header (an int from the typed road: to json, with a count)."""

    TREE = "msgspec's plain tree"


class _Census(NamedTuple):
    pairs: int  # key-value pairs in all objects
    colons: int  # ':' characters in all keys and string values


_Dim = Annotated[int, msgspec.Meta(ge=0, le=MAX_DIM)]
_Offset = Annotated[int, msgspec.Meta(ge=0)]
# DTYPE_BITS's names (a test checks): msgspec checks a dtype in C and hands back one shared str per name, so the
# header's million copies of "F16" are never allocated (with tuple shapes: 1.3 -> 1.0 s for 1.3M tensors)
_DType = Literal["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0", "I16", "U16",
                 "F16", "BF16", "I32", "U32", "F32", "I64", "U64", "F64", "C64", "F4", "F6_E2M3", "F6_E3M2"]


class _Tensor(msgspec.Struct, gc=False):
    """A tensor as msgspec checks it while decoding. The fields are optional so that "__metadata__" decodes too
    (as fields it does not have: _Metadata reads it); a tensor without one goes to the tree road. The shape is a
    tuple, as TensorSpec keeps it; its length is checked with the sizes, so that a refusal is named from the
    columns."""

    dtype: _DType | None = None
    shape: tuple[_Dim, ...] | None = None
    data_offsets: tuple[_Offset, _Offset] | None = None


class _Metadata(msgspec.Struct):
    """The header's "__metadata__" alone: msgspec skips the tensors."""

    metadata: dict[str, str] | None = msgspec.field(name="__metadata__", default=None)


_TENSORS = msgspec.json.Decoder(dict[str, _Tensor])
_METADATA = msgspec.json.Decoder(_Metadata)
_FIELDS = attrgetter("dtype"), attrgetter("shape"), attrgetter("data_offsets")


class _Typed(NamedTuple):
    """A header of the usual form as the typed road read it: every tensor checked on its own, none repeated."""

    tensors: dict[str, _Tensor]
    metadata: dict[str, str]
    had_meta: bool
    columns: _Columns


def _decode_typed(raw: bytes) -> _Typed | _Next | int:
    """The typed reading of a header of the usual form (tensors of dtype, shape and data_offsets, metadata
    str -> str, no key repeated); else the road that decides: the tree, or json given the number of distinct keys
    msgspec found at the top (more pairs in json's reading: one of them repeats)."""
    try:
        tensors = _TENSORS.decode(raw)
        had_meta = tensors.pop("__metadata__", None) is not None
        metadata = (_METADATA.decode(raw).metadata or {}) if had_meta else {}
    except (msgspec.DecodeError, RecursionError):
        return _Next.TREE
    entries = list(tensors.values())
    dtypes, shapes, offsets = (list(map(field, entries)) for field in _FIELDS)
    if None in dtypes or None in shapes or None in offsets:  # identity tests in C, no call per item
        return _Next.TREE
    pairs = 4 * len(tensors) + had_meta + len(metadata)
    if not (_colon_free(raw, pairs) or _no_duplicates(raw, _regular_census(tensors, metadata, had_meta))):
        # a key repeats, or a field msgspec skipped (which the tree would count): json says which, faster than
        # the tree road and then json would
        return len(tensors) + had_meta
    begins, ends = list(map(_BEGIN, offsets)), list(map(_END, offsets))
    unit = list(map(DTYPE_BITS.__getitem__, dtypes))
    columns = _Columns(list(tensors), dtypes, shapes, begins, ends, unit, sorted(begins), sorted(ends), exact=True)
    return _Typed(tensors, metadata, had_meta, columns)


def _check_typed(where: _Where, raw: bytes,
                 build: bool) -> tuple[dict[str, str], dict[str, TensorSpec]] | _Next | int:
    """Road 1: the verdict on a header of the usual form, refusals included; else the road that decides."""
    typed = _decode_typed(raw)
    if not isinstance(typed, _Typed):
        return typed
    return typed.metadata, _settle(where, typed.columns, lambda key: _entry(typed.tensors[key]), build)


def _entry(tensor: _Tensor) -> dict[str, Any]:
    """A typed tensor as the plain tree has it, for the per-tensor check's words. A shape is cut after MAX_NDIM +
    QUOTE dimensions: still too long, and quoted the same (a quote shows QUOTE items), without copying millions."""
    return {"dtype": tensor.dtype, "shape": list((tensor.shape or ())[:MAX_NDIM + QUOTE]),
            "data_offsets": list(tensor.data_offsets or ())}


def _check_tree(where: _Where, raw: bytes, build: bool) -> tuple[dict[str, str], dict[str, TensorSpec]] | None:
    """Road 2: the verdict on msgspec's plain tree, or None where json must decide: msgspec refused the text
    (json reads lone surrogates and 1e400), the tree is too deep, or msgspec may have dropped a repeated key."""
    try:
        tree = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None
    if type(tree) is not dict:
        return None
    had_meta = "__metadata__" in tree
    meta = tree.pop("__metadata__", None)
    columns = _columns(tree)
    try:
        checked = _check(where, tree, meta, columns, build)
    except SafetensorsHeaderError:
        regular = columns is not None and columns.exact and (meta is None or _is_str_map(meta))
        census = _count(tree, meta, had_meta, regular)
        if census is None or not _no_duplicates(raw, census):
            return None
        raise
    census = _count(tree, checked[0], had_meta, regular=columns is not None and columns.exact)
    return checked if census is not None and _no_duplicates(raw, census) else None


def _count(tree: dict[str, Any], meta: Any, had_meta: bool, regular: bool) -> _Census | None:
    """The census of a header's tree whose "__metadata__" value `meta` was taken out; None when too deep to take.
    `regular`: as for _regular_census, which then counts it."""
    if regular:
        return _regular_census(tree, meta or {}, had_meta)
    census = _census([tree, meta])
    return census._replace(pairs=census.pairs + had_meta) if census else None


def _regular_census(tensors: dict[str, Any], metadata: dict[str, str], had_meta: bool) -> _Census:
    """The census of a header whose tensors are each exactly {dtype: a known name, shape: ints, data_offsets:
    ints} (so three pairs and no colon each) and whose metadata maps str to str: counted without a walk."""
    return _Census(4 * len(tensors) + had_meta + len(metadata),
                   _colons(tensors) + _colons(metadata) + _colons(metadata.values()))


def _no_duplicates(raw: bytes, census: _Census) -> bool:
    """Whether the JSON text `raw` holds exactly the pairs and string colons `census` counted in the tree msgspec
    made of it: then msgspec dropped no pair for a repeated key. Each ':' byte of valid JSON separates a pair or
    lies in a string; a string's colons decode from those bytes and from '\\u003a' escapes, counted apart (with
    escaped backslashes removed, each backslash left starts an escape). A dropped pair takes its separator with
    it, so the text's sum exceeds the tree's exactly when something was dropped."""
    escaped = 0
    if b"\\" in raw and b"\\u003" in raw:  # a one-byte search is a memchr: 15 times faster than the other
        unescaped = raw.replace(b"\\\\", b"")
        escaped = unescaped.count(b"\\u003a") + unescaped.count(b"\\u003A")
    return raw.count(b":") + escaped == census.pairs + census.colons


def _colon_free(raw: bytes, pairs: int) -> bool:
    """Whether the JSON text `raw` holds exactly the `pairs` pairs msgspec put in its tree (whose keys and values
    each came from one of them) when no string has a ':' byte: the text's ':' bytes are its pairs and its
    strings' colons, so exactly `pairs` of them leave no dropped pair (nor a string colon). The usual case,
    decided without reading a string; else _no_duplicates counts them."""
    return raw.count(b":") == pairs


def _colons(strings: Iterable[str]) -> int:
    return "".join(strings).count(":")  # no call per string; the copy is at most the header's size


def _census(roots: list[Any]) -> _Census | None:
    """Pairs and string colons in the trees `roots`, one level at a time with loops in C (a million tensors in
    about a second); None when deeper than FAST_DEPTH."""
    pairs = colons = 0
    level = roots
    for _ in range(FAST_DEPTH + 1):
        if not level:
            return _Census(pairs, colons)
        kinds = list(map(type, level))
        dicts = list(compress(level, map(is_, kinds, repeat(dict))))
        lists = list(compress(level, map(is_, kinds, repeat(list))))
        colons += _colons(compress(level, map(is_, kinds, repeat(str)))) + _colons(chain.from_iterable(dicts))
        pairs += sum(map(len, dicts))
        try:  # numbers only (shapes, offsets): one C loop says so, and nothing below them needs counting
            sum(chain.from_iterable(lists))
            below: list[Any] = []
        except TypeError:
            below = list(chain.from_iterable(lists))
        level = list(chain(chain.from_iterable(map(dict.values, dicts)), below))
    return None


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


class _Columns(NamedTuple):
    """Every tensor's fields in header order, each field of each tensor checked on its own (type and range):
    what remains to check is arithmetic (size = shape x dtype) and layout. Built by loops in C over columns
    (each pass costs ~50 ms per million tensors), never a Python call per tensor."""

    names: list[str]
    dtypes: list[str]
    shapes: Sequence[Sequence[int]]  # lists from a tree, tuples from the typed road
    begins: list[int]
    ends: list[int]
    unit: list[int]  # bits per element of each dtype
    first: list[int]  # begins, sorted
    last: list[int]  # ends, sorted
    exact: bool  # no tensor has fields besides these three


def _columns(tree: dict[str, Any]) -> _Columns | None:
    """The columns, or None when some tensor is not {dtype: a known name, shape: at most MAX_NDIM ints in
    0..MAX_DIM, data_offsets: two ints >= 0, and perhaps fields the check ignores} (the per-tensor pass says
    which)."""
    entries = list(tree.values())
    try:
        fields = set(map(len, entries))
        # itemgetter raises on anything but a dict (a list or str of three: TypeError) and on a missing field
        dtypes, shapes, offsets = list(map(_DTYPE, entries)), list(map(_SHAPE, entries)), list(map(_OFFSETS, entries))
        unit = list(map(DTYPE_BITS.__getitem__, dtypes))  # KeyError: unknown; TypeError: not even a string
        if entries and (set(map(type, shapes)) != {list} or max(map(len, shapes)) > MAX_NDIM
                        or set(map(len, offsets)) != {2}):
            return None
        # a str or dict of two passes here and fails below: its items are characters or keys, never ints
        begins, ends = list(map(_BEGIN, offsets)), list(map(_END, offsets))
    except (TypeError, KeyError):
        return None
    dims = list(chain.from_iterable(shapes))
    if not set(map(type, dims)) | set(map(type, begins)) | set(map(type, ends)) <= {int}:
        return None
    if dims and (min(dims) < 0 or max(dims) > MAX_DIM):
        return None
    first, last = sorted(begins), sorted(ends)
    if entries and min(first[0], last[0]) < 0:
        return None
    return _Columns(list(tree), dtypes, shapes, begins, ends, unit, first, last, exact=fields <= {3})


def _check(where: _Where, tree: dict[str, Any], meta: Any, columns: _Columns | None,
           build: bool) -> tuple[dict[str, str], dict[str, TensorSpec]]:
    """Metadata and the tensor table in file order ({} when not `build` and `columns` decide) of a header whose
    "__metadata__" value `meta` was taken out of `tree`. Refusals name the first tensor in header order that is
    wrong on its own, else the first place in file order where the layout breaks: the per-tensor pass's words."""
    metadata = _metadata(where.name, meta)
    if columns is None:  # something is malformed, or unusual (extra fields): one tensor at a time
        return metadata, _per_tensor(where, tree)
    return metadata, _settle(where, columns, tree.__getitem__, build)


def _settle(where: _Where, columns: _Columns, entry: Callable[[str], Any], build: bool) -> dict[str, TensorSpec]:
    """The table in file order ({} when not `build`) when every tensor's size and place are right; else the
    refusal in the per-tensor check's words: the first tensor (header order) wrong on its own, else the first
    place (file order) where the layout breaks. `entry`: a tensor's value in the tree, by name."""
    bad = _mismatch(columns, where.data_size)
    if bad is not None:
        _tensor(where, bad, entry(bad))  # refuses: its size is not its shape x dtype, or it ends past the data
    elif _tiled(columns, where.data_size):
        return _table(columns, where.data_start) if build else {}
    else:
        _check_layout(where, _table(columns, where.data_start))  # refuses: the tensors do not tile the data
    raise _err(where.name, "the tensors' sizes or layout are wrong")  # not reached: the checks above refuse


def _mismatch(columns: _Columns, data_size: int) -> str | None:
    """The first tensor (header order) with more than MAX_NDIM dimensions, or whose data_offsets do not hold
    exactly shape x dtype bits, or that ends past the data (one that begins past it then ends before it
    begins); None when there is none."""
    names, shapes = columns.names, columns.shapes
    too_long = len(names)
    if shapes and max(map(len, shapes)) > MAX_NDIM:
        too_long = next(compress(count(), map(gt, map(len, shapes), repeat(MAX_NDIM))))
    # before that one, at most MAX_NDIM dimensions below 2**63 each: products small enough for C-speed arithmetic
    needs = list(map(mul, map(prod, islice(shapes, too_long)), columns.unit))
    holds = list(map(mul, map(sub, columns.ends, columns.begins), repeat(8)))
    past = bool(columns.last) and columns.last[-1] > data_size
    if too_long == len(names) and not past and needs == holds:  # one compare in C, mostly of identical ints
        return None
    fits = map(eq, needs, holds)
    if past:
        fits = map(and_, fits, map(le, columns.ends, repeat(data_size)))
    bad = next(compress(names, map(not_, fits)), None)  # the maps stop at too_long
    return bad if bad is not None or too_long == len(names) else names[too_long]


def _tiled(columns: _Columns, data_size: int) -> bool:
    """Whether the tensors (each of the right size) tile the data: contiguous from its first byte, no overlap, and
    the last one ends exactly at the end of the file."""
    if not columns.names:
        return data_size == 0
    first, last = columns.first, columns.last
    if any(map(eq, columns.begins, columns.ends)):  # empty tensors may share an offset with the next one
        rank = _file_order(columns)
        first, last = list(map(columns.begins.__getitem__, rank)), list(map(columns.ends.__getitem__, rank))
    # all sizes > 0: each column sorted on its own tiles the data iff the tensors do (begins then distinct)
    return first[0] == 0 and last[-1] == data_size and all(map(eq, islice(first, 1, None), last))


def _file_order(columns: _Columns) -> list[int]:
    """Tensor indexes by (begin, end): file order, empty tensors before the one that starts where they are."""
    begins, ends = columns.begins, columns.ends
    if all(map(ne, columns.first, islice(columns.first, 1, None))):  # no two begins alike: no pairs to build
        return sorted(range(len(begins)), key=begins.__getitem__)
    return sorted(range(len(begins)), key=list(zip(begins, ends, strict=True)).__getitem__)


def _table(columns: _Columns, data_start: int) -> dict[str, TensorSpec]:
    """The tensor table in file order, with absolute offsets."""
    rows = zip(columns.dtypes, map(tuple, columns.shapes), map(data_start.__add__, columns.begins),
               map(data_start.__add__, columns.ends), strict=True)
    specs = map(tuple.__new__, repeat(TensorSpec), rows)  # TensorSpec._make without a Python call each
    if columns.begins == columns.first and columns.ends == columns.last:
        # header order is file order (as safetensors writes them): no ranking, no list of the rows; the compares
        # are of identical int objects (the sorted columns hold the same ones)
        return dict(zip(columns.names, specs, strict=True))
    rank, listed = _file_order(columns), list(specs)
    return dict(zip(map(columns.names.__getitem__, rank), map(listed.__getitem__, rank), strict=True))


def _per_tensor(where: _Where, tree: dict[str, Any]) -> dict[str, TensorSpec]:
    """The thorough path, one tensor at a time: each checked on its own in header order, then the layout."""
    tensors = {key: _tensor(where, key, value) for key, value in tree.items()}
    ordered = dict(sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)))
    _check_layout(where, ordered)
    return ordered


def _err(name: str, problem: str) -> SafetensorsHeaderError:
    return SafetensorsHeaderError(
        f"{Path(name).name}: invalid safetensors file: {problem}; re-export or re-upload the file "
        f"(safetensors.torch.save_file writes valid ones)"
    )


def _decode(name: str, raw: bytes, keys: int | None = None) -> dict[str, Any]:
    """The header as the standard library's json reads it, refusing repeated keys in the header, its metadata and
    its tensors: the reference the msgspec roads agree with. `keys`: the distinct keys at the top of this text
    (msgspec's count), when known: fewer than json's pairs names a repeated one without building the dict."""
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
    if keys is not None and len(obj) > keys:
        raise _repeated(name, "the header", obj)
    tree = _object(name, "the header", obj)
    values = list(tree.values())
    if set(map(type, values)) == {tuple}:  # all objects: dicts for the column check, when no key repeats
        dicts = list(map(dict, values))
        if list(map(len, dicts)) == list(map(len, values)):
            return dict(zip(tree, dicts, strict=True))
    return tree  # _metadata and _tensor turn pairs into dicts one by one, and name a repeated key


def _object(name: str, what: str, pairs: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _repeated(name, what, pairs)
    return out


def _repeated(name: str, what: str, pairs: tuple[tuple[str, Any], ...]) -> SafetensorsHeaderError:
    """The refusal naming the first key of `pairs` that repeats an earlier one (there must be one)."""
    seen: set[str] = set()
    duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
    return _err(name, f"{what} has a duplicate key {_quote(duplicate)}")


def _no_constants(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")


def _metadata(name: str, value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, tuple):
        value = _object(name, "__metadata__", value)
    if not _is_str_map(value):
        raise _err(name, "__metadata__ must map strings to strings")
    return value


def _is_str_map(value: Any) -> TypeGuard[dict[str, str]]:
    return isinstance(value, dict) and set(map(type, value)) | set(map(type, value.values())) <= {str}


def _tensor(where: _Where, key: str, value: Any) -> TensorSpec:
    """One tensor checked on its own, or a refusal naming it; a Python call per tensor, for the thorough path."""
    name, data_size = where.name, where.data_size
    if isinstance(value, tuple):
        value = _object(name, f"tensor {_quote(key)}", value)
    if not isinstance(value, dict):
        raise _err(name, f"tensor {_quote(key)} must be an object with dtype, shape and data_offsets")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise _err(name, f"tensor {_quote(key)} has unknown dtype {_quote(dtype)} (known: {', '.join(DTYPE_BITS)})")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not _uints(shape, MAX_DIM):
        raise _err(name, f"tensor {_quote(key)} shape must be a list of at most {MAX_NDIM} non-negative integers "
                         f"below 2**63, got {_quote(shape)}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not _uints(offsets, data_size):
        raise _err(name, f"tensor {_quote(key)} data_offsets must be [begin, end] within the {data_size} data bytes "
                         f"(truncated?), got {_quote(offsets)}")
    begin, end = offsets
    if begin > end:
        raise _err(name, f"tensor {_quote(key)} data_offsets [{begin}, {end}] end before they begin")
    bits = _bits(shape, DTYPE_BITS[dtype], limit=max(8 * data_size, 1 << 64))
    if bits is None or bits % 8 or bits // 8 != end - begin:
        needs = "more bytes than the file holds" if bits is None else f"{bits // 8}{'.5' if bits % 8 else ''} bytes"
        raise _err(name, f"tensor {_quote(key)}: shape {_quote(shape)} of {dtype} needs {needs} "
                         f"but data_offsets [{begin}, {end}] hold {end - begin}")
    return TensorSpec(dtype=dtype, shape=tuple(shape), start=where.data_start + begin, end=where.data_start + end)


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


def _uints(values: list[Any], maximum: int) -> bool:
    """All ints (not bools) in 0..maximum."""
    return not values or (set(map(type, values)) <= {int} and min(values) >= 0 and max(values) <= maximum)


def _quote(value: Any) -> str:
    """A short repr of untrusted input: an error message must not carry megabytes of it."""
    text = repr(_shown(value))
    return text if len(text) <= QUOTE else f"{text[:QUOTE]}... ({len(text)} characters)"


def _shown(value: Any, depth: int = 0) -> Any:
    """What a message shows of `value`: at most QUOTE items of each container, 3 levels deep, JSON objects as dicts
    whichever parser read them (json's hook gives tuples of pairs), so both parsers' messages are the same."""
    if isinstance(value, str):
        return value[:QUOTE]
    if isinstance(value, (list, tuple, dict)) and depth >= 3:
        return ...
    if isinstance(value, tuple):
        value = dict(value[:QUOTE])
    if isinstance(value, dict):
        return {key: _shown(item, depth + 1) for key, item in islice(value.items(), QUOTE)}
    if isinstance(value, list):
        return [_shown(item, depth + 1) for item in value[:QUOTE]]
    return value


def _check_layout(where: _Where, tensors: dict[str, TensorSpec]) -> None:
    """Contiguous from the first data byte, no overlap, and the last tensor ends exactly at the end of the file."""
    name, data_start, data_size = where
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
