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
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from weightcache.errors import ModelFileNotFoundError, ModelLayoutError
from weightcache.safetensors_check import Header, TensorSpec, parse_header

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
    dev = torch.device(device)
    files = _open_files(_layout(path), None if keys is None else set(keys))
    started, total = time.perf_counter(), sum(f.header.tensors[n].nbytes for f in files for n in f.names)
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
    seconds = time.perf_counter() - started
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
    weight_map = _weight_map(index)
    by_shard: dict[str, set[str]] = {}
    for tensor, shard in weight_map.items():
        by_shard.setdefault(shard, set()).add(tensor)
    files: dict[Path, frozenset[str]] = {}
    for shard, tensors in by_shard.items():
        if Path(shard).is_absolute() or ".." in Path(shard).parts or "\0" in shard:
            raise ModelLayoutError(f"{index}: shard name {shard!r} must be a file name inside the model directory")
        if not (index.parent / shard).is_file():
            raise ModelFileNotFoundError(f"{index} names shard {shard!r}, which is missing from {index.parent}; "
                                         f"re-fetch the model (weightcache verify / prefetch) or fix the index")
        files[index.parent / shard] = frozenset(tensors)
    return files


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


def _open_files(layout: dict[Path, frozenset[str]], keys: set[str] | None) -> list[_File]:
    files, seen = [], set[str]()
    for p, indexed in layout.items():
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
        names = tuple(n for n in header.tensors if keys is None or n in keys)
        dup = seen.intersection(names)
        if dup:
            raise ModelLayoutError(f"tensor {sorted(dup)[0]!r} appears in more than one file ({p.name} and another); "
                                   f"keep one copy or add a {INDEX_NAME}")
        seen.update(names)
        base = torch.frombuffer(mm, dtype=torch.uint8)
        files.append(_File(p, header, names, mm, base))
    if keys is not None and keys - seen:
        missing = sorted(keys - seen)
        raise ModelLayoutError(f"{len(missing)} requested tensors are not in the model, e.g. {missing[:3]}; "
                               f"check the names against the model's index")
    _check_dtypes(files)
    return files


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
