"""Load a mounted model directory into tensors: zero-copy on cpu, pinned multi-stream copies on cuda.

For pods: imports only the standard library, torch and the package's stdlib-only header check and errors
(a test enforces it), so an inference image needs nothing of the daemon.

    from weightcache.loader import load_state_dict
    model.load_state_dict(load_state_dict(os.environ["WEIGHTCACHE_MODEL_PATH"]))

How bytes move. Every file is mapped copy-on-write (MAP_PRIVATE); tensors are views of that mapping, so the pod
and every other reader share the node's one page-cache copy (and the memory tier's locked pages) until a page is
written: an in-place op (`t.add_(1)`, an optimizer step on parameters loaded with assign=True) then copies just the
pages it touches into the process's own memory. The file, opened read-only, never changes. Before a tensor is
handed out, its 64 MiB chunks are faulted in by READ_THREADS threads (at most one per CPU of the cgroup; none
on cpu when the model is in the page cache already) with madvise(MADV_POPULATE_READ), with sequential read-ahead
hints on the file and the mapping; this keeps the disk queue full where page-fault-at-a-time reading does not,
and maps cached pages faster than the consumer's own faults. No MADV_HUGEPAGE on the mapping: it slowed cold
loads; the memory tier builds 2 MiB folios instead (the measurements: docs/loader.md).
On cuda each chunk is page-locked in place with cudaHostRegister(ReadOnly) and copied on one of several streams
while later chunks are still being read; where registering is refused (older drivers, some filesystems) chunks go
through a few reused pinned bounce buffers instead.

copy=True still gives tensors that own their memory (a copy up front instead of page by page on first write).
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import ClassVar

import torch

from weightcache.errors import FetchPendingError, ModelFileNotFoundError, ModelLayoutError, StreamFailedError
from weightcache.safetensors_check import Header, TensorSpec, parse_header
from weightcache.vocabulary import STREAM_COMPLETE, STREAM_DIR, STREAM_FAILED, STREAM_FETCHING, STREAM_STATE

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20  # a 1T-parameter model's index is a few MB; more is not an index
CHUNK_BYTES = 64 << 20  # unit of read-ahead, page-locking and H2D copies
READ_THREADS = 4  # best measured; more threads thrash a virtio queue (at most one per CPU the cgroup gives)
CUDA_STREAMS = 4
_PAGE = mmap.PAGESIZE
_MADV_POPULATE_READ = 22  # Linux >= 5.14
_CUDA_HOST_REGISTER_READ_ONLY = 0x08

_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr) for name, attr in {
        "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "F16": "float16",
        "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32", "I64": "int64", "U64": "uint64",
        "F64": "float64", "C64": "complex64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
        "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu",
    }.items() if hasattr(torch, attr)
}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_libc.syscall.restype = ctypes.c_long
_RESIDENT = bytes(i & 1 for i in range(256))  # mincore: bit 0 of each page's byte says resident
_SYS_CACHESTAT = 451  # Linux >= 6.5; one number on every architecture (added after the tables were unified)
MAX_STATE_BYTES = 16 << 20  # a streaming view's state lists relpaths: a model of 100k files needs a few MB
POLL_SECONDS = 0.05  # how often a load from a streaming view looks for new files and a new state
_MAX_ERROR_CHARS = 4000  # of a failed state's error text, in the exception raised

Keys = Iterable[str] | Callable[[str], bool] | None


@dataclass(frozen=True)
class _File:
    """One mapped shard and the tensors wanted from it, in file order."""

    path: Path
    header: Header
    names: tuple[str, ...]
    mm: mmap.mmap
    base: torch.Tensor  # uint8 view of the whole mapping

    def chunks(self) -> list[tuple[int, int]]:
        """Page-aligned CHUNK_BYTES pieces of the file that hold wanted bytes, in order."""
        wanted = [self.header.tensors[n] for n in self.names if self.header.tensors[n].nbytes]
        out: list[tuple[int, int]] = []
        for spec in wanted:
            first, last = spec.start // CHUNK_BYTES, (spec.end - 1) // CHUNK_BYTES
            for k in range(first, last + 1):
                if not out or out[-1][0] < k * CHUNK_BYTES:
                    out.append((k * CHUNK_BYTES, min((k + 1) * CHUNK_BYTES, self.header.file_size)))
        return out


def load_state_dict(
    path: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    keys: Iterable[str] | None = None,
    copy: bool = False,
) -> dict[str, torch.Tensor]:
    """All tensors of a model (a directory, a .safetensors file or a model.safetensors.index.json) by name.

    `keys` loads only those tensors; `dtype` converts (a copy); `copy=True` copies cpu tensors up front (they are
    writable either way: copy-on-write views of the mapping).
    """
    return dict(iter_tensors(path, device=device, dtype=dtype, keys=keys, copy=copy))


def iter_tensors(
    path: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    keys: Iterable[str] | None = None,
    copy: bool = False,
    host_register: bool | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) in file order, each as soon as its bytes are in place (low time to first tensor).

    `host_register` (cuda only): True page-locks the mapping in place, False uses pinned bounce buffers,
    None tries in place and falls back.
    """
    yield from _plain(path, keys, torch.device(device), dtype, copy, host_register)


