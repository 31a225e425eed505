"""The memory tier really locks pages (VmLck), keeps to its budget, and refuses clearly when the kernel says no."""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import resource
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.sample import make_model
from weightcache.errors import MemoryTierError
from weightcache.loader import load_state_dict
from weightcache.memory import MemoryTier, cgroup_memory_limit, has_cap_ipc_lock
from weightcache.store.types import Snapshot

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
can_lock = pytest.mark.skipif(
    not has_cap_ipc_lock() and resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] < 256 * MiB,
    reason="needs CAP_IPC_LOCK or RLIMIT_MEMLOCK >= 256 MiB")
root = pytest.mark.root


def vmlck() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmLck:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmLck in /proc/self/status")


@pytest.fixture
def snapshot(tmp_path: Path) -> Callable[[str], Snapshot]:
    def make(name: str, *, layers: int = 1) -> Snapshot:
        path = tmp_path / "snapshots" / name
        files = make_model(path, layers=layers, hidden=64, vocab=256, shards=2, seed=len(name))
        return Snapshot(id=name, path=path, uri=f"s3://models/{name}/", revision=None,
                        size=sum(f.stat().st_size for f in files))
    return make


@pytest.fixture
def clock() -> Callable[[], float]:
    ticks = itertools.count(1000)
    return lambda: float(next(ticks))


@pytest.fixture
def tiers() -> Iterator[list[MemoryTier]]:
    made: list[MemoryTier] = []
    yield made
    for tier in made:
        tier.close()


