"""The node cache on disk (layout in weightcache.store.layout): blobs, snapshots, manifests, refs, leases, pins.

Other packages use only what is exported here.
"""

from weightcache.store.blobwrite import BlobWriter
from weightcache.store.book import RecordBook
from weightcache.store.fsops import LinkTree, Tree, tmp_name
from weightcache.store.maintenance import GcReport, collect, collect_garbage, drop_damaged, verify_snapshot
from weightcache.store.paths import validate_relpath, validate_tree
from weightcache.store.quarantine import QuarantineUsage
from weightcache.store.quarantine import usage as quarantine_usage
from weightcache.store.store import BlobMissingError, Store
from weightcache.store.streams import StreamViews
from weightcache.store.types import FileEntry, Snapshot, SnapshotInfo

__all__ = [
           "BlobMissingError",
           "BlobWriter",
           "FileEntry",
           "GcReport",
           "LinkTree",
           "QuarantineUsage",
           "RecordBook",
           "Snapshot",
           "SnapshotInfo",
           "Store",
           "StreamViews",
           "Tree",
           "collect",
           "collect_garbage",
           "drop_damaged",
           "quarantine_usage",
           "tmp_name",
           "validate_relpath",
           "validate_tree",
           "verify_snapshot",
]
