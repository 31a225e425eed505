"""The host-memory tier: keep hot snapshots resident in RAM within a byte budget, so no pod pays a cold disk read.

Mode "mlock" (the default) maps every file of a snapshot MAP_SHARED read-only and mlock()s it: the store's own
page-cache pages are pinned in place, with no copy and no second RAM copy. A snapshot's files are hard links
to the blobs (same inode, same page cache), and a pod's bind mount reaches the same inode, so every pod that
reads the model hits the locked pages; a page-cache drop or memory pressure cannot evict them.
Mode "tmpfs" copies the snapshot into `tmpfs_root/<id>/` (shmem pages) and locks that; the CSI plugin mounts
the copy instead (`path_for`). It costs a second copy in RAM and the copy time, and exists for CUDA:
`cudaHostRegister(cudaHostRegisterReadOnly)` on a file-backed MAP_SHARED mapping is expected to work on current
drivers (the loader tries it and falls back to pinned bounce buffers); where a fleet's driver refuses it and
the bounce copy is too slow, tmpfs (shmem) pages are the documented fallback. scripts/gpu_check.py checks this.

mlock in place is the default: it is several times faster than the tmpfs copy and costs no second copy.
Where transparent huge pages are not "never", promote first re-reads each file into 2 MiB page-cache folios
(drop its unmapped pages, MADV_HUGEPAGE, populate): pods then map 2 MiB per page-table entry, which loads several
times faster from the locked pages; `huge_folios=False` turns the re-read off. The measurements behind both
choices are in docs/loader.md. Promote reads one byte of every page it locks (`_touch`): under a hypervisor
the first CPU access to pages the disk filled faults into it, and a pod's first load paid that (1.7 GB/s
against 80+ later).

Locked pages are charged to the daemon's memory cgroup and bounded by RLIMIT_MEMLOCK unless the process holds
CAP_IPC_LOCK: `check_limits` says which DaemonSet setting to raise before anything is locked. The tier never
goes over budget: unpinned snapshots are demoted least recently used first, and a snapshot that still does not
fit is refused with the numbers. A refused promote leaves nothing locked; the snapshot keeps being served from disk.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import resource
import shutil
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from weightcache.download import drop_cached
from weightcache.errors import MemoryTierError
from weightcache.units import fmt_bytes

if TYPE_CHECKING:
    from weightcache.store.types import Snapshot

log = logging.getLogger(__name__)

MODES = ("mlock", "tmpfs")
HEADROOM_BYTES = 256 << 20  # the daemon's own memory, on top of the budget, inside its cgroup limit
CAP_IPC_LOCK = 14
_PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
for _fn in (_libc.mlock, _libc.munlock, _libc.munmap):
    _fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MADV_HUGEPAGE, _MADV_POPULATE_READ = 14, 22
_TOUCH_STEP = 8 << 20  # bytes touched per call holding the GIL: 2,048 pages, at most ~6 ms under a hypervisor


def _thp_enabled() -> bool:
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False



@dataclass(frozen=True)
class ResidentInfo:
    """A resident snapshot, for `weightcache ls`, the API and metrics."""

    id: str
    bytes: int  # locked bytes (page-rounded)
    pinned: bool
    last_used: float  # unix time
    mode: str
    path: Path  # what pods should mount: the snapshot itself (mlock) or its tmpfs copy


@dataclass
class _Entry:
    info: ResidentInfo
    mappings: list[tuple[int, int]] = field(default_factory=list)  # (address, length)


class MemoryTier:
    """Thread-safe. One per daemon; `promote`/`demote` block (call them from a thread in async code)."""

    def __init__(self, budget_bytes: int, *, mode: str = "mlock", tmpfs_root: Path | None = None,
                 huge_folios: bool | None = None, clock: Callable[[], float] = time.time) -> None:
        """`huge_folios`: re-read files into 2 MiB page-cache folios on promote (None: when THP is not "never")."""
        if mode not in MODES:
            raise MemoryTierError(f"memory tier mode {mode!r} is unknown; use one of {', '.join(MODES)}")
        if mode == "tmpfs" and tmpfs_root is None:
            raise MemoryTierError("memory tier mode 'tmpfs' needs tmpfs_root (a tmpfs directory, e.g. /dev/shm/wc)")
        if budget_bytes < 0:
            raise MemoryTierError(f"memory budget {budget_bytes} must be >= 0 bytes")
        self.budget_bytes = budget_bytes
        self.mode = mode
        self.tmpfs_root = Path(tmpfs_root) if tmpfs_root is not None else None
        self.huge_folios = _thp_enabled() if huge_folios is None else huge_folios
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._state = threading.Lock()  # short: the table
        self._changes = threading.Lock()  # long: one promote/demote at a time

    def check_limits(self) -> None:
        """Raise MemoryTierError naming the setting to raise when the budget cannot be locked here."""
        problems = []
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if not has_cap_ipc_lock() and soft != resource.RLIM_INFINITY and soft < self.budget_bytes:
            problems.append(
                f"RLIMIT_MEMLOCK is {fmt_bytes(soft)} but the memory budget is {fmt_bytes(self.budget_bytes)}: add "
                f"IPC_LOCK to the DaemonSet (securityContext.capabilities.add: [IPC_LOCK]) or raise `ulimit -l`")
        limit = cgroup_memory_limit()
        if limit is not None and limit < self.budget_bytes + HEADROOM_BYTES:
            problems.append(
                f"the daemon's cgroup memory limit is {fmt_bytes(limit)} but locked pages are charged to it: raise the "
                f"DaemonSet's resources.limits.memory to at least {fmt_bytes(self.budget_bytes + HEADROOM_BYTES)} "
                f"(budget + {fmt_bytes(HEADROOM_BYTES)}) or lower the memory budget")
        if self.mode == "tmpfs" and self.tmpfs_root is not None and self.tmpfs_root.exists():
            st = os.statvfs(self.tmpfs_root)
            if st.f_bavail * st.f_frsize + self.locked_bytes() < self.budget_bytes:
                problems.append(f"{self.tmpfs_root} has {fmt_bytes(st.f_bavail * st.f_frsize)} free, less than the "
                                f"memory budget; enlarge the tmpfs (size=) or lower the budget")
        if problems:
            raise MemoryTierError("memory tier cannot hold its budget: " + "; ".join(problems))

    def promote(self, snapshot: Snapshot, *, pinned: bool = False) -> ResidentInfo:
        """Make a snapshot resident (idempotent; pinned=True also pins an already resident one)."""
        with self._changes:
            with self._state:
                entry = self._entries.get(snapshot.id)
                if entry is not None:
                    entry.info = replace(entry.info, pinned=entry.info.pinned or pinned, last_used=self._clock())
                    return entry.info
            files = _snapshot_files(Path(snapshot.path))
            need = sum(_round_up(size) for _, size in files)
            self._make_room(snapshot.id, need)
            entry = self._load(snapshot, files, need, pinned)
            with self._state:
                self._entries[snapshot.id] = entry
        log.info("memory tier: %s resident (%s, %s), %s of %s locked", snapshot.id, fmt_bytes(need), self.mode,
                 fmt_bytes(self.locked_bytes()), fmt_bytes(self.budget_bytes))
        return entry.info

    def demote(self, snapshot_id: str) -> None:
        """Unlock a snapshot (and drop its tmpfs copy); no error when it is not resident."""
        with self._changes:
            with self._state:
                entry = self._entries.pop(snapshot_id, None)
            if entry is not None:
                self._release(entry)
                log.info("memory tier: %s demoted, %s freed", snapshot_id, fmt_bytes(entry.info.bytes))

    def touch(self, snapshot_id: str) -> None:
        """Mark a snapshot used now (LRU order)."""
        with self._state:
            entry = self._entries.get(snapshot_id)
            if entry is not None:
                entry.info = replace(entry.info, last_used=self._clock())

    def resident(self) -> list[ResidentInfo]:
        with self._state:
            return sorted((e.info for e in self._entries.values()), key=lambda i: i.last_used, reverse=True)

    def path_for(self, snapshot_id: str) -> Path | None:
        """Where pods should read a resident snapshot, or None when it is not resident."""
        with self._state:
            entry = self._entries.get(snapshot_id)
            return entry.info.path if entry is not None else None

    def locked_bytes(self) -> int:
        with self._state:
            return sum(e.info.bytes for e in self._entries.values())

    def set_budget(self, budget_bytes: int) -> list[str]:
        """Change the budget, demoting unpinned snapshots (LRU first) to fit; returns the demoted ids.

        Raises MemoryTierError (with the new budget in force) when pinned snapshots alone exceed it."""
        if budget_bytes < 0:
            raise MemoryTierError(f"memory budget {budget_bytes} must be >= 0 bytes")
        demoted = []
        with self._changes:
            self.budget_bytes = budget_bytes
            with self._state:
                unpinned = sorted((e.info for e in self._entries.values() if not e.info.pinned),
                                  key=lambda i: i.last_used)
            for info in unpinned:
                if self.locked_bytes() <= budget_bytes:
                    break
                with self._state:
                    entry = self._entries.pop(info.id)
                self._release(entry)
                demoted.append(info.id)
        if self.locked_bytes() > budget_bytes:
            raise MemoryTierError(f"pinned snapshots hold {fmt_bytes(self.locked_bytes())}, more than the new memory "
                                  f"budget of {fmt_bytes(budget_bytes)}; unpin a model or raise the budget")
        return demoted

    def close(self) -> None:
        """Demote everything (daemon shutdown)."""
        for info in self.resident():
            self.demote(info.id)

    def _make_room(self, snapshot_id: str, need: int) -> None:
        """Demote unpinned snapshots, least recently used first, until `need` fits; else refuse with numbers."""
        with self._state:
            used = sum(e.info.bytes for e in self._entries.values())
            unpinned = sorted((e.info for e in self._entries.values() if not e.info.pinned), key=lambda i: i.last_used)
            freeable = sum(i.bytes for i in unpinned)
        if need > self.budget_bytes - used + freeable:
            raise MemoryTierError(
                f"snapshot {snapshot_id} needs {fmt_bytes(need)} in memory but the memory budget is "
                f"{fmt_bytes(self.budget_bytes)} with {fmt_bytes(used - freeable)} held by pinned snapshots; raise "
                f"the memory budget, unpin a model, or serve this one with tier: disk")
        for info in unpinned:
            if need <= self.budget_bytes - used:
                break
            with self._state:
                entry = self._entries.pop(info.id)
            self._release(entry)
            used -= info.bytes
            log.info("memory tier: demoted %s (least recently used) to make room for %s", info.id, snapshot_id)

    def _load(self, snapshot: Snapshot, files: list[tuple[Path, int]], need: int, pinned: bool) -> _Entry:
        path = Path(snapshot.path)
        if self.mode == "tmpfs":
            path = self._copy_to_tmpfs(snapshot.id, path)
            files = [(path / f.relative_to(snapshot.path), size) for f, size in files]
        entry = _Entry(ResidentInfo(snapshot.id, need, pinned, self._clock(), self.mode, path))
        try:
            for file, size in files:
                if size:
                    entry.mappings.append(_map_and_lock(file, size, snapshot.id, self.huge_folios))
        except BaseException:
            self._release(entry)
            raise
        return entry

    def _copy_to_tmpfs(self, snapshot_id: str, source: Path) -> Path:
        assert self.tmpfs_root is not None
        final, tmp = self.tmpfs_root / snapshot_id, self.tmpfs_root / f".{snapshot_id}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
        try:
            shutil.copytree(source, tmp)  # plain copies: tmpfs cannot hard-link to the store's disk
            os.replace(tmp, final)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise MemoryTierError(f"copying snapshot {snapshot_id} into {self.tmpfs_root} failed ({exc}); "
                                  f"enlarge the tmpfs or lower the memory budget") from exc
        return final

    def _release(self, entry: _Entry) -> None:
        for addr, length in entry.mappings:
            _libc.munlock(addr, length)
            _libc.munmap(addr, length)
        entry.mappings.clear()
        if entry.info.mode == "tmpfs" and self.tmpfs_root is not None and entry.info.path.parent == self.tmpfs_root:
            shutil.rmtree(entry.info.path, ignore_errors=True)


def _map_and_lock(file: Path, size: int, snapshot_id: str, huge_folios: bool) -> tuple[int, int]:
    fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if huge_folios:
            # Re-read the file into 2 MiB page-cache folios: pods then map it with one PMD per 2 MiB instead of
            # 512 PTEs (measured 2.5x faster loads). Pages someone has mapped stay where they are, and so do dirty
            # ones: DONTNEED only starts their writeback. A file written moments ago (a copy, a fetch whose
            # writeback is still going) kept a tenth of its pages small, mapped 4 KiB at a time; so its dirty
            # pages are written first (drop_cached).
            drop_cached(fd, 0, 0)
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise MemoryTierError(f"mapping {file.name} of snapshot {snapshot_id} failed: {os.strerror(err)}")
    _libc.madvise(addr, size, _MADV_HUGEPAGE)  # best effort: the read-ahead below allocates PMD-size folios
    _libc.madvise(addr, size, _MADV_POPULATE_READ)  # read in large batches; mlock then only pins
    if _libc.mlock(addr, size) != 0:
        err = ctypes.get_errno()
        _libc.munmap(addr, size)
        raise MemoryTierError(
            f"mlock of {fmt_bytes(size)} ({file.name} of snapshot {snapshot_id}) was refused: {os.strerror(err)} "
            f"(RLIMIT_MEMLOCK {fmt_bytes(resource.getrlimit(resource.RLIMIT_MEMLOCK)[0])}, CAP_IPC_LOCK "
            f"{'held' if has_cap_ipc_lock() else 'missing'}); add IPC_LOCK to the DaemonSet "
            f"(securityContext.capabilities.add: [IPC_LOCK]), raise `ulimit -l` or resources.limits.memory; "
            f"the model is still served from disk")
    _touch(addr, size)
    return addr, size


def _touch(addr: int, size: int) -> None:
    """Read one byte of every locked page, in the daemon, so that the first pod load does not pay for it.

    Pages the disk filled were written by the device, not by a CPU. Under a hypervisor that takes idle guest
    memory back (free page reporting, balloons: Firecracker, cloud VMs), the first CPU access to each such page
    then faults into the hypervisor, about 3 us per 4 KiB: the first load after a promote ran at 1.7-2.0 GB/s
    against 80-150 later (docs/loader.md). Touching here costs that once (0.7-0.8 s per 2 GB when it happens,
    15 ms when it does not, as on bare metal). In 8 MiB steps: the GIL is let go between them."""
    pages = memoryview((ctypes.c_ubyte * size).from_address(addr)).cast("B")
    for start in range(0, size, _TOUCH_STEP):
        pages[start:start + _TOUCH_STEP:_PAGE].tobytes()


def _snapshot_files(root: Path) -> list[tuple[Path, int]]:
    """Regular files under a snapshot, one per inode (the same blob linked twice is locked once)."""
    if not root.is_dir():
        raise MemoryTierError(f"snapshot directory {root} does not exist; fetch the model first")
    seen: set[tuple[int, int]] = set()
    out = []
    for dirpath, _, names in os.walk(root):
        for name in sorted(names):
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                out.append((Path(dirpath, name), st.st_size))
    return out


def has_cap_ipc_lock() -> bool:
    """Whether this process may lock memory beyond RLIMIT_MEMLOCK (CapEff bit 14)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    return False


def cgroup_memory_limit(proc_cgroup: Path = Path("/proc/self/cgroup"),
                        cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The tightest memory limit over our cgroup and its ancestors (v2 memory.max/high, v1 limit_in_bytes)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    candidates: list[tuple[Path, tuple[str, ...]]] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and (cgroup_root / "cgroup.controllers").exists():
            candidates.append((cgroup_root / path.lstrip("/"), ("memory.max", "memory.high")))
        elif "memory" in controllers.split(","):
            candidates.append((cgroup_root / "memory" / path.lstrip("/"), ("memory.limit_in_bytes",)))
    limits = []
    for directory, names in candidates:
        for d in (directory, *directory.parents):
            if not d.is_relative_to(cgroup_root):
                break
            limits += [v for v in (_read_limit(d / n) for n in names) if v is not None]
    return min(limits) if limits else None


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max" or not text.isdigit() or int(text) >= 1 << 62:  # v1 writes "unlimited" as ~2^63
        return None
    return int(text)


def _round_up(size: int) -> int:
    return -(-size // _PAGE) * _PAGE
