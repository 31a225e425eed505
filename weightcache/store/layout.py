"""Where everything lives under the store root.

    index.db                      SQLite (WAL): derived, rebuilt from the tree when missing, damaged or foreign
    blobs/sha256/ab/abcdef…       content-addressed bodies, 0444, never modified
    snapshots/<id>/…              hard links to blobs, directories 0555
    manifests/<id>.json           written last: the snapshot's commit marker
    refs/<model-key>/<name>       JSON {"snapshot", "uri", "revision", "include", "exclude"}, tmp + rename
    leases/<holder>               "<snapshot id>\\n" (holder percent-encoded)
    pins/<snapshot id>/<owner>    empty marker files
    evicting/<id>.json            a manifest moved here commits an eviction; recovery finishes it
    partial/                      downloads in flight (*.part, *.journal, <key>.progress)
    locks/                        flock files for single flight
    streams/<volume id>/…         a streaming volume's growing view: hard links to blobs, .weightcache/state
                                  (weightcache/store/streams.py)
    quarantine/                   records and entries that failed validation, kept for a human to inspect
    reserve                       a preallocated file released when the disk is full, so the store can still
                                  write its index while it frees space
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote, unquote

from weightcache.errors import DamagedRecordError
from weightcache.store.fsops import QUARANTINE, Tree
from weightcache.store.holders import volume_record_name
from weightcache.store.records import SHA256_HEX, is_hex

STREAMS_DIR = "streams"  # streaming volumes' views; the CSI plugin tells their mounts by it


class Layout:
    """Paths of one store root; `create` makes (and heals) its directories."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.tree = Tree(self.root)
        self.index = self.root / "index.db"
        self.blobs = self.root / "blobs" / "sha256"
        self.snapshots = self.root / "snapshots"
        self.manifests = self.root / "manifests"
        self.refs = self.root / "refs"
        self.leases = self.root / "leases"
        self.pins = self.root / "pins"
        self.evicting = self.root / "evicting"
        self.partial = self.root / "partial"
        self.locks = self.root / "locks"
        self.streams = self.root / STREAMS_DIR
        self.quarantine = self.root / QUARANTINE
        self.reserve = self.root / "reserve"

    def create(self) -> None:
        """Make every directory, replacing (and quarantining) any symlink or file planted in its place."""
        self.root.mkdir(parents=True, exist_ok=True)
        for d in (self.blobs, self.snapshots, self.manifests, self.refs, self.leases, self.pins, self.evicting,
                  self.partial, self.locks, self.streams, self.quarantine):
            self.tree.ensure_dir(d)

    def blob(self, sha256: str) -> Path:
        return self.blobs / self.blob_dir_name(sha256) / sha256

    @staticmethod
    def blob_dir_name(sha256: str) -> str:
        """The name of the blob's directory under `blobs`, after the last guard before a digest becomes a path."""
        if not is_hex(sha256, SHA256_HEX):
            raise DamagedRecordError(f"{sha256[:80]!r} is not a sha256 digest")
        return sha256[:2]

    def snapshot(self, snapshot_id: str) -> Path:
        return self.snapshots / _name(snapshot_id)

    def manifest(self, snapshot_id: str) -> Path:
        return self.manifests / f"{_name(snapshot_id)}.json"

    def eviction(self, snapshot_id: str) -> Path:
        return self.evicting / f"{_name(snapshot_id)}.json"

    def ref(self, model_key: str, name: str) -> Path:
        return self.refs / _name(model_key) / _name(name)

    def lease(self, holder: str) -> Path:
        return self.leases / _name(quote(holder, safe=""))

    @staticmethod
    def holder_of(lease_file: Path) -> str:
        return unquote(lease_file.name)

    def stream(self, volume_id: str) -> Path:
        return self.streams / volume_record_name(volume_id)  # any 128 bytes CSI allows, as one file name

    def pin_dir(self, snapshot_id: str) -> Path:
        return self.pins / _name(snapshot_id)

    def pin(self, snapshot_id: str, owner: str) -> Path:
        return self.pin_dir(snapshot_id) / _name(quote(owner, safe=""))

    def lock(self, name: str) -> Path:
        return self.locks / f"{_name(name)}.lock"


def _name(text: str) -> str:
    """One path segment from a caller: never a separator, '..' or NUL (those would leave the directory)."""
    if not text or "/" in text or "\0" in text or text in (".", ".."):
        raise DamagedRecordError(f"{text[:80]!r} cannot be a name in the store")
    return text
