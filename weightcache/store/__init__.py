"""The node cache on disk (layout in ../shared/DESIGN.md): blobs, snapshots, manifests, refs, leases, pins."""

from weightcache.store.store import Store
from weightcache.store.types import FileEntry, Snapshot, SnapshotInfo

__all__ = ["FileEntry", "Snapshot", "SnapshotInfo", "Store"]
