"""Each check of weightcache/store/paths.py refuses its own case, by name, with the reason it gives: written for the
checks that a mutation run (one guard removed at a time, the store tests run) showed no test protected."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from weightcache.errors import HostileKeyError, NotCachedError
from weightcache.store import Store, collect_garbage, fsops, validate_relpath, validate_tree
from weightcache.store.fsops import _read_all
from weightcache.store.paths import MAX_DEPTH, MAX_FILES, MAX_NAME_BYTES, MAX_PATH_BYTES


@pytest.mark.parametrize(("key", "reason"), [
    ("", "empty path"),
    ("a\nb", "control character"),
    ("a\x1b[31mred", "control character"),
    ("tab\there", "control character"),
    ("/".join(["d"] * MAX_DEPTH) + "/f", f"more than {MAX_DEPTH} directories deep"),
    ("/".join(["x" * 200] * 16), f"path longer than {MAX_PATH_BYTES} bytes"),
    ("n" * (MAX_NAME_BYTES + 1), f"longer than {MAX_NAME_BYTES} bytes"),
    (os.fsdecode(b"bad\xff.bin"), "not valid UTF-8"),  # a local file's name in raw bytes (it raised UnicodeEncodeError)
])
def test_each_path_check_names_its_reason(key: str, reason: str) -> None:
    with pytest.raises(HostileKeyError) as caught:
        validate_relpath(key)
    assert reason in str(caught.value)


@pytest.mark.parametrize("key", [
    "/".join(["d"] * (MAX_DEPTH - 1)) + "/f",  # exactly at the depth limit
    "/".join(["x" * 200] * 15),  # under the path length limit
    "é" * (MAX_NAME_BYTES // 2),  # bytes, not characters, are counted
    "model-00001-of-00002.safetensors",
])
def test_keys_at_the_limits_pass(key: str) -> None:
    assert validate_relpath(key) == key


def test_too_many_files_is_refused_naming_the_fix() -> None:
    keys = [f"f{i}" for i in range(MAX_FILES + 1)]
    with pytest.raises(HostileKeyError) as caught:
        validate_tree(keys)
    assert f"more than {MAX_FILES}" in str(caught.value) and "--include" in str(caught.value)
    assert len(validate_tree(keys[:MAX_FILES])) == MAX_FILES


# ---- Tree (weightcache/store/fsops.py) ----

def test_a_path_that_climbs_out_of_the_root_is_refused(tmp_path: Path) -> None:
    """'..' is no symlink, so O_NOFOLLOW would not stop it: Tree refuses it before any open."""
    store = Store(tmp_path / "root")
    victim = tmp_path / "victim"
    victim.write_text("outside")
    for op in (store.tree.unlink, store.tree.lstat, store.tree.remove_tree):
        with pytest.raises(ValueError, match="not a path inside the store"):
            op(store.root / ".." / "victim")
    assert victim.read_text() == "outside"


def test_a_record_over_its_limit_or_not_a_file_is_quarantined_not_read(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    big = store.layout.refs / "big.json"
    big.write_bytes(b"{" + b" " * 100 + b"}")
    assert store.tree.read(big, limit=10) is None
    fifo = store.layout.refs / "fifo.json"
    os.mkfifo(fifo)
    assert store.tree.read(fifo, limit=1 << 20) is None  # never blocks on, or reads, a pipe
    assert not big.exists() and not fifo.exists()
    moved = sorted(os.listdir(store.layout.quarantine))
    assert [m.rpartition(".")[0] for m in moved] == ["refs%2Fbig.json", "refs%2Ffifo.json"]


def test_a_record_that_grows_while_read_stops_at_its_limit(tmp_path: Path) -> None:
    """fstat said small, the file grew before the read (another writer): the read stops past the limit."""
    grown = tmp_path / "grown"
    grown.write_bytes(b"x" * 1000)
    fd = os.open(grown, os.O_RDONLY)
    try:
        with pytest.raises(FileNotFoundError, match="grew past its limit"):
            _read_all(fd, 10, 100)
    finally:
        os.close(fd)


def test_gc_quarantines_a_planted_link_among_blobs_and_leaves_its_target(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    target = tmp_path / "precious"
    target.write_text("keep")
    blob_dir = store.layout.blobs / "ab"
    blob_dir.mkdir(parents=True, exist_ok=True)
    (blob_dir / ("ab" + "0" * 62)).symlink_to(target)
    collect_garbage(store)
    assert target.read_text() == "keep" and not list(blob_dir.iterdir())
    assert any("%2Fab%2Fab0000" in name for name in os.listdir(store.layout.quarantine))


def test_write_atomic_never_writes_through_a_link_planted_at_its_temporary_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The temporary name is random, but one guessed or left behind is refused (O_EXCL|O_NOFOLLOW), not followed."""
    store = Store(tmp_path / "root")
    outside = tmp_path / "outside"
    outside.write_text("keep")
    path = store.layout.refs / "r.json"
    fixed = path.with_name(".tmp-planted")
    monkeypatch.setattr(fsops, "tmp_name", lambda p: fixed)
    fixed.symlink_to(outside)
    with pytest.raises(FileExistsError):
        store.tree.write_atomic(path, b"{}")
    assert outside.read_text() == "keep" and not path.exists()


@pytest.mark.parametrize("snapshot_id", ["../../x", "z" * 40, "A" * 40, "a" * 39])
def test_evicting_what_is_not_a_snapshot_id_is_not_cached(tmp_path: Path, snapshot_id: str) -> None:
    """Refused as 'not in the store' before any path is made of it (not as a damaged record, exit 3 not 1)."""
    store = Store(tmp_path / "root")
    before = sorted(p.name for p in store.root.iterdir())
    with pytest.raises(NotCachedError, match="not in the store"):
        store.evict(snapshot_id)
    assert sorted(p.name for p in store.root.iterdir()) == before


def test_held_directory_descriptors_refuse_a_climbing_path(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    (tmp_path / "outside").mkdir()
    with fsops.HeldDirs(store.tree) as held, pytest.raises(ValueError, match="not a path inside the store"):
        held.fd(store.root / "snapshots" / ".." / ".." / "outside")
