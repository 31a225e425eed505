"""Validate a .safetensors header before a file is published or loaded, by the rules of safetensors' own Rust parser.

A safetensors file is

    [8 bytes: n, little-endian u64][n bytes: UTF-8 JSON header, may end in whitespace][data: the tensors' bytes]

A file passes here exactly when `safetensors.safe_open` opens it (tests/test_safetensors_check.py checks the two
against each other on generated and mutated headers): publishing a file that transformers or vLLM then cannot
open, or refusing one they can, would both be wrong. The Rust rules, as its serde_json decode and its
Metadata::validate apply them:

- n <= 100,000,000 and 8 + n <= the file's size; the header is UTF-8 and one JSON value with only ' \\t\\n\\r'
  around it; no NaN/Infinity, no lone surrogate escape (anywhere, even in ignored fields), no number outside a
  float64's range, no container nested deeper than 127;
- the value is an object; "__metadata__" at most once, null or a str -> str object (a repeated key in it: the last
  wins); every other key is a tensor, the last of a repeated name wins (the earlier ones must still be well-formed);
- a tensor is an object with "dtype", "shape" and "data_offsets" once each (other fields ignored), or the array
  [dtype, shape, data_offsets]; dtype a known name (or {name: null}); shape a list of ints in 0..2**64-1;
  data_offsets two of them;
- each tensor's element count (the product of its dims from the left) times its dtype's bits fits 64 bits and is
  8 x (end - begin); sorted by (begin, end) the tensors tile the data from its first byte to the file's end.

A file that passes can be mapped and sliced without further bounds checks. No torch or numpy: the daemon and the
fetch engine call this in worker threads, never on an event loop.

The header is untrusted input of up to 100 MB: one decode (the standard library's json, whose objects come as tuples
of pairs so that repeated keys stay visible), then one pass over the tensors; linear in the header's size, every
number range-checked before arithmetic, messages quoting a few dozen characters of what they found, every refusal
a SafetensorsHeaderError (exit 7). A header of CHILD_MIN_BYTES or more (no real model has one: a 70B model's is
~0.1 MB) is checked by check_file in one child process with a memory limit and a timeout, so that its seconds of
parsing never hold this process's GIL and its tree never grows this process.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from itertools import chain, compress, repeat
from math import isinf
from operator import is_, itemgetter, sub
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from weightcache.errors import SafetensorsHeaderError, StoreError

MAX_HEADER_BYTES = 100_000_000  # the reference implementation's limit
MAX_DEPTH = 127  # serde_json's recursion limit: containers nested deeper are refused
U64 = 2**64 - 1  # shapes and offsets are usize
CHILD_MIN_BYTES = 1 << 20  # check_file checks a header this long or longer in a child process (~50 ms here)
CHILD_TIMEOUT_S = 120.0  # 100 MB takes seconds; a child past this is killed and the fetch fails (not a verdict)
CHILD_MEMORY_BYTES = 6 << 30  # RLIMIT_AS of the child: a 100 MB header's tree takes up to ~3 GB of address space
QUOTE = 60  # characters of a found value an error message shows
_F64_OVERFLOW = 2**1024 - 2**970  # integers from here on round to infinity as a float64: serde refuses them
_META = "__metadata__"
_FIELDS = ("dtype", "shape", "data_offsets")
_FIELD_SET = frozenset(_FIELDS)
_KEY, _VALUE = itemgetter(0), itemgetter(1)
_BEGIN, _END, _NEEDS = itemgetter(2), itemgetter(3), itemgetter(4)
# a \uD800-\uDBFF escape not followed by a \uDC00-\uDFFF one, or the latter not after the former (escaped
# backslashes replaced first: '\\ud800' is a backslash and text)
_HIGH, _LOW = r"\\u[dD][89abAB][0-9a-fA-F]{2}", r"\\u[dD][c-fC-F][0-9a-fA-F]{2}"
_LONE_SURROGATE = re.compile(f"{_HIGH}(?!{_LOW})|(?<!{_HIGH}){_LOW}")

# Size in bits: the sub-byte float formats (F4, F6_*) pack several elements per byte.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}


class TensorSpec(NamedTuple):
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
            return _parse(fh, file_size, str(f), build=True)
    return _parse(f, file_size, str(getattr(f, "name", "<stream>")), build=True)


def check_file(path: str | os.PathLike[str]) -> None:
    """Validate a safetensors file on disk (the fetch engine's check). A header of CHILD_MIN_BYTES or more is
    checked in a child process; StoreError (never a verdict) when that child cannot start, runs out of memory or
    time, or dies."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        prefix = fh.read(8)
        n = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
        if CHILD_MIN_BYTES <= n <= MAX_HEADER_BYTES and 8 + n <= size:
            _check_in_child(fh.fileno(), os.fspath(path))
        else:
            _parse(fh, size, os.fspath(path), build=False)


def _parse(f: BinaryIO, file_size: int, name: str, *, build: bool) -> Header:
    """The header; its tensor table only when `build` (check_file has no use for it)."""
    f.seek(0)
    prefix = f.read(8)
    if len(prefix) < 8 or file_size < 8:
        raise _err(name, f"the file has {max(file_size, len(prefix))} bytes, fewer than the 8-byte header length")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_BYTES:
        raise _err(name, f"header length {n} is over the format's {MAX_HEADER_BYTES} bytes")
    if 8 + n > file_size:
        raise _err(name, f"header length {n} runs past the end of the {file_size}-byte file (truncated?)")
    raw = f.read(n)
    if len(raw) != n:
        raise _err(name, f"the file ends inside the header ({len(raw)} of {n} bytes)")
    pairs = _decode(name, raw)
    del raw
    metadata, tensors = _check(name, pairs, 8 + n, file_size - 8 - n, build)
    return Header(header_len=n, data_start=8 + n, file_size=file_size, tensors=tensors, metadata=metadata)


def _decode(name: str, raw: bytes) -> tuple[tuple[str, Any], ...]:
    """The header's top-level pairs; JSON objects below are tuples of pairs too, arrays lists."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _err(name, f"the header is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    if "\\u" in text and _LONE_SURROGATE.search(text.replace("\\\\", "..")):  # json reads them, serde does not
        raise _err(name, "the header has a lone surrogate escape (\\uD800-\\uDFFF not in a pair)")
    hooks: dict[str, Any] = {"parse_int": _int} if "-0" in text else {}  # a hook costs a call per integer
    try:
        # object_pairs_hook=tuple: a C builtin, no Python call per object, and repeated keys stay visible
        tree = json.loads(text, object_pairs_hook=tuple, parse_constant=_no_constant, **hooks)
    except RecursionError:  # Python's limit is past serde's, so serde refuses it too
        raise _err(name, f"the header JSON is nested deeper than {MAX_DEPTH}") from None
    except ValueError as exc:  # JSONDecodeError, our hooks, an integer of over 4,300 digits
        raise _err(name, f"the header is not valid JSON ({_shorten(str(exc))})") from None
    if type(tree) is not tuple:
        raise _err(name, f"the header must be a JSON object, not {_quote(tree)}")
    return tree


def _int(text: str) -> int | float:
    """serde_json reads "-0" as a float (so not a shape or an offset); json as the integer 0."""
    return -0.0 if text == "-0" else int(text)


def _no_constant(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")


_Entry = tuple[str, list[int], int, int, int | None]  # dtype, shape, begin, end, bytes its shape x dtype needs


def _check(name: str, pairs: tuple[tuple[str, Any], ...], data_start: int,
           data_size: int, build: bool) -> tuple[dict[str, str], dict[str, TensorSpec]]:
    """The metadata and the tensor table in file order ({} when not `build`), or the refusal."""
    keys = list(map(_KEY, pairs))
    metadata: dict[str, str] = {}
    count = keys.count(_META)
    if count > 1:
        raise _err(name, f"the header has {_META!r} {count} times")
    if count:
        metadata = _metadata(name, pairs[keys.index(_META)][1])
    extras: list[Any] = []  # values of fields the format ignores, for the JSON-level limits below
    # the one pass: every pair well-formed; the last of a repeated name kept
    entries = {key: _entry(name, key, value, extras) for key, value in pairs if key != _META}
    if extras:
        _limits(name, extras)
    return metadata, _table(name, entries, data_start, data_size, build)


def _entry(name: str, key: str, value: Any, extras: list[Any]) -> _Entry:
    if type(value) is tuple and len(value) == 3 and (fields := dict(value)).keys() == _FIELD_SET:  # the usual form
        dtype, shape, offsets = fields["dtype"], fields["shape"], fields["data_offsets"]
    elif type(value) is tuple:
        dtype, shape, offsets = _fields(name, key, value, extras)
    elif type(value) is list and len(value) == 3:
        dtype, shape, offsets = value
    else:
        raise _err(name, f"tensor {_quote(key)} must be an object with dtype, shape and data_offsets, got "
                         f"{_quote(value)}")
    if type(dtype) is tuple and len(dtype) == 1 and dtype[0][1] is None:  # {"F16": null}: serde's enum form
        dtype = dtype[0][0]
    bits = DTYPE_BITS.get(dtype) if type(dtype) is str else None
    if bits is None:
        raise _err(name, f"tensor {_quote(key)} has unknown dtype {_quote(dtype)} (known: {', '.join(DTYPE_BITS)})")
    elements = _elements(shape) if type(shape) is list else None
    if elements is None:
        raise _err(name, f"tensor {_quote(key)} shape must be a list of integers in 0..2**64-1, got {_quote(shape)}")
    begin, end = _offsets(name, key, offsets)
    nbits = elements * bits
    return dtype, shape, begin, end, nbits // 8 if nbits <= U64 and not nbits % 8 else None


def _offsets(name: str, key: str, offsets: Any) -> tuple[int, int]:
    if type(offsets) is list and len(offsets) == 2 and type(begin := offsets[0]) is int \
            and type(end := offsets[1]) is int and 0 <= begin <= U64 and 0 <= end <= U64:
        return begin, end
    raise _err(name, f"tensor {_quote(key)} data_offsets must be [begin, end], integers in 0..2**64-1, "
                     f"got {_quote(offsets)}")


def _table(name: str, entries: dict[str, _Entry], data_start: int, data_size: int,
           build: bool) -> dict[str, TensorSpec]:
    """The tensors in file order, once each holds what its shape needs and together they tile the data."""
    rows = list(entries.values())
    begins, ends = list(map(_BEGIN, rows)), list(map(_END, rows))
    if list(map(_NEEDS, rows)) != list(map(sub, ends, begins)):  # sizes only of the tensors kept, as serde has it
        bad = next(k for k, e in entries.items() if e[4] != e[3] - e[2])
        raise _size_err(name, bad, entries[bad])
    order = sorted(range(len(rows)), key=list(zip(begins, ends, strict=True)).__getitem__)
    names = list(entries)
    first, last = list(map(begins.__getitem__, order)), list(map(ends.__getitem__, order))
    tiled = first[0] == 0 and first[1:] == last[:-1] and last[-1] == data_size if rows else data_size == 0
    if not tiled:
        _layout_err(name, [names[i] for i in order], first, last, data_size)
    if not build:
        return {}
    return {names[i]: TensorSpec(rows[i][0], tuple(rows[i][1]), data_start + begins[i], data_start + ends[i])
            for i in order}


def _metadata(name: str, value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if type(value) is not tuple:
        raise _err(name, f"{_META} must be an object mapping strings to strings, got {_quote(value)}")
    metadata = dict(value)  # a repeated key: the last wins, as in the reference
    if not set(map(type, metadata.values())) <= {str}:
        raise _err(name, f"{_META} must map strings to strings, got {_quote(value)}")
    return metadata


def _fields(name: str, key: str, pairs: tuple[tuple[str, Any], ...], extras: list[Any]) -> list[Any]:
    """An unusual tensor object's dtype, shape and data_offsets, each there once (ignored fields may repeat); the
    values of the others set aside in `extras`."""
    keys = list(map(_KEY, pairs))
    for field in _FIELDS:
        if keys.count(field) != 1:
            missing = "has no" if field not in keys else "repeats its"
            raise _err(name, f"tensor {_quote(key)} {missing} field {field!r}")
    extras.extend(v for k, v in pairs if k not in _FIELDS)
    fields = dict(pairs)
    return [fields[field] for field in _FIELDS]


def _elements(shape: list[Any]) -> int | None:
    """The element count as serde folds it, a checked u64 product from the left (past U64 here: an overflow, which a
    later zero does not undo; multiplying stops there, so the numbers stay small); None when a dim is not an int
    in 0..U64."""
    elements = 1
    for dim in shape:
        if type(dim) is not int or not 0 <= dim <= U64:
            return None
        if elements <= U64:
            elements *= dim
    return elements


def _limits(name: str, values: list[Any]) -> None:
    """serde_json's limits on the fields it parses and ignores: depth, and numbers a float64 cannot hold; one
    level at a time with loops in C. `values` sit at depth 3 (the header, a tensor, its field)."""
    level, depth = values, 3
    while level:
        kinds = list(map(type, level))
        if any(map(isinf, compress(level, map(is_, kinds, repeat(float))))):
            raise _err(name, "the header has a number too large for a float64")
        ints = list(compress(level, map(is_, kinds, repeat(int))))
        if ints and max(max(ints), -min(ints)) >= _F64_OVERFLOW:
            raise _err(name, "the header has a number too large for a float64")
        objects = list(compress(level, map(is_, kinds, repeat(tuple))))
        arrays = list(compress(level, map(is_, kinds, repeat(list))))
        if (objects or arrays) and depth > MAX_DEPTH:
            raise _err(name, f"the header JSON is nested deeper than {MAX_DEPTH}")
        level = list(chain(map(_VALUE, chain.from_iterable(objects)), chain.from_iterable(arrays)))
        depth += 1


def _size_err(name: str, key: str, entry: _Entry) -> SafetensorsHeaderError:
    dtype, shape, begin, end, _ = entry
    nbits = (_elements(shape) or 0) * DTYPE_BITS[dtype]
    needs = ("more than 2**64 bits" if nbits > U64 else f"{nbits // 8} bytes" if nbits % 8 == 0
             else f"{nbits} bits, not a whole number of bytes,")
    return _err(name, f"tensor {_quote(key)}: shape {_quote(shape)} of {dtype} needs {needs} but data_offsets "
                      f"[{begin}, {end}] hold {end - begin}")


def _layout_err(name: str, names: list[str], first: list[int], last: list[int], data_size: int) -> None:
    """The refusal of tensors that do not tile the data, naming the first place (file order) where they break."""
    pos = 0
    for key, begin, end in zip(names, first, last, strict=True):
        if begin != pos:
            what = "overlaps the previous tensor" if begin < pos else f"leaves a gap of {begin - pos} bytes"
            raise _err(name, f"tensor {_quote(key)} at data offset {begin} {what}")
        pos = end
    if pos > data_size:
        raise _err(name, f"tensors need {pos} data bytes but the file holds {data_size} (truncated?)")
    raise _err(name, f"{data_size - pos} bytes after the last tensor belong to no tensor")


def _err(name: str, problem: str) -> SafetensorsHeaderError:
    return SafetensorsHeaderError(
        f"{Path(name).name}: invalid safetensors file: {problem}; re-export or re-upload the file "
        f"(safetensors.torch.save_file writes valid ones)"
    )


def _quote(value: Any) -> str:
    """A short repr of untrusted input (JSON objects shown as dicts): a message must not carry megabytes of it."""
    return _shorten(repr(_shown(value)))


def _shorten(text: str) -> str:
    return text if len(text) <= QUOTE else f"{text[:QUOTE]}... ({len(text)} characters)"


def _shown(value: Any, depth: int = 0) -> Any:
    """At most QUOTE items of each container, 3 levels deep: never a copy of a whole hostile value."""
    if isinstance(value, str):
        return value[:QUOTE]
    if isinstance(value, (list, tuple)) and depth >= 3:
        return ...
    if isinstance(value, tuple):
        return {k: _shown(v, depth + 1) for k, v in value[:QUOTE]}
    if isinstance(value, list):
        return [_shown(item, depth + 1) for item in value[:QUOTE]]
    return value


# --- a big header in one child process ------------------------------------------------------------------------

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])
_ENVIRONMENT = ("PATH", "LD_LIBRARY_PATH", "PYTHONHOME", "LANG", "LC_ALL", "TMPDIR")
_REFUSED = 17  # the child's exit status for a refusal (its words on stdout); 0 for a valid header
# one big header checked at a time per process: only a hostile source has them, and each child may take GBs
_ONE_AT_A_TIME = threading.Lock()


def _check_in_child(fd: int, name: str) -> None:
    """check_file's verdict on the open file `fd`, reached in one child process (its answer on stdout)."""
    if not sys.executable:  # an embedded interpreter: nothing to start, and this process must not stall
        raise StoreError(f"{Path(name).name}: no Python executable to check its big safetensors header with")
    # a process that parses hostile bytes gets no more than it needs: no credentials from the environment
    env = {key: os.environ[key] for key in _ENVIRONMENT if key in os.environ}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))
    # -P: the working directory is not searched (a weightcache/ there must not be imported instead)
    args = [sys.executable, "-P", "-m", "weightcache.safetensors_check", str(fd), str(CHILD_MEMORY_BYTES), name]
    with _ONE_AT_A_TIME:
        try:
            done = subprocess.run(args, pass_fds=(fd,), stdin=subprocess.DEVNULL, capture_output=True, env=env,
                                  timeout=CHILD_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise StoreError(f"{Path(name).name}: its safetensors header check took over {CHILD_TIMEOUT_S:.0f} s "
                             "and was stopped; give the daemon more CPU, or exclude the file") from None
        except OSError as exc:
            raise StoreError(f"{Path(name).name}: could not start the safetensors header check's process "
                             f"({exc}); retry, or exclude the file") from None
    if done.returncode == 0:
        return
    if done.returncode == _REFUSED:
        raise SafetensorsHeaderError(done.stdout.decode("utf-8", "replace"))
    code = done.returncode
    how = (f"was killed by signal {-code}" + (" (out of memory?)" if code == -9 else "") if code < 0
           else f"exited with status {code}")
    last = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
    raise StoreError(f"{Path(name).name}: the safetensors header check's process {how} ({_shorten(last[0])}); give "
                     "the daemon more memory, or exclude the file")


def _child(argv: list[str]) -> None:
    """`FD MEMORY_BYTES NAME`: exit 0 when the header is valid, _REFUSED with the refusal on stdout; a MemoryError
    past the limit exits 1 with its traceback (the parent's StoreError)."""
    import gc
    import resource

    fd, memory = int(argv[0]), int(argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))  # before a byte of the header is read
    gc.disable()  # millions of new containers, none cyclic
    try:
        with os.fdopen(fd, "rb", closefd=False) as fh:
            _parse(fh, os.fstat(fd).st_size, argv[2], build=False)
    except SafetensorsHeaderError as exc:
        sys.stdout.write(str(exc))
        sys.stdout.flush()
        os._exit(_REFUSED)
    os._exit(0)  # the verdict is in; freeing the tree would only cost time


if __name__ == "__main__":
    _child(sys.argv[1:])
