"""Startup recovery: remove what a crash left half-made, never a whole snapshot; make the index agree with the tree.

A crash during publish leaves one of: a temporary tree under snapshots/.tmp-*, a tree without a manifest, a
manifest without an index row, or a ref not yet written. The first two are removed (their blobs stay, a rerun
reuses them), the third is indexed, the fourth is harmless (the rerun finds the snapshot by id and writes it).
Resumable downloads under partial/ are kept.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from weightcache.store.layout import TMP_PREFIX, write_atomic
from weightcache.store.types import FileEntry

if TYPE_CHECKING:
    from weightcache.store.store import Store

log = logging.getLogger(__name__)

TMP_GRACE_S = 60.0  # a temp file younger than this may belong to a live writer in another process
ORPHAN_BLOB_GRACE_S = 600.0  # a fetch links blobs a little before it publishes the snapshot
STALE_PARTIAL_S = 7 * 86400.0


def recover(store: Store) -> None:
    from weightcache.store.store import remove_orphan_blob, remove_tree

    lay = store.layout
    now = time.time()
    with store.locked():
        for p in lay.snapshots.iterdir():
            if p.name.startswith(TMP_PREFIX) or not lay.manifest(p.name).exists():
                log.warning("recovery: removing incomplete snapshot tree %s", p)
                remove_tree(p)
        for p in [*lay.manifests.glob(TMP_PREFIX + "*"), *lay.refs.rglob(TMP_PREFIX + "*"),
                  *lay.leases.glob(TMP_PREFIX + "*"), *lay.blobs.rglob(TMP_PREFIX + "*")]:
            if _age(p, now) > TMP_GRACE_S:
                p.unlink(missing_ok=True)
        _sync_index(store)
        for ref_file in lay.refs.rglob("*"):
            if ref_file.is_file() and not ref_file.name.startswith(TMP_PREFIX):
                snap = _json(ref_file).get("snapshot")
                if not snap or not lay.manifest(str(snap)).exists():
                    log.warning("recovery: removing dangling ref %s", ref_file)
                    ref_file.unlink(missing_ok=True)
        for holder, snap in store.leases().items():
            if not lay.manifest(snap).exists():
                log.warning("recovery: releasing lease %s on missing snapshot %s", holder, snap)
                store.release(holder)
        for blob in lay.blobs.rglob("*"):
            if blob.is_file() and _age(blob, now, ctime=True) > ORPHAN_BLOB_GRACE_S:
                remove_orphan_blob(blob)
        for p in lay.partial.iterdir():
            if _age(p, now) > STALE_PARTIAL_S:
                p.unlink(missing_ok=True)


def _sync_index(store: Store) -> None:
    """Index every manifest on disk; drop rows whose manifest is gone; restore refs rows from refs/."""
    lay = store.layout
    on_disk = {p.stem: p for p in lay.manifests.glob("*.json") if not p.name.startswith(TMP_PREFIX)}
    indexed = {r[0] for r in store.index.query("SELECT id FROM snapshots")}
    with store.index.tx() as db:
        for snap_id in indexed - on_disk.keys():
            store.index.remove_snapshot(db, snap_id)
        for snap_id in on_disk.keys() - indexed:
            m = _json(on_disk[snap_id])
            try:
                files = [FileEntry(**f) for f in m["files"]]
            except (KeyError, TypeError) as exc:
                log.error("recovery: manifest %s is unreadable (%s); leaving it for `weightcache verify`",
                          on_disk[snap_id], exc)
                continue
            mtime = on_disk[snap_id].stat().st_mtime
            store.index.add_snapshot(db, snap_id, m.get("uri", ""), m.get("revision"), files, m.get("created", mtime),
                                     mtime)
        known = set()
        for key, name, uri, revision, snap in store.index.query("SELECT * FROM refs"):
            known.add((key, name))
            if snap in on_disk and not lay.ref(key, name).exists():  # crashed after indexing, before the ref
                write_atomic(lay.ref(key, name), json.dumps({"snapshot": snap, "uri": uri, "revision": revision}).encode())
        for ref_file in lay.refs.glob("*/*"):
            key = (ref_file.parent.name, ref_file.name)
            if ref_file.name.startswith(TMP_PREFIX) or key in known:
                continue
            body = _json(ref_file)
            if body.get("snapshot") in on_disk:
                store.index.set_ref(db, key[0], key[1], body.get("uri", ""), body.get("revision"), body["snapshot"])


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def _age(path: Path, now: float, *, ctime: bool = False) -> float:
    try:
        st = path.stat()
    except FileNotFoundError:
        return 0.0
    return now - (st.st_ctime if ctime else st.st_mtime)
