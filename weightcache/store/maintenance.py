"""What `weightcache verify` and `weightcache gc` do to a store: re-hash snapshots, drop damaged ones, collect
garbage. Everything goes through the store's public methods and its symlink-safe `Tree`."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from weightcache.errors import InUseError
from weightcache.store import quarantine
from weightcache.store.recovery import fetch_lock_if_free, remove_old_orphan_blobs
from weightcache.store.store import Store, disk_free
from weightcache.uri import is_model_key


def verify_snapshot(store: Store, snapshot_id: str, *, chunk: int = 8 << 20) -> list[str]:
    """Re-hash every file of a snapshot against its manifest digest; returns the paths that do not match.

    Files are opened without following a symlink: one planted in the tree counts as damaged, never as read.
    """
    snap = store.get(snapshot_id)
    bad = []
    buf = memoryview(bytearray(chunk))
    for f in snap.files:
        h = hashlib.sha256()
        try:
            with store.tree.dir((snap.path / f.path).parent) as dfd:
                fd = os.open(os.path.basename(f.path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            with open(fd, "rb", buffering=0) as fh:
                while n := fh.readinto(buf):
                    h.update(buf[:n])
        except OSError:
            bad.append(f.path)
            continue
        if h.hexdigest() != f.sha256:
            bad.append(f.path)
    return bad


def drop_damaged(store: Store, snapshot_id: str, bad_paths: list[str]) -> list[str]:
    """Remove a damaged snapshot and its damaged blobs (every link to a damaged inode) so a refetch can repair it.

    Refuses (InUseError) while the snapshot is leased: pods are reading it. Returns the refs that pointed to it.
    """
    snap = store.get(snapshot_id)
    with store.locked():
        holders = sorted(h for h, s in store.leases().items() if s == snapshot_id)
        if holders:
            raise InUseError(f"snapshot {snapshot_id} is damaged but leased by {', '.join(holders)}; "
                             f"stop those pods, then run `weightcache verify --repair` again")
        refs = [f"{u}@{r}" if r else u for u, r in store.index.query(
            "SELECT uri, revision FROM refs WHERE snapshot_id=?", (snapshot_id,))]
        store.unpin(snapshot_id)
        store.evict(snapshot_id)
        for sha in {f.sha256 for f in snap.files if f.path in bad_paths}:
            store.tree.unlink(store.layout.blob(sha))
    store.keep_reserve()
    return refs


@dataclass(frozen=True)
class GcReport:
    """What `weightcache gc` removed, and why: garbage (nothing names it) apart from snapshots evicted to give the
    disk back down to the store's free-space floor (store/floor.py: the floor kept with the store)."""

    unreferenced_blobs_bytes: int = 0  # blobs no snapshot links, past their grace
    partial_bytes: int = 0  # partial downloads no fetch holds
    quarantine_bytes: int = 0  # quarantined entries past their age or the quarantine's bound
    evicted: tuple[str, ...] = ()  # snapshots evicted for the floor, least recently used first
    evicted_bytes: int = 0
    free_bytes: int = 0  # on the store's filesystem, afterwards
    floor_bytes: int = 0  # what the store keeps free there

    @property
    def freed_bytes(self) -> int:
        return self.unreferenced_blobs_bytes + self.partial_bytes + self.quarantine_bytes + self.evicted_bytes

    def body(self) -> dict[str, Any]:
        """The wire and `-o json` form."""
        return {**dataclasses.asdict(self), "evicted": list(self.evicted), "freed_bytes": self.freed_bytes}


def collect_garbage(store: Store) -> int:
    """`collect` without the eviction: bytes freed."""
    return _collect(store).freed_bytes


def collect(store: Store) -> GcReport:
    """Remove garbage (`_collect`), then evict least recently used snapshots while the disk is below the store's
    floor (never a pinned or leased one); says what went for which reason."""
    garbage = _collect(store)
    used = store.used_bytes()
    evicted = tuple(store.restore_floor())
    free, size = disk_free(store.root)
    return dataclasses.replace(garbage, evicted=evicted, evicted_bytes=max(0, used - store.used_bytes()),
                               free_bytes=free, floor_bytes=store.floor_bytes(size))


def _collect(store: Store) -> GcReport:
    """Remove blobs no snapshot links past their grace (recovery.remove_old_orphan_blobs), partial downloads no
    fetch holds and quarantined entries past their age or the quarantine's size bound."""
    quarantined = quarantine.prune(store)
    tree, lay = store.tree, store.layout
    with store.locked():
        blobs = remove_old_orphan_blobs(store, time.time())
    by_key: dict[str, list[str]] = {}
    for name in tree.listdir(lay.partial):  # <model key>.<...>: a download's part, journal or progress file
        by_key.setdefault(name.split(".")[0], []).append(name)
    partial = 0
    for key, names in by_key.items():
        # each key's files go under its fetch lock, taken only if free: a fetch holding it keeps them
        with fetch_lock_if_free(store, key) if is_model_key(key) else nullcontext(True) as free:
            for name in names if free else ():
                st = tree.lstat(lay.partial / name)
                if tree.unlink(lay.partial / name) and st is not None:
                    partial += st.st_size
    store.keep_reserve()
    return GcReport(unreferenced_blobs_bytes=blobs, partial_bytes=partial, quarantine_bytes=quarantined)
