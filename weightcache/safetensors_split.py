"""Check a big safetensors header in child processes (check_file sends every header of CHILD_MIN_BYTES or more).

Why children: msgspec decodes a 100 MB header in over a second of one core without letting go of the GIL, and the
tree grows the process by ~600 MB. In the daemon, the CSI plugin's Probe and the API would wait that long and the
memory would stay. Here the caller's thread only waits on pipes, the memory leaves with the children (which end by
os._exit: freeing millions of objects would cost a third of a second), and the parts decode at once on as many
cores as the process may use.

Parts. The text is cut where one tensor's object ends and the next pair begins (`},`); part i is its slice with
`{` before and `}` after where the cut took them (the comma dropped). When every part is a valid JSON object, the
whole text is one holding the parts' pairs in order: a valid first part leaves the parser at the top level right
after a value, where the whole text's `,` leads to the next pair, the state that a part's own `{` starts in; a cut
inside a string leaves its part's string unterminated, and one inside a nested array or object leaves that
unclosed, so that part is invalid (and the whole check decides).

A child reads its part as safetensors_check's typed road does (types, ranges, no repeated key, each tensor's size)
and answers (msgpack) with its tensors' begins and ends, each sorted (or the one stretch they tile, as safetensors
writers lay them out), or the refusal of its first tensor wrong on its own; and with the hashes of its keys, under a
seed drawn for this check, in one bucket per child (hash % children). Then each child is handed one bucket from
every part and says whether a hash repeats in it: a key in two parts (or a collision) is a repeat, and no process
ever holds every key. With no repeat, the first part's refusal is the whole check's words (json validity and
repeated keys are decided before any tensor); with none, the tensors must tile the data (with no empty tensor,
sorted begins and ends tile it exactly when begins[i + 1] == ends[i], from 0 to the data's size).

Whatever a part or the parent cannot pass - a refusal, an unusual form, an empty tensor, a header with no cut - goes
to one child that runs the in-process check (safetensors_check.check_open) on the whole file: its verdict and its
words are the answer, the same as in this process.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import os
import random
import struct
import subprocess
import sys
import threading
from array import array
from collections import Counter
from enum import Enum
from itertools import chain, compress, islice, pairwise, repeat
from operator import eq, lt
from pathlib import Path
from typing import IO

import msgspec

from weightcache.errors import SafetensorsHeaderError, StoreError
from weightcache.safetensors_check import (
    _decode_typed,
    _entry,
    _mismatch,
    _repeated,
    _tensor,
    _Typed,
    _Where,
    check_open,
)

log = logging.getLogger(__name__)

MAX_PARTS = 8
MIN_PART_BYTES = 2 << 20  # smaller parts cost more in process starts than they save
_CUT = b"},"
_WINDOW = 1 << 20  # bytes read at a time while looking for a cut
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])
_ENVIRONMENT = ("PATH", "LD_LIBRARY_PATH", "PYTHONHOME", "LANG", "LC_ALL", "TMPDIR")


class _Part(msgspec.Struct, array_like=True):
    """What a child found in one part: its tensors' begins and ends (each sorted; one span [first, last) for tensors
    that tile one stretch by themselves: the layout check treats them as one tensor), its first and last key when
    its keys ascend (None when not), whether it holds "__metadata__", and the refusal of its first tensor wrong on
    its own (then no begins)."""

    first: list[int]
    last: list[int]
    names: list[str] | None
    metadata: bool
    refusal: str | None = None


class _Repeated(Enum):
    """A key hash is in two parts: a key repeats (or, once in 2**64, two hashes collide)."""

    KEY = "a key repeats"


_REPEATED = _Repeated.KEY
_PART = msgspec.msgpack.Decoder(_Part | None)
_LENGTH = struct.Struct("<Q")
# one big header checked at a time per process: no real model has a header of CHILD_MIN_BYTES (a 70B model's is
# ~100 KB), so only a hostile source waits here
_ONE_AT_A_TIME = threading.Lock()


def check_in_children(fd: int, name: str, header_len: int, file_size: int) -> None:
    """check_file's verdict on the open file `fd` (its `header_len` already read and within bounds), reached in
    child processes; raises SafetensorsHeaderError with the in-process check's words."""
    with _ONE_AT_A_TIME:  # a source of many big headers must not start workers by the dozen
        cuts = _cuts(fd, header_len, _part_count(header_len))
        parts = _run_parts(fd, name, header_len, file_size - 8 - header_len, cuts) if cuts else None
        if isinstance(parts, list):  # the whole text is valid, keys and all
            refusal = next((p.refusal for p in parts if p.refusal is not None), None)
            if refusal is not None:  # the first tensor in header order wrong on its own: the whole check's words
                raise SafetensorsHeaderError(refusal)
            if _tiled(parts, file_size - 8 - header_len):
                return
        _run_whole(fd, name, repeated=parts is _REPEATED)  # its words for a broken layout, a repeat, the unusual


