"""Blobs of a fetch in flight: a small file's blob is named as soon as it is read, long before the snapshot that
links it is published, so neither `gc` nor another process's startup recovery may take it for an orphan."""

from __future__ import annotations

import fcntl
import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from weightcache.store import Store, collect_garbage, recovery
from weightcache.uri import parse_ref


def _orphan(store: Store, data: bytes) -> Path:
    """A blob no snapshot links (link count 1), as a fetch leaves it until it publishes."""
    sha = hashlib.sha256(data).hexdigest()
    blob = store.layout.blob(sha)
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    blob.chmod(0o444)
    return blob


@pytest.mark.parametrize("sweep", ["gc", "recovery"])
@pytest.mark.parametrize("fetching", [True, False], ids=["fetch in flight", "no fetch"])
@pytest.mark.parametrize("age", ["young", "past the grace", "past the fetching grace"])
def test_orphan_blobs_go_by_age_longer_while_a_fetch_holds_its_lock(
        tmp_path: Path, sweep: str, fetching: bool, age: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A young orphan may be a fetch's blob even when no lock was held as the sweep began (a fetch can start
    during it): kept. One past the grace goes, unless a fetch runs (a long fetch's early blob, a streamed shard):
    then only past the fetching grace, so a node always fetching still collects."""
    store = Store(tmp_path / "root")
    blob = _orphan(store, b"a small file of a fetch in flight")
    linked = _orphan(store, b"a blob a snapshot links")
    os.link(linked, tmp_path / "snapshot-link")  # link count 2: never an orphan, whatever its age
    if age != "young":
        monkeypatch.setattr(recovery, "ORPHAN_BLOB_GRACE_S", -1.0)  # every blob is past its grace
    if age == "past the fetching grace":
        monkeypatch.setattr(recovery, "FETCHING_ORPHAN_GRACE_S", -1.0)
    gone = age == "past the fetching grace" or (age == "past the grace" and not fetching)
    lock = store.open_lock(parse_ref("file:///models/m/").key)
    try:
        if fetching:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as Fetcher.ensure holds it, here another process
        if sweep == "gc":
            assert collect_garbage(store) == (len(b"a small file of a fetch in flight") if gone else 0)
        else:
            Store(tmp_path / "root").close()
        assert recovery.fetches_in_flight(store) == ({parse_ref("file:///models/m/").key} if fetching else set())
    finally:
        os.close(lock)
    assert blob.exists() != gone
    assert linked.exists()
    assert recovery.fetches_in_flight(store) == set()


def test_gc_never_removes_the_partial_files_of_a_fetch_that_started_during_its_sweep(tmp_path: Path) -> None:
    """A fetch writes to partial/ only under its key's lock. gc used to take the set of busy keys first and remove
    partial files after: a fetch that took its lock and made its part file in between lost it mid-download. Here
    one thread starts fetch after fetch (lock, part file, look, done) while gc sweeps in a loop beside it."""
    store = Store(tmp_path / "root")
    key = parse_ref("file:///models/m/").key
    part = store.partial_path(f"{key}.0.part")
    stop, lost = threading.Event(), []

    def fetches() -> None:
        while not stop.is_set():
            fd = store.open_lock(key)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                part.write_bytes(b"journalled bytes")
                for _ in range(50):  # the download's time: gc sweeps meanwhile
                    if not part.exists():
                        lost.append(1)
                        break
                part.unlink(missing_ok=True)  # published
            finally:
                os.close(fd)

    fetcher = threading.Thread(target=fetches)
    fetcher.start()
    try:
        deadline = time.monotonic() + 1.0  # the old sweep lost a part file within 0.1 s here
        sweeps = 0
        while time.monotonic() < deadline and not lost:
            collect_garbage(store)
            sweeps += 1
    finally:
        stop.set()
        fetcher.join()
    assert not lost, f"gc removed a running fetch's part file (after {sweeps} sweeps)"
    part.write_bytes(b"left by a fetch that ended")  # no fetch holds the lock: gc removes it
    assert collect_garbage(store) == len(b"left by a fetch that ended") and not part.exists()
