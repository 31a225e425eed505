"""Startup recovery: finish what a crash interrupted, never remove a whole published snapshot, then make the
index agree with the tree.

It runs in two phases so that a full disk cannot wedge it. `free_space` touches only files and needs no new
bytes: it finishes committed evictions (evicting/<id>.json), quarantines records that fail validation,
removes trees without a manifest (an interrupted publish), old temporary files, orphan blobs and abandoned
partial downloads. Only then does the store open its index and `sync` write to it. A crash during publish
leaves one of: a temporary tree, a tree without a manifest (both removed; their blobs stay a while so a rerun
reuses them), a manifest without an index row (indexed), a ref not yet written (written from the index row).
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import stat
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from weightcache.store.fsops import TMP_PREFIX
from weightcache.store.records import Manifest, RefRecord, is_hex, is_snapshot_id, ref_bytes
from weightcache.store.view import StoreView

log = logging.getLogger(__name__)

TMP_GRACE_S = 60.0  # a temp file younger than this may belong to a live writer in another process
ORPHAN_BLOB_GRACE_S = 600.0  # a fetch names its blobs before it publishes the snapshot that links them
# ... and while some fetch holds its lock, its early blobs may be that old (a long fetch; a streamed shard named
# when it became durable): kept this long then, still bounded so a node that is always fetching collects.
FETCHING_ORPHAN_GRACE_S = 6 * 3600.0
STALE_PARTIAL_S = 7 * 86400.0


def free_space(store: StoreView) -> dict[str, Manifest]:
    """Phase one (no index writes): returns the valid manifests, by snapshot id."""
    lay, tree = store.layout, store.tree
    now = time.time()
    with store.locked():
        for name in tree.listdir(lay.evicting):
            snap_id = name.removesuffix(".json")
            if name.endswith(".json") and is_snapshot_id(snap_id):
                log.warning("recovery: finishing the interrupted eviction of snapshot %s", snap_id)
                store.finish_eviction(snap_id, index=False)
            elif not name.startswith(TMP_PREFIX):
                tree.quarantine(lay.evicting / name, "is not an eviction record")
        manifests = valid_manifests(store)
        for name in tree.listdir(lay.snapshots):
            if name not in manifests:
                log.warning("recovery: removing incomplete snapshot tree %s", lay.snapshots / name)
                tree.remove_tree(lay.snapshots / name)
        for d in (lay.manifests, lay.leases, *ref_dirs(store), *blob_dirs(store)):
            for name in tree.listdir(d):
                if name.startswith(TMP_PREFIX) and _age(store, d / name, now) > TMP_GRACE_S:
                    tree.unlink(d / name)
        remove_old_orphan_blobs(store, now)
        for name in tree.listdir(lay.partial):
            if _age(store, lay.partial / name, now) > STALE_PARTIAL_S:
                tree.unlink(lay.partial / name)
    return manifests


def sync(store: StoreView, manifests: dict[str, Manifest]) -> None:
    """Phase two: index rows for evictions finished, manifests, refs; dangling refs, leases and pins removed.

    `manifests` (phase one's) were read under an earlier hold of the store lock: another process may have
    published or evicted a snapshot since (while this one opened its index), so the manifests are listed again
    under this hold and only new ones read. Taken as the tree, phase one's once unindexed a snapshot published
    meanwhile, removed its ref as dangling and released its leases: a second `prefetch` then found no snapshot
    under the fetch lock and downloaded the model again (test_single_flight_across_three_processes); an evicted
    one was indexed again."""
    lay, tree = store.layout, store.tree
    with store.locked():
        manifests = valid_manifests(store, known=manifests)
        for name in tree.listdir(lay.evicting):
            if name.endswith(".json") and is_snapshot_id(name.removesuffix(".json")):
                store.finish_eviction(name.removesuffix(".json"))
        _sync_index(store, manifests)
        for ref_file in ref_files(store):
            record = store.read_ref_file(ref_file)
            if record is not None and record.snapshot not in manifests:
                log.warning("recovery: removing dangling ref %s", ref_file)
                tree.unlink(ref_file)
        for holder, snap in store.leases().items():
            if snap not in manifests:
                log.warning("recovery: releasing lease %s on missing snapshot %s", holder, snap)
                store.release(holder)
        for name in tree.listdir(lay.pins):
            if not is_snapshot_id(name):
                tree.quarantine(lay.pins / name, "is not a snapshot id")


def valid_manifests(store: StoreView, known: Mapping[str, Manifest] | None = None) -> dict[str, Manifest]:
    """Every manifest that validates; the rest are quarantined (their trees then count as incomplete). `known`:
    manifests read before, not read again while their file is there (a snapshot's files never change)."""
    lay, tree = store.layout, store.tree
    known = known or {}
    out = {}
    for name in tree.listdir(lay.manifests):
        snap_id = name.removesuffix(".json")
        if name.startswith(TMP_PREFIX):
            continue
        if not name.endswith(".json") or not is_snapshot_id(snap_id):
            tree.quarantine(lay.manifests / name, "is not named <snapshot id>.json")
            continue
        manifest = known.get(snap_id) or store.read_manifest(lay.manifests / name, snap_id)
        if manifest is not None:
            out[snap_id] = manifest
    return out


def remove_old_orphan_blobs(store: StoreView, now: float) -> int:
    """Remove blobs no snapshot links whose inode changed more than ORPHAN_BLOB_GRACE_S ago (FETCHING_ORPHAN_GRACE_S
    while a fetch holds its lock); bytes freed.

    A fetch names a small file's blob as soon as it is read (store/blobwrite.py), and a streamed file's once it is
    durable (fetch/handover.py, on_file), before the snapshot that links it is published: a young orphan may be one of
    those, whether or not a fetch held its lock when the sweep began (one may start during it), and an older one
    too while a fetch runs (it may have named it an hour ago). Age, not the locks alone, decides, so a node that is
    always fetching still collects its old orphans. ctime, not mtime: linking or unlinking a name updates it,
    writing content with an old mtime does not hide a new file. Anything not a regular file is quarantined
    whatever its age."""
    tree, freed = store.tree, 0
    grace = FETCHING_ORPHAN_GRACE_S if fetches_in_flight(store) else ORPHAN_BLOB_GRACE_S
    for d in blob_dirs(store):
        for name in tree.listdir(d):
            st = tree.lstat(d / name)
            if st is None or (stat.S_ISREG(st.st_mode) and now - st.st_ctime <= grace):
                continue
            freed += tree.unlink_if_single_link(d / name)
    return freed


def fetches_in_flight(store: StoreView) -> set[str]:
    """Model keys whose fetch lock (`locks/<key>.lock`) some process holds now: while any does, orphan blobs get
    the longer grace."""
    busy = set()
    for name in store.tree.listdir(store.layout.locks):
        if not (name.startswith("m") and name.endswith(".lock")):
            continue
        fd = store.open_lock(name.removesuffix(".lock"))
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            busy.add(name.removesuffix(".lock"))
        finally:
            os.close(fd)
    return busy


@contextmanager
def fetch_lock_if_free(store: StoreView, key: str) -> Iterator[bool]:
    """Hold model `key`'s fetch lock for the section if no process holds it now (True), else nothing (False).
    A fetch writes to partial/ only under that lock, so what is removed under it is no running fetch's: a set of
    busy keys taken before a sweep would miss a fetch that starts during it."""
    fd = store.open_lock(key)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the lock with its last descriptor


def ref_dirs(store: StoreView) -> list[Path]:
    return [store.layout.refs / key for key in store.tree.listdir(store.layout.refs)]


def ref_files(store: StoreView) -> list[Path]:
    """refs/<model-key>/<name> files (not temporaries)."""
    return [d / name for d in ref_dirs(store) for name in store.tree.listdir(d) if not name.startswith(TMP_PREFIX)]


def blob_dirs(store: StoreView) -> list[Path]:
    """blobs/sha256/<ab> directories; anything else there is quarantined."""
    out = []
    for name in store.tree.listdir(store.layout.blobs):
        if is_hex(name, 2):
            out.append(store.layout.blobs / name)
        else:
            store.tree.quarantine(store.layout.blobs / name, "is not a blob directory")
    return out


def _sync_index(store: StoreView, manifests: dict[str, Manifest]) -> None:
    """Index every valid manifest, drop rows whose manifest is gone, restore refs rows and files from each other.

    Writes only when something differs, so opening a consistent store on a full disk writes nothing.
    """
    lay, tree = store.layout, store.tree
    indexed = {str(r[0]) for r in store.index.query("SELECT id FROM snapshots")}
    gone = indexed - manifests.keys()
    new = [manifests[i] for i in sorted(manifests.keys() - indexed)]
    rows = store.index.query("SELECT model_key, name, uri, revision, snapshot_id FROM refs")
    known = {(str(r[0]), str(r[1])) for r in rows}
    for key, name, uri, revision, snap in rows:
        if snap in manifests and tree.lstat(lay.ref(key, name)) is None:  # crashed after indexing, before the ref
            tree.write_atomic(lay.ref(key, name), ref_bytes(RefRecord(snap, uri, revision)))
    missing_rows = []
    for ref_file in ref_files(store):
        key = (ref_file.parent.name, ref_file.name)
        record = store.read_ref_file(ref_file) if key not in known else None
        if record is not None and record.snapshot in manifests:
            missing_rows.append((key, record))
    if not (gone or new or missing_rows):
        return
    mtimes = {m.id: _mtime(store, lay.manifest(m.id)) for m in new}

    def apply(db: sqlite3.Connection) -> None:
        for snap_id in gone:
            store.index.remove_snapshot(db, snap_id)
        for m in new:
            store.index.add_snapshot(db, m.id, m.uri, m.revision, m.files, m.created, mtimes[m.id])
        for (model_key, name), record in missing_rows:
            store.index.set_ref(db, model_key, name, record.uri, record.revision, record.snapshot)

    store.index.write(apply)


def _mtime(store: StoreView, path: Path) -> float:
    st = store.tree.lstat(path)
    return st.st_mtime if st is not None else time.time()


def _age(store: StoreView, path: Path, now: float) -> float:
    st = store.tree.lstat(path)
    return 0.0 if st is None else now - st.st_mtime
