"""Where everything lives under the store root, and the atomic-write primitives the store is built from.

    index.db                      SQLite (WAL): derived, rebuilt from the tree when missing or damaged
    blobs/sha256/ab/abcdef…       content-addressed bodies, 0444, never modified
    snapshots/<id>/…              hard links to blobs, directories 0555
    manifests/<id>.json           written last: the snapshot's commit marker
    refs/<model-key>/<name>       "<snapshot id>\n", written tmp + rename
    leases/<holder>               "<snapshot id>\n" (holder percent-encoded)
    pins/<snapshot id>/<owner>    empty marker files
    partial/                      downloads in flight (*.part, *.journal, <key>.progress)
    locks/                        flock files for single flight
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from urllib.parse import quote, unquote

TMP_PREFIX = ".tmp-"


class Layout:
    """Paths of one store root; creates the directories on first use."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.index = self.root / "index.db"
        self.blobs = self.root / "blobs" / "sha256"
        self.snapshots = self.root / "snapshots"
        self.manifests = self.root / "manifests"
        self.refs = self.root / "refs"
        self.leases = self.root / "leases"
        self.pins = self.root / "pins"
        self.partial = self.root / "partial"
        self.locks = self.root / "locks"

    def create(self) -> None:
        for d in (self.blobs, self.snapshots, self.manifests, self.refs, self.leases, self.pins, self.partial,
                  self.locks):
            d.mkdir(parents=True, exist_ok=True)

    def blob(self, sha256: str) -> Path:
        return self.blobs / sha256[:2] / sha256

    def snapshot(self, snapshot_id: str) -> Path:
        return self.snapshots / snapshot_id

    def manifest(self, snapshot_id: str) -> Path:
        return self.manifests / f"{snapshot_id}.json"

    def ref(self, model_key: str, name: str) -> Path:
        return self.refs / model_key / name

    def lease(self, holder: str) -> Path:
        return self.leases / quote(holder, safe="")

    @staticmethod
    def holder_of(lease_file: Path) -> str:
        return unquote(lease_file.name)

    def pin(self, snapshot_id: str, owner: str) -> Path:
        return self.pins / snapshot_id / quote(owner, safe="")

    def lock(self, name: str) -> Path:
        return self.locks / f"{name}.lock"


def tmp_name(path: Path) -> Path:
    """A per-writer temporary sibling: unique across processes and threads, recognisable by recovery."""
    return path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}.{secrets.token_hex(4)}")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, mode: int = 0o644, durable: bool = True) -> None:
    """Write `data` to `path` so readers see the old file or the whole new one, never a part.

    `durable=False` skips the fsyncs, for state that does not outlive a reboot anyway (leases of mounts).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)