def pages(snap: Snapshot) -> int:
    return sum(-(-f.stat().st_size // 4096) * 4096 for f in Path(snap.path).iterdir())


@can_lock
@pytest.mark.parametrize("huge_folios", [True, False])
def test_promote_locks_the_snapshot_pages_and_demote_releases_them(snapshot, tiers, huge_folios: bool) -> None:
    tier = MemoryTier(64 * MiB, huge_folios=huge_folios)
    tiers.append(tier)
    snap = snapshot("a")
    before = vmlck()
    info = tier.promote(snap)
    assert (info.id, info.bytes, info.mode, info.path, info.pinned) == ("a", pages(snap), "mlock", snap.path, False)
    assert vmlck() - before == pages(snap) == tier.locked_bytes()
    assert tier.promote(snap, pinned=True).pinned and vmlck() - before == pages(snap), "idempotent"
    assert tier.path_for("a") == snap.path and [i.id for i in tier.resident()] == ["a"]
    tier.demote("a")
    tier.demote("a")
    assert vmlck() == before and tier.locked_bytes() == 0 and tier.resident() == [] and tier.path_for("a") is None


@can_lock
def test_hard_linked_files_are_locked_once(snapshot, tiers) -> None:
    snap = snapshot("a")
    first = sorted(Path(snap.path).glob("*.safetensors"))[0]
    os.link(first, Path(snap.path) / "same-blob.safetensors")
    tier = MemoryTier(64 * MiB)
    tiers.append(tier)
    assert tier.promote(snap).bytes == sum(-(-f.stat().st_size // 4096) * 4096 for f in Path(snap.path).iterdir()
                                           if f.name != "same-blob.safetensors")


@can_lock
def test_lru_demotion_keeps_within_budget(snapshot, tiers, clock) -> None:
    a, b, c = snapshot("a"), snapshot("b"), snapshot("c")
    tier = MemoryTier(pages(a) + pages(b) + pages(c) // 2, clock=clock)
    tiers.append(tier)
    before = vmlck()
    tier.promote(a)
    tier.promote(b)
    tier.touch("a")  # now b is least recently used
    tier.promote(c)
    assert sorted(i.id for i in tier.resident()) == ["a", "c"]
    assert tier.locked_bytes() <= tier.budget_bytes
    assert vmlck() - before == tier.locked_bytes() == pages(a) + pages(c)


@can_lock
def test_lowering_the_budget_demotes_lru_and_refuses_below_pinned(snapshot, tiers, clock) -> None:
    a, b, c = snapshot("a"), snapshot("b"), snapshot("c")
    tier = MemoryTier(64 * MiB, clock=clock)
    tiers.append(tier)
    tier.promote(a, pinned=True)
    tier.promote(b)
    tier.promote(c)
    assert tier.set_budget(pages(a) + pages(c)) == ["b"]
    assert sorted(i.id for i in tier.resident()) == ["a", "c"]
    with pytest.raises(MemoryTierError, match=r"pinned snapshots hold .* more than the new memory budget"):
        tier.set_budget(pages(a) // 2)
    assert [i.id for i in tier.resident()] == ["a"] and tier.budget_bytes == pages(a) // 2


@can_lock
def test_pinned_snapshots_are_never_demoted_and_refusal_has_numbers(snapshot, tiers) -> None:
    a, b = snapshot("a"), snapshot("b")
    tier = MemoryTier(pages(a) + pages(b) // 2)
    tiers.append(tier)
    tier.promote(a, pinned=True)
    before = vmlck()
    kib = pages(a) // 1024, tier.budget_bytes // 1024
    with pytest.raises(MemoryTierError, match=rf"snapshot b needs {kib[0]} KiB .* budget is {kib[1]} KiB with "
                                              rf"{kib[0]} KiB held by pinned"):
        tier.promote(b)
    assert [i.id for i in tier.resident()] == ["a"] and vmlck() == before
    tier.demote("a")  # what the daemon does when a model leaves the memory tier
    tier.promote(b)
    assert [i.id for i in tier.resident()] == ["b"]


def test_a_model_larger_than_the_budget_is_refused(snapshot) -> None:
    tier = MemoryTier(4096)
    with pytest.raises(MemoryTierError, match=r"raise the memory budget.*tier: disk"):
        tier.promote(snapshot("a"))
    assert tier.locked_bytes() == 0


def test_bad_arguments_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(MemoryTierError, match="use one of mlock, tmpfs"):
        MemoryTier(MiB, mode="swap")
    with pytest.raises(MemoryTierError, match="needs tmpfs_root"):
        MemoryTier(MiB, mode="tmpfs")
    with pytest.raises(MemoryTierError, match="fetch the model first"):
        MemoryTier(MiB).promote(Snapshot("x", tmp_path / "missing", "s3://m/x/", None, 0))


@can_lock
def test_tmpfs_mode_serves_a_locked_copy(snapshot, tiers, tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    tmpfs_root = base / f"weightcache-test-{uuid.uuid4().hex[:8]}"
    tmpfs_root.mkdir()
    try:
        tier = MemoryTier(64 * MiB, mode="tmpfs", tmpfs_root=tmpfs_root)
        tiers.append(tier)
        snap = snapshot("a")
        before = vmlck()
        copy = tier.promote(snap).path
        assert copy == tmpfs_root / "a" and tier.path_for("a") == copy
        for f in Path(snap.path).iterdir():
            assert (copy / f.name).read_bytes() == f.read_bytes()
        assert vmlck() - before == pages(snap)
        tier.demote("a")
        assert not copy.exists() and vmlck() == before
    finally:
        for p in sorted(tmpfs_root.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        tmpfs_root.rmdir()


def test_cgroup_limit_is_read_from_v1_and_v2_layouts(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    (v2 / "kubepods" / "pod1").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("cpu memory\n")
    (v2 / "kubepods" / "memory.max").write_text("2147483648\n")
    (v2 / "kubepods" / "pod1" / "memory.max").write_text("max\n")
    (v2 / "kubepods" / "pod1" / "memory.high").write_text("1073741824\n")
    (tmp_path / "cg2").write_text("0::/kubepods/pod1\n")
    assert cgroup_memory_limit(tmp_path / "cg2", v2) == 1 << 30
    v1 = tmp_path / "v1"
    (v1 / "memory" / "pod2").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory" / "pod2" / "memory.limit_in_bytes").write_text("536870912\n")
    (tmp_path / "cg1").write_text("5:cpu:/\n4:memory:/pod2\n0::/\n")
    assert cgroup_memory_limit(tmp_path / "cg1", v1) == 512 * MiB
    (tmp_path / "cg0").write_text("4:memory:/\n")
    assert cgroup_memory_limit(tmp_path / "cg0", v1) is None


CHILD = textwrap.dedent("""
    import resource, sys
    from pathlib import Path
    from weightcache.errors import MemoryTierError
    from weightcache.memory import MemoryTier, has_cap_ipc_lock
    from weightcache.store.types import Snapshot
    snap = Snapshot("big", Path(sys.argv[1]), "s3://m/big/", None, 0)
    tier = MemoryTier(int(sys.argv[2]))
    for step in (tier.check_limits, lambda: tier.promote(snap)):
        try:
            step()
            print("OK")
        except MemoryTierError as exc:
            print("REFUSED", exc)
    vmlck = [l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmLck")][0]
    print("STATE", has_cap_ipc_lock(), tier.locked_bytes(), tier.resident(), vmlck.split()[1])
    from weightcache.loader import load_state_dict
    print("LOADED", len(load_state_dict(snap.path)))
""")


def _without_ipc_lock(memlock: int) -> None:
    """preexec: drop IPC_LOCK from the bounding set (root then gets no IPC_LOCK after exec) and lower memlock."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(24, 14, 0, 0, 0) != 0:  # PR_CAPBSET_DROP, CAP_IPC_LOCK
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (memlock, memlock))


def run_child(snap: Snapshot, budget: int, preexec: Callable[[], None]) -> str:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(snap.path), str(budget)], cwd=ROOT, text=True,
                          capture_output=True, preexec_fn=preexec, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (drops a capability)")
def test_mlock_refused_gives_a_clear_message_and_disk_service_continues(snapshot) -> None:
    snap = snapshot("big")
    out = run_child(snap, 64 * MiB, lambda: _without_ipc_lock(64 * 1024)).splitlines()
    assert out[0].startswith("REFUSED") and "RLIMIT_MEMLOCK is 64 KiB" in out[0]
    assert "capabilities.add: [IPC_LOCK]" in out[0] and "ulimit -l" in out[0]
    assert out[1].startswith("REFUSED mlock of") and "was refused" in out[1] and "still served from disk" in out[1]
    assert out[2] == "STATE False 0 [] 0", "nothing stays locked after a refusal"
    assert out[3] == f"LOADED {len(load_state_dict(snap.path))}"


def _own_memory_cgroup() -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    return None


@root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (creates a cgroup)")
def test_cgroup_memory_limit_below_budget_names_the_daemonset_setting(snapshot) -> None:
    parent = _own_memory_cgroup()
    if parent is None or not (parent / "memory.limit_in_bytes").exists():
        pytest.skip("no writable cgroup v1 memory controller here")
    group = parent / f"weightcache-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(512 * MiB))
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup: {exc}")
    try:
        def enter() -> None:
            (group / "cgroup.procs").write_text(str(os.getpid()))
        out = run_child(snapshot("big"), 1 << 30, enter).splitlines()
    finally:
        group.rmdir()
    assert out[0].startswith("REFUSED") and "cgroup memory limit is 512 MiB" in out[0]
    assert "resources.limits.memory to at least 1.25 GiB" in out[0]



POD_LOAD = textwrap.dedent("""
    import resource, sys
    import torch
    from weightcache.loader import iter_tensors

    def anon():
        return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("RssAnon:")) * 1024

    before, faults, total = anon(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt, 0
    for _, t in iter_tensors(sys.argv[1]):
        int(t.reshape(-1).view(torch.uint8)[::4096].sum())  # one byte of every page, as a load reads them all
        total += t.numel() * t.element_size()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults, anon() - before, total)
""")


def _pmd_mapped(addr: int) -> int:
    """FilePmdMapped bytes of this process's mapping that starts at `addr` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "-" in line.split()[0] and
                 int(line.split("-", 1)[0], 16) == addr)
    return next(int(line.split()[1]) for line in lines[start + 1:] if line.startswith("FilePmdMapped:")) * 1024


def _can_build_2mib_folios(directory: Path) -> bool:
    """Whether this kernel and filesystem give a file read through a MADV_HUGEPAGE mapping 2 MiB page-cache folios
    (ext4 and xfs on current kernels, THP not "never"): asked with Python's own mmap, not the code under test."""
    probe = directory / "probe"
    probe.write_bytes(os.urandom(4 * MiB))
    os.sync()
    with open(probe, "rb") as fh:
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
        head = ctypes.c_char.from_buffer(mm)
        addr = ctypes.addressof(head)
        del head
        mm[::4096]
        return _pmd_mapped(addr) > 0
    finally:
        mm.close()
        probe.unlink()


@can_lock
def test_a_pod_maps_promoted_pages_2mib_at_a_time_and_copies_none(tmp_path: Path, tiers) -> None:
    """A pod's load from a promoted model costs one page fault per 2 MiB and no copy: promote re-reads the files
    into 2 MiB folios and the loader maps them copy-on-write. Measured (scripts/bench_load.py, memory-tier rows):
    a 1.98 GB model took 944-990 faults in both weightcache.loader and safetensors.load_file, against about
    30,000 (one per 16 pages: fault-around) from 4 KiB folios, the same CPU in both (docs/loader.md)."""
    if not _can_build_2mib_folios(tmp_path):
        pytest.skip("this kernel or filesystem builds no 2 MiB page-cache folios (or THP is never)")
    path = tmp_path / "model"
    make_model(path, layers=1, hidden=2048, vocab=8192, shards=1)
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size > 64 * MiB
    tier = MemoryTier(size + 64 * MiB, huge_folios=True)
    tiers.append(tier)
    tier.promote(Snapshot(id="m", path=path, uri="s3://models/m/", revision=None, size=size))
    (addr, length), = [m for m in tier._entries["m"].mappings if m[1] > 64 * MiB]
    assert _pmd_mapped(addr) >= length - 4 * MiB, "promote left the weights in small folios"

    out = subprocess.run([sys.executable, "-c", POD_LOAD, str(path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    faults, anon, loaded = map(int, out.stdout.split())
    assert loaded > 64 * MiB
    assert faults < loaded // (2 * MiB) + 200, f"{faults} page faults for {loaded >> 20} MiB: mapped 4 KiB at a time"
    assert anon < loaded // 8, f"the load copied: anonymous memory grew by {anon >> 20} MiB"