def _part_count(header_len: int) -> int:
    return max(1, min(_cores(), MAX_PARTS, header_len // MIN_PART_BYTES))


def _cores(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The cores this process may keep busy: its CPU affinity, capped by its cgroup's quota (a daemon limited to
    500m on a 64-core node must not start 8 workers that then wait for each other)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota to read: the affinity stands
    return cores


def _cuts(fd: int, header_len: int, parts: int) -> list[int]:
    """Offsets in the header text of the `}` of a `},` near each 1/parts of it, ascending (fewer where a stretch
    has none)."""
    cuts: list[int] = []
    for i in range(1, parts):
        pos, stop = max(header_len * i // parts, cuts[-1] + len(_CUT) if cuts else 0), header_len * (i + 1) // parts
        while pos < stop:
            window = os.pread(fd, min(_WINDOW, header_len - pos), 8 + pos)
            found = window.find(_CUT)
            if found >= 0:
                cuts.append(pos + found)
                break
            pos += max(1, len(window) - (len(_CUT) - 1))  # overlap: a `},` across two windows is found
            if len(window) < len(_CUT):
                break
    return cuts


def _spawn(args: list[str], fd: int, seed: int) -> subprocess.Popen[bytes]:
    """A worker (OSError where none can be started: the caller checks in its own process then)."""
    if not sys.executable:  # an embedded interpreter: nothing to start
        raise OSError(errno.ENOEXEC, "no Python executable to start a worker with")
    # a process that parses hostile bytes gets no more than it needs: no credentials from the environment
    env = {key: os.environ[key] for key in _ENVIRONMENT if key in os.environ}
    env.update(PYTHONHASHSEED=str(seed),
               PYTHONPATH=os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")])))
    # -P: the working directory is not searched (a weightcache/ there must not be imported instead)
    return subprocess.Popen([sys.executable, "-P", "-m", "weightcache.safetensors_split", *args], pass_fds=(fd,),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def _receive(proc: subprocess.Popen[bytes], name: str) -> bytes:
    """A child's next message (length, then bytes); StoreError saying what became of the child when it ends first."""
    assert proc.stdout is not None
    length = proc.stdout.read(_LENGTH.size)
    message = proc.stdout.read(_LENGTH.unpack(length)[0]) if len(length) == _LENGTH.size else b""
    if len(length) == _LENGTH.size and len(message) == _LENGTH.unpack(length)[0]:
        return message
    assert proc.stderr is not None
    err = proc.stderr.read()
    code = proc.wait()
    how = (f"was killed by signal {-code}" + (" (out of memory?)" if code == -9 else "") if code < 0
           else f"exited with status {code}")
    last = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
    log.warning("safetensors header check of %s: worker %s: %s", name, how, last[0][:200])
    raise StoreError(f"{Path(name).name}: the safetensors header check's worker process {how}; give the daemon "
                     "more memory, or exclude the file")


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """The child gone (killed if it still runs: its answer is in or no longer wanted) and its pipes closed."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        with contextlib.suppress(OSError):
            if stream is not None:
                stream.close()


def _tell(proc: subprocess.Popen[bytes], name: str, message: bytes) -> None:
    """Send a child a message; StoreError saying what became of it when it is gone (not a BrokenPipeError)."""
    assert proc.stdin is not None
    try:
        _send(proc.stdin, message)
    except OSError:
        _receive(proc, name)  # its output ends: raises, saying how the child ended
        raise


def _send(stream: IO[bytes], message: bytes) -> None:
    stream.write(_LENGTH.pack(len(message)))
    stream.write(message)
    stream.flush()


def _run_parts(fd: int, name: str, header_len: int, data_size: int,
               cuts: list[int]) -> list[_Part] | _Repeated | None:
    """Each part checked by its own child, all at once; None when some part is not plain sailing. Keys that ascend
    from part to part are distinct; else each child hands over its key hashes in one bucket per child and finds
    the repeats in one bucket of every part's (so no process holds them all); the keys behind repeated hashes, in
    header order, then name the first repeated key as json would (refused here), or show a mere collision;
    _REPEATED where "__metadata__" is among them (json says where it stands)."""
    bounds = list(zip([0, *(c + 2 for c in cuts)], [*(c + 1 for c in cuts), header_len], strict=True))
    seed = random.SystemRandom().randint(1, 2**32 - 1)  # drawn per check: nobody can aim collisions at it
    procs: list[subprocess.Popen[bytes]] = []
    try:
        try:
            for start, end in bounds:
                procs.append(_spawn(["part", str(fd), str(header_len), str(data_size), str(start), str(end), name,
                                     str(len(bounds))], fd, seed))
        except OSError as exc:  # no process to be had (EAGAIN, ENOMEM): the whole header in one
            log.warning("safetensors header check: cannot start its workers (%s); checking in one", exc)
            return None
        parts = [_PART.decode(_receive(proc, name)) for proc in procs]
        found = [p for p in parts if p is not None]
        if len(found) < len(parts):
            return None
        if _ascending(found):
            return found
        for proc in procs:
            _tell(proc, name, b"buckets")
        buckets = [msgspec.msgpack.decode(_receive(proc, name), type=list[bytes]) for proc in procs]
        for i, proc in enumerate(procs):
            _tell(proc, name, b"".join(b[i] for b in buckets))
        repeats = set(chain.from_iterable(msgspec.msgpack.decode(_receive(proc, name), type=list[int])
                                          for proc in procs))
        if not repeats:
            return found
        wanted = array("q", sorted(repeats)).tobytes()
        for proc in procs:
            _tell(proc, name, wanted)
        named = [msgspec.msgpack.decode(_receive(proc, name), type=list[str] | None) for proc in procs]
        if None in named:  # "__metadata__" is one of them: json names the first repeat where it stands
            return _REPEATED
        candidates = list(chain.from_iterable(n for n in named if n is not None))
        if len(set(candidates)) == len(candidates):  # hashes collided, keys did not
            return found
        raise _repeated(name, "the header", tuple((key, None) for key in candidates))  # json's words
    finally:
        for proc in procs:
            _reap(proc)


def _ascending(parts: list[_Part]) -> bool:
    """Whether the parts' keys ascend from the first to the last (so no key repeats) with one "__metadata__" at
    most."""
    if any(p.names is None for p in parts) or sum(p.metadata for p in parts) > 1:
        return False
    spans = [p.names for p in parts if p.names]
    return all(a[-1] < b[0] for a, b in pairwise(spans))


def _run_whole(fd: int, name: str, *, repeated: bool) -> None:
    """The in-process check's verdict on the whole file, from one child (here when none can be started)."""
    try:
        proc = _spawn(["whole", str(fd), name, "repeated" if repeated else "any"], fd, 0)
    except OSError as exc:
        log.warning("safetensors header check: cannot start its worker (%s); checking here", exc)
        with os.fdopen(os.dup(fd), "rb") as fh:
            check_open(fh, name, repeated=repeated)
        return
    try:
        refusal = msgspec.msgpack.decode(_receive(proc, name), type=str | None)
    finally:
        _reap(proc)
    if refusal is not None:
        raise SafetensorsHeaderError(refusal)


def _tiled(parts: list[_Part], data_size: int) -> bool:
    """Whether the parts' tensors (each of the right size, none empty) tile the data: sorted begins and ends, each
    begin after the first is the end before it, from 0 to the end of the file. Parts in file order (as safetensors
    writes) are sorted by joining them; else by sorting."""
    first, last = list(chain.from_iterable(p.first for p in parts)), list(chain.from_iterable(p.last for p in parts))
    if not first:
        return data_size == 0
    filled = [p.first for p in parts if p.first]
    if any(a[-1] >= b[0] for a, b in pairwise(filled)):  # interleaved parts: sort the lot
        first.sort()
        last.sort()
    return first[0] == 0 and last[-1] == data_size and first[1:] == last[:-1]


def _read_part(fd: int, header_len: int, start: int, end: int) -> _Typed | None:
    """One part of the header: read as the typed road reads a header, or None when it is not plain sailing (the
    whole check then decides)."""
    text = os.pread(fd, end - start, 8 + start)
    if len(text) != end - start:
        return None
    text = (b"{" if start > 0 else b"") + text + (b"}" if end < header_len else b"")
    typed = _decode_typed(text)
    return typed if isinstance(typed, _Typed) else None


def _part_of(typed: _Typed, header_len: int, data_size: int, name: str) -> _Part | None:
    """What the parent is told of a part the typed road read, or None when the whole check must decide."""
    columns = typed.columns
    names = columns.names
    ascending = names[:1] + names[-1:] if all(map(lt, names, islice(names, 1, None))) else None
    bad = _mismatch(columns, data_size)
    if bad is not None:
        try:
            _tensor(_Where(name, 8 + header_len, data_size), bad, _entry(typed.tensors[bad]))
        except SafetensorsHeaderError as exc:
            return _Part([], [], ascending, typed.had_meta, str(exc))
        return None
    if any(map(eq, columns.begins, columns.ends)):  # an empty tensor: the whole check places it
        return None
    first, last = columns.first, columns.last
    if first[1:] == last[:-1]:  # the part's tensors tile a stretch alone (header order is file order): one span
        first, last = first[:1], last[-1:]
    return _Part(first, last, ascending, typed.had_meta)


def _buckets(typed: _Typed, count: int) -> list[bytes]:
    """The hashes of a part's keys as int64s, in `count` buckets by hash % count."""
    keys = list(map(hash, typed.columns.names)) + ([hash("__metadata__")] if typed.had_meta else [])
    which = list(map(count.__rmod__, keys))
    return [array("q", compress(keys, map(eq, which, repeat(b)))).tobytes() for b in range(count)]


def _repeats(hashes: bytes) -> list[int]:
    """The int64s that occur more than once in `hashes` (one bucket of every part's key hashes)."""
    column = array("q")
    column.frombytes(hashes)
    if len(set(column)) == len(column):
        return []
    return [h for h, n in Counter(column).items() if n > 1]


def _named(typed: _Typed, hashes: bytes) -> list[str] | None:
    """A part's keys whose hash is among `hashes`, in header order; None when "__metadata__" is one of them."""
    wanted = set(array("q", hashes))
    if typed.had_meta and hash("__metadata__") in wanted:
        return None
    names = typed.columns.names
    return list(compress(names, map(wanted.__contains__, map(hash, names))))


def _refusal(fd: int, name: str, repeated: bool) -> str | None:
    """The whole check's refusal of the file, None when it passes."""
    with os.fdopen(fd, "rb", closefd=False) as fh:
        try:
            check_open(fh, name, repeated=repeated)
        except SafetensorsHeaderError as exc:
            return str(exc)
    return None


def main(argv: list[str]) -> None:
    """The child's side, answering in length-prefixed msgpack on stdout: `part FD HEADER_LEN DATA_SIZE START END NAME
    WORKERS` (its _Part; then, asked for "buckets" on stdin, its key hashes; given a bucket of every part's, the
    hashes that repeat in it; given repeated hashes, its keys that have them) or `whole FD NAME repeated|any` (the
    refusal, or nil)."""
    gc.disable()  # millions of new containers, none cyclic
    out, source = sys.stdout.buffer, sys.stdin.buffer
    if argv[0] == "part":
        fd, header_len, data_size, start, end, workers = map(int, [*argv[1:6], argv[7]])
        typed = _read_part(fd, header_len, start, end)
        part = typed and _part_of(typed, header_len, data_size, argv[6])
        _send(out, msgspec.msgpack.encode(part))
        if typed is not None and part is not None and _message(source) == b"buckets":
            _send(out, msgspec.msgpack.encode(_buckets(typed, workers)))
            _send(out, msgspec.msgpack.encode(_repeats(_message(source))))
            wanted = _message(source)
            if wanted:
                _send(out, msgspec.msgpack.encode(_named(typed, wanted)))
    else:
        _send(out, msgspec.msgpack.encode(_refusal(int(argv[1]), argv[2], argv[3] == "repeated")))
    os._exit(0)  # the parent has its answer; freeing the tree would only cost time


def _message(stream: IO[bytes]) -> bytes:
    """The parent's next message to a child; b"" when it has closed the pipe (no more questions)."""
    length = stream.read(_LENGTH.size)
    return stream.read(_LENGTH.unpack(length)[0]) if len(length) == _LENGTH.size else b""


if __name__ == "__main__":
    main(sys.argv[1:])