# ---- streaming views -------------------------------------------------------------------------------------------
# A pod whose volume is a streaming view (docs/streaming-pods.md) sees a read-only directory that grows: each file
# appears whole (a hard link the daemon makes in one step) and never changes, and <view>/.weightcache/state says
# what the view will hold and whether the fetch behind it goes on, finished or failed. The loader polls: a stat of
# each awaited file and of the state every POLL_SECONDS. That is a few syscalls per 50 ms, nothing next to the
# load, and it works on every filesystem and under every seccomp profile, so no inotify (which the design allowed
# for; not worth its fallbacks here).


def iter_tensors_streaming(
    path: str | os.PathLike[str],
    *,
    timeout: float = 600.0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    keys: Keys = None,
    copy: bool = False,
    host_register: bool | None = None,
    pause: Callable[[float], None] = time.sleep,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Like `iter_tensors` on a directory, but from a view that is still being filled: each shard's tensors are
    yielded as soon as that shard is in the view (shards in the order they arrive).

    Without `<path>/.weightcache/state` the directory is a plain snapshot and this is `iter_tensors(path)`. Else
    the shards are those the loader's rule for a directory picks from the state's planned files (the index's, once
    the index is in the view, else every root `*.safetensors`). `keys` may also be a test on a tensor name (for
    callers that cannot know the names before the shards arrive). Raises StreamFailedError with the daemon's error
    text when the state says `failed`, ModelFileNotFoundError when it says `complete` and a planned shard is not
    there, FetchPendingError after `timeout` seconds without a new file (the clock starts again at each one; time
    spent by the consumer between tensors does not count), ModelLayoutError for a state file that is not what the
    daemon writes (a symlink, too large, bad JSON or types, a path outside the view) and, as for a directory, for a
    tensor in two shards or an index that maps a tensor to a shard without it. A tensor found in a second shard
    is an error only when that shard arrives: tensors of earlier shards were handed out already. `pause(seconds)`
    is how the loader waits between two looks at the view (tests count its calls to order their steps after the
    loader's looks).
    """
    p = Path(path)
    if not os.path.lexists(p / STREAM_STATE):
        yield from _plain(p, keys, torch.device(device), dtype, copy, host_register)  # a plain snapshot
        return
    view = _View(p, timeout, pause)
    planned = view.plan()
    if INDEX_NAME in planned:
        view.wait_for([INDEX_NAME])
        layout = _index_shards(p / INDEX_NAME)
        unplanned = sorted(layout.keys() - set(planned))
        if unplanned:
            raise ModelFileNotFoundError(f"{p / INDEX_NAME} names shard {unplanned[0]!r}, which the streaming view "
                                         f"will not hold (not in {p / STREAM_STATE}); fix the index, or the "
                                         f"ModelCache's include globs if they leave it out")
    else:
        layout = dict.fromkeys(sorted(r for r in planned if "/" not in r and r.endswith(".safetensors")),
                               frozenset())
        if not layout:
            raise ModelLayoutError(f"the streaming view {p} will hold no *.safetensors file and no {INDEX_NAME} "
                                   f"(its state lists {len(planned)} files); this loader reads safetensors models")
    dev = torch.device(device)
    want, required = _wanted(keys)
    seen: set[str] = set()
    loaded: list[_File] = []
    started = time.perf_counter()
    for rel in view.arrivals(list(layout)):
        f = _open_file(p / rel, layout[rel], want)
        _check_unique(f, seen)
        _check_dtypes([f])
        loaded.append(f)
        yield from _tensors_of([f], dev, dtype, copy, host_register)
    _check_required(required, seen)
    _log_load(loaded, dev, started)


def wait_for_files(path: str | os.PathLike[str], names: Iterable[str] | None = None, *,
                   timeout: float = 600.0, pause: Callable[[float], None] = time.sleep) -> None:
    """Return once `names` (relpaths) are in the model directory `path`; for an engine's entry point, which reads
    config.json and the tokenizer before any weight (`python -c 'from weightcache.loader import wait_for_files;
    wait_for_files("/models/model")' && exec vllm serve /models/model ...`).

    `names=None`: every file the view will hold except `*.safetensors` (config, tokenizer, generation config,
    chat template, the index...). Without `<path>/.weightcache/state` (a plain snapshot) nothing is waited for:
    each name must be there already. The state's rules are iter_tensors_streaming's: StreamFailedError on
    `failed`, ModelFileNotFoundError for a name the view will not hold or that is absent once `complete`,
    FetchPendingError after `timeout` seconds without a new file; `pause` as there.
    """
    p = Path(path)
    asked = None if names is None else [_checked_name(n) for n in names]
    if not os.path.lexists(p / STREAM_STATE):
        absent = [n for n in asked or [] if not (p / n).is_file()]
        if absent:
            raise ModelFileNotFoundError(f"{p} holds no {absent[0]!r}; is the model volume mounted at that path?")
        return
    view = _View(p, timeout, pause)
    planned = view.plan()
    if asked is None:
        asked = [r for r in planned if not r.endswith(".safetensors")]
    unplanned = [n for n in asked if n not in planned]
    if unplanned:
        raise ModelFileNotFoundError(f"the streaming view {p} will not hold {unplanned[0]!r} (not in "
                                     f"{p / STREAM_STATE}); the model, or the ModelCache's include globs, leave it out")
    view.wait_for(asked)


def planned_files(path: str | os.PathLike[str], *, timeout: float = 600.0) -> list[str] | None:
    """The relpaths a streaming view at `path` will hold (waiting until its state lists them), or None when `path`
    is not a streaming view (no `.weightcache/state`). Errors as wait_for_files."""
    p = Path(path)
    if not os.path.lexists(p / STREAM_STATE):
        return None
    return list(_View(p, timeout).plan())


def _checked_name(name: str) -> str:
    rel = _relpath(name) if isinstance(name, str) else None
    if rel is None:
        raise ValueError(f"{name!r} is not a relative path inside the model directory")
    return rel


def _plain(path: str | os.PathLike[str], keys: Keys, dev: torch.device, dtype: torch.dtype | None, copy: bool,
           host_register: bool | None) -> Iterator[tuple[str, torch.Tensor]]:
    """iter_tensors: every file of the model mapped and checked first, then the tensors file by file."""
    want, required = _wanted(keys)
    files = _open_files(_layout(path), want, required)
    started = time.perf_counter()
    yield from _tensors_of(files, dev, dtype, copy, host_register)
    _log_load(files, dev, started)


@dataclass(frozen=True)
class _State:
    state: str  # STREAM_FETCHING | STREAM_COMPLETE | STREAM_FAILED
    files: tuple[str, ...] | None  # normalized relpaths, None until the daemon has the listing
    error: str | None


class _View:
    """A streaming view being waited on: its state (re-read when the file was replaced) and the no-progress clock."""

    def __init__(self, path: Path, timeout: float, pause: Callable[[float], None] = time.sleep) -> None:
        self.path, self.timeout, self._sleep = path, timeout, pause
        self.state_path = path / STREAM_STATE
        self._signature: tuple[int, ...] | None = None
        self._state: _State | None = None
        self._progress = time.monotonic()

    def plan(self) -> tuple[str, ...]:
        """The files the view will hold, once the state lists them."""
        while True:
            state = self._current()
            if state.files is not None:
                self._progress = time.monotonic()
                return state.files
            self._pause("the list of files the view will hold")

    def wait_for(self, rels: Sequence[str]) -> None:
        for _ in self.arrivals(rels):
            pass

    def arrivals(self, rels: Sequence[str]) -> Iterator[str]:
        """Each of `rels` once it is a file in the view, in the order they arrive. The clock restarts when the
        caller comes back for the next one, so its own work between arrivals does not count as waiting."""
        pending = list(rels)
        while pending:
            state = self._current()  # before looking at the files: a file linked before `complete` is seen
            here = [r for r in pending if (self.path / r).is_file()]
            for rel in here:
                pending.remove(rel)
                yield rel
                self._progress = time.monotonic()
            if here or not pending:
                continue
            if state.state == STREAM_COMPLETE:
                raise ModelFileNotFoundError(f"the streaming view {self.path} is complete but lacks {pending[0]!r}"
                                             f"{f' (and {len(pending) - 1} more)' if len(pending) > 1 else ''}, "
                                             f"which its state planned; the daemon's view is inconsistent: restart "
                                             f"the pod, and report it if it happens again")
            self._pause(_listing(pending))

    def _pause(self, waiting_for: str) -> None:
        waited = time.monotonic() - self._progress
        if waited >= self.timeout:
            state = self._state.state if self._state else "?"
            raise FetchPendingError(f"{self.path}: no new file in the streaming view for {waited:.1f}s (timeout "
                                    f"{self.timeout:g}s, state {state!r}); still waiting for {waiting_for}. The "
                                    f"node's fetch of the model may be stalled: see `weightcache status` on the "
                                    f"node, or allow a longer timeout")
        self._sleep(min(POLL_SECONDS, self.timeout - waited))

    def _current(self) -> _State:
        """The state, read again only when the file changed (tmp + rename gives a new inode); raises on failed."""
        try:
            st = os.lstat(self.state_path)
        except FileNotFoundError:
            raise ModelFileNotFoundError(f"{self.state_path} disappeared while the model was loading: the volume "
                                         f"was unpublished under the pod") from None
        signature = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if self._state is None or signature != self._signature:
            self._state, self._signature = _read_state(self.path), signature
        if self._state.state == STREAM_FAILED:
            text = self._state.error or "no error text"
            if len(text) > _MAX_ERROR_CHARS:
                text = text[:_MAX_ERROR_CHARS] + "..."
            raise StreamFailedError(f"the node's fetch of the model in {self.path} failed: {text}")
        return self._state


def _read_state(view: Path) -> _State:
    """`<view>/.weightcache/state`, untrusted: opened without following a symlink at either component, bounded,
    every field's type checked and every relpath kept inside the view."""
    where = view / STREAM_STATE
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        dfd = os.open(view / STREAM_DIR, flags | os.O_DIRECTORY)
        try:
            fd = os.open(PurePosixPath(STREAM_STATE).name, flags | os.O_NONBLOCK, dir_fd=dfd)  # a FIFO: no hang
        finally:
            os.close(dfd)
    except FileNotFoundError:
        raise ModelFileNotFoundError(f"{where} disappeared while the model was loading: the volume was "
                                     f"unpublished under the pod") from None
    except OSError as exc:  # ELOOP: a symlink; ENOTDIR: .weightcache is not a directory
        raise ModelLayoutError(f"refusing {where}: {exc.strerror}; the daemon writes a regular file in a "
                               f"directory there, never a symlink") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ModelLayoutError(f"refusing {where}: not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            raw = fh.read(MAX_STATE_BYTES + 1)
    finally:
        os.close(fd)
    return _parse_state(raw, where)


def _parse_state(raw: bytes, where: Path) -> _State:
    def bad(why: str) -> ModelLayoutError:
        return ModelLayoutError(f"{where} is not a state the weightcache daemon writes: {why}")

    if len(raw) > MAX_STATE_BYTES:
        raise bad(f"larger than {MAX_STATE_BYTES >> 20} MiB")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise bad("JSON nested too deeply") from None
    except ValueError as exc:
        raise bad(f"not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise bad("not a JSON object")
    state, files, error = doc.get("state"), doc.get("files"), doc.get("error")
    if state not in (STREAM_FETCHING, STREAM_COMPLETE, STREAM_FAILED):
        raise bad(f"state {state!r} is none of {STREAM_FETCHING!r}, {STREAM_COMPLETE!r}, {STREAM_FAILED!r}")
    if error is not None and not isinstance(error, str):
        raise bad("error must be a string or null")
    if files is None:
        if state == STREAM_COMPLETE:
            raise bad("a complete view must list its files")
        return _State(state, None, error)
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise bad("files must be a list of relative paths or null")
    rels: dict[str, None] = {}
    for name in files:
        rel = _relpath(name)
        if rel is None:
            raise bad(f"file {name[:200]!r} is not a relative path inside the view")
        rels[rel] = None
    return _State(state, tuple(rels), error)


def _listing(rels: Sequence[str]) -> str:
    shown = ", ".join(repr(r) for r in rels[:3])
    return f"{len(rels)} file{'s' if len(rels) > 1 else ''}: {shown}{', ...' if len(rels) > 3 else ''}"


def _wanted(keys: Keys) -> tuple[Callable[[str], bool] | None, set[str] | None]:
    """`keys` as (a test on a tensor name or None for all, the names that must all be found or None)."""
    if keys is None:
        return None, None
    if callable(keys):
        return keys, None
    required = set(keys)
    return required.__contains__, required


def _tensors_of(files: list[_File], dev: torch.device, dtype: torch.dtype | None, copy: bool,
                host_register: bool | None) -> Iterator[tuple[str, torch.Tensor]]:
    threads = _read_threads(files)
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="weightcache-read") as pool:
        try:
            for f in files:
                if dev.type == "cuda":
                    yield from _cuda_file(f, pool, dev, dtype, host_register)
                else:
                    yield from _cpu_file(f, pool if threads else None, dev, dtype, copy)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _log_load(files: list[_File], dev: torch.device, started: float) -> None:
    seconds = time.perf_counter() - started
    total = sum(f.header.tensors[n].nbytes for f in files for n in f.names)
    log.info("loaded %d files, %.1f MB to %s in %.2fs (%.2f GB/s)", len(files), total / 1e6, dev, seconds,
             total / max(seconds, 1e-9) / 1e9)


def _layout(path: str | os.PathLike[str]) -> dict[Path, frozenset[str]]:
    """Each file of the model -> the tensors an index says it holds (empty: whatever its header lists)."""
    p = Path(path)
    if p.is_dir():
        if (p / INDEX_NAME).is_file():
            return _index_files(p / INDEX_NAME)
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise ModelLayoutError(f"{p} holds no *.safetensors file and no {INDEX_NAME}; point the loader at the "
                                   f"directory the model is mounted at (WEIGHTCACHE_MODEL_PATH)")
        return dict.fromkeys(files, frozenset())
    if p.name.endswith(".index.json"):
        return _index_files(p)
    if not p.is_file():
        raise ModelFileNotFoundError(f"{p} does not exist; is the model volume mounted at that path?")
    return {p: frozenset()}


def _index_files(index: Path) -> dict[Path, frozenset[str]]:
    files: dict[Path, frozenset[str]] = {}
    for shard, tensors in _index_shards(index).items():
        if not (index.parent / shard).is_file():
            raise ModelFileNotFoundError(f"{index} names shard {shard!r}, which is missing from {index.parent}; "
                                         f"re-fetch the model (weightcache verify / prefetch) or fix the index")
        files[index.parent / shard] = tensors
    return files


def _index_shards(index: Path) -> dict[str, frozenset[str]]:
    """The index's shards (relpaths inside the model directory, normalized) -> the tensors it maps to each."""
    by_shard: dict[str, set[str]] = {}
    for tensor, shard in _weight_map(index).items():
        rel = _relpath(shard)
        if rel is None:
            raise ModelLayoutError(f"{index}: shard name {shard!r} must be a file name inside the model directory")
        by_shard.setdefault(rel, set()).add(tensor)
    return {shard: frozenset(tensors) for shard, tensors in by_shard.items()}


def _relpath(name: str) -> str | None:
    """`name` as a normalized relative path inside a directory, or None when it is not one (absolute, `..`)."""
    if not name or "\0" in name or name.startswith("/"):
        return None
    parts = PurePosixPath(name).parts
    if not parts or ".." in parts:
        return None
    return PurePosixPath(*parts).as_posix()


def _weight_map(index: Path) -> dict[str, str]:
    with open(index, "rb") as fh:
        raw = fh.read(MAX_INDEX_BYTES + 1)
    if len(raw) > MAX_INDEX_BYTES:
        raise ModelLayoutError(f"{index} is larger than {MAX_INDEX_BYTES >> 20} MiB, far more than any model's "
                               f"index; fix or remove it")
    try:
        # json's recursion guard raises RecursionError on deep nesting: a hostile index, not a crash
        weight_map = json.loads(raw.decode("utf-8")).get("weight_map")
    except (ValueError, AttributeError, RecursionError) as exc:
        what = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ModelLayoutError(f"{index} is not a JSON object with a weight_map: {what}") from None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ModelLayoutError(f"{index}: weight_map must be a non-empty object of tensor name -> shard file name")
    return weight_map


def _open_files(layout: dict[Path, frozenset[str]], want: Callable[[str], bool] | None,
                required: set[str] | None = None) -> list[_File]:
    files, seen = [], set[str]()
    for p, indexed in layout.items():
        f = _open_file(p, indexed, want)
        _check_unique(f, seen)
        files.append(f)
    _check_required(required, seen)
    _check_dtypes(files)
    return files


def _open_file(p: Path, indexed: frozenset[str], want: Callable[[str], bool] | None) -> _File:
    """Map one shard; `indexed`: the tensors an index says it holds (each must be there)."""
    with open(p, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        header = parse_header(fh, size)
        absent = indexed - header.tensors.keys()
        if absent:
            raise ModelLayoutError(f"the index maps {len(absent)} tensors to {p.name}, which does not hold them, "
                                   f"e.g. {sorted(absent)[:3]}; re-fetch the model or fix the index")
        # Larger read-ahead per fault: measured 2.7x faster cold loads on the dev VM (docs/loader.md).
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        # copy-on-write: shared page-cache pages until written, then private copies of the written pages only
        mm = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)
        mm.madvise(mmap.MADV_SEQUENTIAL)
    names = tuple(n for n in header.tensors if want is None or want(n))
    return _File(p, header, names, mm, torch.frombuffer(mm, dtype=torch.uint8))


def _check_unique(f: _File, seen: set[str]) -> None:
    """No tensor of `f` was in an earlier file (`seen`, which takes f's names)."""
    dup = seen.intersection(f.names)
    if dup:
        raise ModelLayoutError(f"tensor {sorted(dup)[0]!r} appears in more than one file ({f.path.name} and "
                               f"another); keep one copy or add a {INDEX_NAME}")
    seen.update(f.names)


def _check_required(required: set[str] | None, seen: set[str]) -> None:
    if required is not None and required - seen:
        missing = sorted(required - seen)
        raise ModelLayoutError(f"{len(missing)} requested tensors are not in the model, e.g. {missing[:3]}; "
                               f"check the names against the model's index")


def _read_threads(files: list[_File]) -> int:
    """Threads that read chunks ahead: none when every wanted byte is in the page cache already, else
    READ_THREADS, at most one per CPU this process may use (its affinity and its cgroup's cpu.max quota). Cached
    pages need no reading, only mapping, and the consumer's own faults map them 16 at a time (the kernel's
    fault-around): a warm 1 GB load took 52 ms with one thread populating ahead and 38.5 ms without, as
    safetensors.load_file's 39.5 (docs/loader.md). On cuda the chunks are populated all the same: the copy wants
    them mapped before it is issued."""
    if all(_resident(f) for f in files):
        return 0
    return max(1, min(READ_THREADS, _usable_cpus()))


def _usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, bounded by the cgroup v2 quota (cpu.max) when it has one."""
    cpus = len(os.sched_getaffinity(0))
    try:
        with open("/sys/fs/cgroup/cpu.max") as fh:
            quota, period = fh.read().split()[:2]
        if quota != "max" and int(period) > 0:
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 file here (cgroup v1, a bare host): the affinity mask alone
    return cpus


def _resident(f: _File) -> bool:
    """Every page of the file's wanted chunks is in the page cache: cachestat(2) counts them in the kernel (0.2 ms
    for a 0.5 GB shard; mincore's vector of one byte per page took 12 ms, a third of a warm load), mincore on the
    mapping where the kernel lacks cachestat (before 6.5). Faults nothing."""
    chunks = f.chunks()
    if not chunks:
        return True
    start, end = chunks[0][0], chunks[-1][1]
    pages = -(-(end - start) // _PAGE)
    cached = _cached_pages(f.path, start, end)
    if cached is not None:
        return cached >= pages
    vec = ctypes.create_string_buffer(pages)
    if _libc.mincore(f.base.data_ptr() + start, end - start, vec) != 0:
        return False  # cannot tell: read ahead as for a cold file
    return 0 not in vec.raw.translate(_RESIDENT)


class _CacheStatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted",
                                                     "nr_recently_evicted")]


def _cached_pages(path: Path, start: int, end: int) -> int | None:
    """Pages of bytes [start, end) of `path` in the page cache (cachestat), or None where it cannot say."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        stat = _CacheStat()
        if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(_CacheStatRange(start, end - start)), ctypes.byref(stat),
                         0) != 0:
            return None  # ENOSYS (before Linux 6.5) or refused by a seccomp filter: mincore answers instead
        return int(stat.nr_cache)
    finally:
        os.close(fd)


def _check_dtypes(files: list[_File]) -> None:
    for f in files:
        for n in f.names:
            if f.header.tensors[n].dtype not in _TORCH_DTYPES:
                raise ModelLayoutError(f"{f.path.name}: tensor {n!r} has dtype {f.header.tensors[n].dtype}, which "
                                       f"torch {torch.__version__} cannot represent; upgrade torch")


def _populate(f: _File, start: int, end: int) -> None:
    """Fault a chunk into the page cache and our page table; keeps many reads in flight when run in parallel,
    and maps already cached pages faster than the consumer's own page faults would (warm: 25 vs 15 GB/s)."""
    addr = f.base.data_ptr() + start
    if _libc.madvise(addr, end - start, _MADV_POPULATE_READ) != 0:
        err = ctypes.get_errno()
        if err != 22:  # EINVAL: a kernel before 5.14; ask for read-ahead instead
            raise OSError(err, f"reading {f.path}: {os.strerror(err)}")
        fd = os.open(f.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


def _view(f: _File, name: str) -> torch.Tensor:
    spec: TensorSpec = f.header.tensors[name]
    dt = _TORCH_DTYPES[spec.dtype]
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=dt)
    raw = f.base[spec.start:spec.end]
    if spec.start % dt.itemsize == 0:
        return raw.view(dt).view(spec.shape)
    return raw.clone().view(dt).view(spec.shape)  # misaligned for its dtype (hand-written files): copy


def _cpu_file(f: _File, pool: ThreadPoolExecutor | None, dev: torch.device, dtype: torch.dtype | None,
              copy: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """`pool`: the read-ahead threads; None when the file is cached (the tensors' own faults map it)."""
    chunks = f.chunks() if pool is not None else []
    futures = [pool.submit(_populate, f, a, b) for a, b in chunks] if pool is not None else []
    done = 0
    for name in f.names:
        end = f.header.tensors[name].end
        while done < len(chunks) and chunks[done][0] < end:
            futures[done].result()
            done += 1
        t = _view(f, name)
        if dtype is not None and dtype != t.dtype:
            t = t.to(dtype)
        elif copy:
            t = t.clone()
        yield name, t.to(dev) if dev.type != "cpu" else t


# ---- cuda ---------------------------------------------------------------------------------------------------


class _Pinned:
    """Reused pinned bounce buffers (allocating and first-touching pinned memory per load costs more than the copy)."""

    _lock = threading.Lock()
    _buffers: ClassVar[list[torch.Tensor]] = []

    @classmethod
    def get(cls, count: int) -> list[torch.Tensor]:
        with cls._lock:
            while len(cls._buffers) < count:
                cls._buffers.append(torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True))
            return cls._buffers[:count]


def _register(ptr: int, length: int) -> bool:
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    err = int(cudart.cudaHostRegister(ptr, length, _CUDA_HOST_REGISTER_READ_ONLY))
    if err != 0:
        _clear_cuda_error()
        log.info("cudaHostRegister(read-only) refused (cudaError %d); using pinned bounce buffers", err)
    return err == 0


def _clear_cuda_error() -> None:
    """A refused cudaHostRegister leaves a last-error that torch's next launch check would raise; reset it."""
    with open("/proc/self/maps") as maps:
        libs = {line.split()[-1] for line in maps if "libcudart" in line}
    for lib in libs:
        ctypes.CDLL(lib).cudaGetLastError()


def _cuda_file(f: _File, pool: ThreadPoolExecutor, dev: torch.device, dtype: torch.dtype | None,
               host_register: bool | None) -> Iterator[tuple[str, torch.Tensor]]:
    chunks = f.chunks()
    if not chunks:
        for name in f.names:
            yield name, _device_view(torch.empty(0, dtype=torch.uint8, device=dev), 0, f.header.tensors[name], dtype)
        return
    lo, hi = chunks[0][0], chunks[-1][1]
    buf = torch.empty(hi - lo, dtype=torch.uint8, device=dev)  # tensors are views of it, as on cpu
    streams = [torch.cuda.Stream(dev) for _ in range(CUDA_STREAMS)]  # type: ignore[no-untyped-call]
    bounce: list[torch.Tensor] = []  # taken only when registering is refused
    bounce_done: list[torch.cuda.Event | None] = [None] * (2 * CUDA_STREAMS)
    events: list[torch.cuda.Event] = []
    registered: list[int] = []
    futures = [pool.submit(_populate, f, a, b) for a, b in chunks]
    use_register = host_register is not False
    try:
        issued = synced = 0
        for name in f.names:
            spec = f.header.tensors[name]
            while issued < len(chunks) and chunks[issued][0] < spec.end:
                a, b = chunks[issued]
                futures[issued].result()
                s = streams[issued % len(streams)]
                ptr = f.base.data_ptr() + a
                if use_register and _register(ptr, -(-b // _PAGE) * _PAGE - a):  # whole pages of the mapping
                    registered.append(ptr)
                    with torch.cuda.stream(s):
                        buf[a - lo:b - lo].copy_(f.base[a:b], non_blocking=True)
                else:
                    if host_register:
                        raise ModelLayoutError("cudaHostRegister refused the mapping; pass host_register=None")
                    use_register = False
                    bounce = bounce or _Pinned.get(len(bounce_done))
                    i = issued % len(bounce)
                    previous = bounce_done[i]
                    if previous is not None:
                        previous.synchronize()  # the previous copy out of this buffer has finished
                    bounce[i][:b - a].copy_(f.base[a:b])
                    with torch.cuda.stream(s):
                        buf[a - lo:b - lo].copy_(bounce[i][:b - a], non_blocking=True)
                    done_event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    done_event.record(s)
                    bounce_done[i] = done_event
                ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
                ev.record(s)
                events.append(ev)
                issued += 1
            while synced < issued:
                events[synced].synchronize()
                synced += 1
            yield name, _device_view(buf, lo, spec, dtype)
    finally:
        for s in streams:
            s.synchronize()
        for ptr in registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]


def _device_view(buf: torch.Tensor, lo: int, spec: TensorSpec, dtype: torch.dtype | None) -> torch.Tensor:
    dt = _TORCH_DTYPES[spec.dtype]
    if spec.nbytes == 0:
        t = torch.empty(spec.shape, dtype=dt, device=buf.device)
    else:
        raw = buf[spec.start - lo:spec.end - lo]
        t = (raw if (spec.start - lo) % dt.itemsize == 0 else raw.clone()).view(dt).view(spec.shape)
    return t if dtype is None or dtype == dt else t.to(dtype)
