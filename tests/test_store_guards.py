"""Guards that had no test: each test here fails when its guard is removed.

The eviction planner skips leased snapshots (and evicts the next one), a cache hit moves a snapshot to the end of
the LRU order, a lease on an evicted snapshot is refused, the store lock is re-entrant, and an eviction
interrupted after its commit is finished by the next start.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.fixtures_store import fetch, make_models
from weightcache.errors import NotCachedError
from weightcache.store import Snapshot, SnapshotInfo, Store
from weightcache.store.evict import plan_eviction


@pytest.fixture
def three(tmp_path: Path) -> tuple[Store, list[Snapshot], dict[str, Path]]:
    models = make_models(tmp_path / "src", "a", "b", "c")
    store = Store(tmp_path / "root")
    snaps = [fetch(store, models[n]) for n in "abc"]
    for when, snap in enumerate(snaps, start=1):
        store.index.touch(snap.id, 1000.0 * when)  # a oldest, c newest
    return store, snaps, models


def test_oldest_leased_means_the_next_one_is_evicted(three: tuple[Store, list[Snapshot], dict[str, Path]]) -> None:
    store, (a, b, c), _ = three
    store.lease("csi:vol-1", a.id)
    store.index.touch(a.id, 1.0)  # still the oldest after the lease touched it
    assert store.evict_to(store.used_bytes() - 1) == [b.id]
    assert {i.snapshot.id for i in store.list()} == {a.id, c.id}


def test_planner_alone_skips_leased_and_pinned() -> None:
    def info(name: str, last_used: float, *, leased: bool = False, pinned: bool = False) -> SnapshotInfo:
        from weightcache.store import FileEntry

        snap = Snapshot(name, Path("/x"), "s3://b/" + name, None, 100,
                        (FileEntry("w", 100, name[0] * 64),))
        return SnapshotInfo(snap, (), last_used, pinned, ("h",) if leased else (), 100)

    infos = [info("a", 1, leased=True), info("b", 2, pinned=True), info("c", 3), info("d", 4)]
    assert plan_eviction(infos, used_bytes=400, target_bytes=300) == ["c"]


def test_a_cache_hit_moves_the_snapshot_to_the_end_of_the_lru_order(
        three: tuple[Store, list[Snapshot], dict[str, Path]]) -> None:
    store, (a, b, _), models = three
    assert fetch(store, models["a"]).id == a.id  # a cache hit on the oldest
    assert store.evict_to(store.used_bytes() - 1) == [b.id]


def test_a_lease_on_an_evicted_snapshot_is_refused(three: tuple[Store, list[Snapshot], dict[str, Path]]) -> None:
    store, (a, b, _), _ = three
    store.evict(a.id)
    with pytest.raises(NotCachedError, match="evicted"):
        store.lease("csi:vol-1", a.id)
    assert store.leases() == {}
    # committed but unfinished (a crash between the manifest's move and the deletes): refused as well
    store.tree.rename(store.layout.manifest(b.id), store.layout.eviction(b.id))
    with pytest.raises(NotCachedError):
        store.lease("csi:vol-2", b.id)


def _other_process_can_lock(lock: Path) -> bool:
    code = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
            "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)")
    return subprocess.run([sys.executable, "-c", code, str(lock)], capture_output=True).returncode == 0


def test_store_lock_is_reentrant_and_still_excludes_other_processes(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    lock = store.layout.lock("store")
    done = threading.Event()
    seen: list[bool] = []

    def nested() -> None:
        with store.locked():
            with store.locked():
                seen.append(_other_process_can_lock(lock))
            seen.append(_other_process_can_lock(lock))  # the inner exit must not drop the outer hold
        done.set()

    worker = threading.Thread(target=nested, daemon=True)
    worker.start()
    assert done.wait(60), "a nested store.locked() deadlocked"
    assert seen == [False, False]
    assert _other_process_can_lock(lock)


def test_store_lock_still_serialises_threads(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    inside, release = threading.Event(), threading.Event()
    entered: list[str] = []

    def holder() -> None:
        with store.locked():
            inside.set()
            release.wait(30)
            entered.append("holder-out")

    def other() -> None:
        inside.wait(30)
        with store.locked():
            entered.append("other-in")

    threads = [threading.Thread(target=holder), threading.Thread(target=other)]
    for t in threads:
        t.start()
    assert inside.wait(30)
    release.set()
    for t in threads:
        t.join(30)
    assert entered == ["holder-out", "other-in"]


@pytest.mark.parametrize("step", ["finish_eviction", "unlink_if_single_link"])
def test_eviction_interrupted_after_its_commit_is_finished_at_start(tmp_path: Path, step: str) -> None:
    models = make_models(tmp_path / "src", "a", "b")
    root = tmp_path / "root"
    store = Store(root)
    a, b = fetch(store, models["a"]), fetch(store, models["b"])
    store.close()
    owner = "Store" if step == "finish_eviction" else "Tree"
    code = ("import os, sys; from weightcache.store.store import Store; from weightcache.store.fsops import Tree; "
            f"setattr({owner}, sys.argv[3], lambda *a, **k: os._exit(137)); Store(sys.argv[1]).evict(sys.argv[2])")
    proc = subprocess.run([sys.executable, "-c", code, str(root), a.id, step], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 137, proc.stderr
    assert not store.layout.manifest(a.id).exists() and store.layout.eviction(a.id).exists()
    again = Store(root)
    assert [i.snapshot.id for i in again.list()] == [b.id]
    assert not a.path.exists() and list(again.layout.evicting.iterdir()) == []
    b_blobs = {f.sha256 for f in b.files}
    assert not any(again.layout.blob(f.sha256).exists() for f in a.files if f.sha256 not in b_blobs)
    assert again.index.query("SELECT COUNT(*) FROM files WHERE snapshot_id=?", (a.id,)) == [(0,)]
    with pytest.raises(NotCachedError):
        again.lease("csi:vol-1", a.id)


def test_lock_files_are_flock_compatible_with_other_processes(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    fd = store.open_lock("mkey")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert not _other_process_can_lock(store.layout.lock("mkey"))
    finally:
        os.close(fd)


def test_evicting_a_snapshot_keeps_the_blobs_another_one_shares(tmp_path: Path) -> None:
    from weightcache.store import verify_snapshot

    models = make_models(tmp_path / "src", "a")
    copy = tmp_path / "src" / "a2"
    copy.mkdir()
    for p in models["a"].iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    (copy / "extra.json").write_text("{}")
    store = Store(tmp_path / "root")
    a, a2 = fetch(store, models["a"]), fetch(store, copy)
    store.evict(a.id)
    assert verify_snapshot(store, a2.id) == []
    assert all(store.layout.blob(f.sha256).exists() for f in a2.files)
