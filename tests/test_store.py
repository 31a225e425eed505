"""The store on real files: layout, dedup, leases, pins, eviction order, crash recovery at every publish step."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.grants import granted
from tests.sample import make_model
from weightcache.errors import HostileKeyError, InsufficientSpaceError, InUseError
from weightcache.fetch import Fetcher
from weightcache.store import Store, collect_garbage, recovery, validate_relpath, validate_tree, verify_snapshot
from weightcache.uri import parse_ref


@pytest.fixture
def models(tmp_path: Path) -> Path:
    make_model(tmp_path / "src" / "a", layers=1, hidden=64, seed=1)
    make_model(tmp_path / "src" / "b", layers=1, hidden=64, seed=2)
    return tmp_path / "src"


def fetch(store: Store, path: Path, **kw: object):
    return Fetcher(store, chunk_size=64 << 10).ensure(granted(f"file://{path}/", **kw))


def test_layout_modes_and_hard_links(tmp_path: Path, models: Path) -> None:
    store = Store(tmp_path / "root")
    snap = fetch(store, models / "a")
    assert snap.path == store.root / "snapshots" / snap.id
    assert (store.root / "manifests" / f"{snap.id}.json").exists()
    for f in snap.files:
        p = snap.path / f.path
        blob = store.layout.blob(f.sha256)
        assert os.path.samefile(p, blob), "snapshot files must be hard links to blobs, not copies or symlinks"
        assert not p.is_symlink()
        assert stat.S_IMODE(blob.stat().st_mode) == 0o444
        assert p.read_bytes() == (models / "a" / f.path).read_bytes()
    assert stat.S_IMODE(snap.path.stat().st_mode) == 0o555


def test_same_content_in_two_models_is_stored_once(tmp_path: Path, models: Path) -> None:
    (models / "a2").mkdir()
    for p in (models / "a").iterdir():
        (models / "a2" / p.name).write_bytes(p.read_bytes())
    (models / "a2" / "config.json").write_text('{"changed": true}\n')
    store = Store(tmp_path / "root")
    s1 = fetch(store, models / "a")
    s2 = fetch(store, models / "a2")
    assert s1.id != s2.id
    blobs = [p for p in store.layout.blobs.rglob("*") if p.is_file()]
    assert len(blobs) == len({f.sha256 for f in (*s1.files, *s2.files)}) == len(s1.files) + 1
    assert store.used_bytes() == sum(p.stat().st_size for p in blobs)


def test_cache_hit_touches_last_used(tmp_path: Path, models: Path) -> None:
    store = Store(tmp_path / "root")
    snap = fetch(store, models / "a")
    before = {i.snapshot.id: i.last_used for i in store.list()}[snap.id]
    again = fetch(store, models / "a")
    assert again.id == snap.id
    assert {i.snapshot.id: i.last_used for i in store.list()}[snap.id] >= before


def test_leased_or_pinned_snapshot_is_never_evicted(tmp_path: Path, models: Path) -> None:
    store = Store(tmp_path / "root")
    a = fetch(store, models / "a")
    b = fetch(store, models / "b")
    store.lease("csi:vol-1", a.id)
    store.pin(b.id)
    with pytest.raises(InUseError, match="csi:vol-1"):
        store.evict(a.id)
    with pytest.raises(InUseError, match="pinned by user"):
        store.evict(b.id)
    with pytest.raises(InsufficientSpaceError, match="pinned or leased"):
        store.evict_to(0)
    assert {i.snapshot.id for i in store.list()} == {a.id, b.id}
    assert all((s.path / f.path).exists() for s in (a, b) for f in s.files)
    store.release("csi:vol-1")
    assert store.evict_to(store.used_bytes() - 1) == [a.id]  # b is still pinned
    assert [i.snapshot.id for i in store.list()] == [b.id]


def test_lru_eviction_order_refs_then_snapshots_then_blobs(tmp_path: Path, models: Path) -> None:
    store = Store(tmp_path / "root")
    a = fetch(store, models / "a")
    b = fetch(store, models / "b")
    store.index.touch(a.id, 1000.0)  # a is the least recently used
    evicted = store.evict_to(store.used_bytes() - 1)
    assert evicted == [a.id]
    assert not a.path.exists() and not store.layout.manifest(a.id).exists()
    assert not any(store.layout.blob(f.sha256).exists() for f in a.files if f.sha256 not in {g.sha256 for g in b.files})
    assert store.lookup(parse_ref(f"file://{models / 'a'}/")) is None
    assert store.lookup(parse_ref(f"file://{models / 'b'}/")).id == b.id


def test_fetch_that_cannot_fit_fails_before_downloading(tmp_path: Path, models: Path) -> None:
    store = Store(tmp_path / "root", budget_bytes=1000)
    with pytest.raises(InsufficientSpaceError, match=r"needs .* budget of 1000 B"):
        fetch(store, models / "a")
    assert list(store.layout.partial.iterdir()) == []
    assert store.list() == []


def test_budget_evicts_lru_to_make_room(tmp_path: Path, models: Path) -> None:
    probe = Store(tmp_path / "probe")
    size = fetch(probe, models / "a").size
    store = Store(tmp_path / "root", budget_bytes=int(size * 1.5))
    a = fetch(store, models / "a")
    b = fetch(store, models / "b")
    assert [i.snapshot.id for i in store.list()] == [b.id]
    assert not a.path.exists()


@pytest.mark.parametrize("key", ["../x", "/abs", "a/../../b", "a/./b", "a//b", "nul\0byte", "x" * 256 + "/f",
                                 "dir\\file", ""])
def test_hostile_keys_are_refused_by_name(key: str) -> None:
    with pytest.raises(HostileKeyError) as err:
        validate_relpath(key)
    assert repr(key)[:40].strip("'") in str(err.value) or key == ""


def test_key_that_is_file_and_directory_is_refused() -> None:
    with pytest.raises(HostileKeyError, match=r"'a/b'.*both a file and a directory"):
        validate_tree(["a/b", "a/b/c.safetensors"])
    assert validate_tree(["b", "a/c"]) == ["a/c", "b"]


# Each publish step is a Store method; the child process replaces the step with an exit, as a power cut would.
CRASH_BEFORE = {"tree_built": "_commit_tree", "tree_renamed": "_write_manifest", "manifest_written": "_index_snapshot",
                "indexed": "_write_ref"}


@pytest.mark.parametrize("point", sorted(CRASH_BEFORE))
def test_crash_at_each_publish_step_recovers(tmp_path: Path, models: Path, point: str) -> None:
    root = tmp_path / "root"
    code = ("import os, sys; from weightcache.store import Store; from weightcache.fetch import Fetcher; "
            "from weightcache.uri import parse_ref; "
            "setattr(Store, sys.argv[3], lambda *a, **k: os._exit(137)); "
            "from tests.grants import granted; Fetcher(Store(sys.argv[1])).ensure(granted(sys.argv[2]))")
    ref = f"file://{models / 'a'}/"
    proc = subprocess.run([sys.executable, "-c", code, str(root), ref, CRASH_BEFORE[point]],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 137, proc.stderr
    store = Store(root)  # recovery runs here
    leftovers = [p.name for p in store.layout.snapshots.iterdir()]
    complete = [p for p in leftovers if store.layout.manifest(p).exists()]
    assert leftovers == complete, "an incomplete snapshot tree survived recovery"
    snap = Fetcher(store).ensure(granted(ref))
    assert verify_snapshot(store, snap.id) == []
    assert [i.snapshot.id for i in store.list()] == [snap.id]
    assert not any(p.name.startswith(".tmp-") for p in store.root.rglob("*"))


def test_recovery_never_removes_a_whole_snapshot_and_rebuilds_a_lost_index(tmp_path: Path, models: Path) -> None:
    store = Store(tmp_path / "root")
    snap = fetch(store, models / "a")
    store.lease("csi:vol-9", snap.id)
    store.close()
    for suffix in ("", "-wal", "-shm"):
        Path(str(store.layout.index) + suffix).unlink(missing_ok=True)
    again = Store(tmp_path / "root")
    assert [i.snapshot.id for i in again.list()] == [snap.id]
    assert again.leases() == {"csi:vol-9": snap.id}
    assert again.lookup(parse_ref(f"file://{models / 'a'}/")).id == snap.id


def test_damaged_index_is_moved_aside_and_rebuilt(tmp_path: Path, models: Path) -> None:
    store = Store(tmp_path / "root")
    snap = fetch(store, models / "a")
    store.close()
    for suffix in ("-wal", "-shm"):
        Path(str(store.layout.index) + suffix).unlink(missing_ok=True)
    store.layout.index.write_bytes(b"this is not a database" * 100)
    again = Store(tmp_path / "root")
    assert [i.snapshot.id for i in again.list()] == [snap.id]
    assert list((tmp_path / "root" / "quarantine").glob("index.db.*"))


def test_verify_detects_a_flipped_byte_and_gc_removes_orphans(tmp_path: Path, models: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(tmp_path / "root")
    snap = fetch(store, models / "a")
    victim = snap.path / snap.files[0].path
    os.chmod(victim, 0o644)
    with open(victim, "r+b") as fh:
        fh.seek(3)
        b = fh.read(1)
        fh.seek(3)
        fh.write(bytes([b[0] ^ 0xFF]))
    assert verify_snapshot(store, snap.id) == [snap.files[0].path]
    orphan = store.layout.blob("ab" * 32)
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"x" * 10)
    assert collect_garbage(store) == 0 and orphan.exists()  # young: maybe a fetch's, not yet published
    monkeypatch.setattr(recovery, "ORPHAN_BLOB_GRACE_S", -1.0)
    assert collect_garbage(store) >= 10
    assert not orphan.exists()
    assert all(store.layout.blob(f.sha256).exists() for f in snap.files)
