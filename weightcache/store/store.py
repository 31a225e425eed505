"""Store: the public face of the on-disk cache (layout in weightcache.store.layout).

Every change is an atomic rename of a fully written, fsynced file; a manifest written last marks a snapshot
complete, and moving it to evicting/ is the first step of removing one. Short critical sections (publish,
lease, evict) take the store-wide flock `locks/store.lock`, so a lease can never be granted on a snapshot that
an eviction in another process is removing. Every path goes through `Tree` (weightcache.store.fsops), which
never follows a symlink planted under the root, and every record read back is checked
(weightcache.store.records) and quarantined when it is not what the store writes.
"""

from __future__ import annotations

import builtins
import dataclasses
import enum
import errno
import fcntl
import json
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from weightcache import defaults
from weightcache.errors import (
    BlobMissingError,
    DamagedRecordError,
    HostileKeyError,
    InsufficientSpaceError,
    InUseError,
    NotCachedError,
)
from weightcache.store import floor, quarantine, recovery
from weightcache.store.blobwrite import BlobWriter
from weightcache.store.changes import ChangeToken
from weightcache.store.evict import plan_eviction
from weightcache.store.fsops import (
    TMP_PREFIX,
    HeldDirs,
    LinkTree,
    commits_in_order,
    move_noreplace,
    tmp_name,
)
from weightcache.store.index import Index
from weightcache.store.layout import Layout
from weightcache.store.paths import validate_relpath
from weightcache.store.records import (
    MAX_MANIFEST_BYTES,
    MAX_SMALL_RECORD_BYTES,
    SHA256_HEX,
    Manifest,
    RefRecord,
    file_entry,
    is_hex,
    is_snapshot_id,
    lease_bytes,
    manifest_bytes,
    manifest_checks,
    manifest_signature,
    parse_lease,
    parse_manifest,
    parse_ref,
    ref_bytes,
    snapshot_id_for,
)
from weightcache.store.types import FileEntry, Snapshot, SnapshotInfo
from weightcache.units import fmt_bytes
from weightcache.uri import ModelRef

log = logging.getLogger(__name__)

# The free-space floor (weightcache.defaults): the store never fills its filesystem past it, and gives space back
# down to it at start. The store usually shares its disk with the pods, so kubelet's eviction threshold matters.
DEFAULT_MIN_FREE_BYTES = defaults.MIN_FREE_BYTES
RESERVE_BYTES = 4 << 20  # preallocated; released when a full disk refuses an index write, so eviction can finish


class Unset(enum.Enum):
    """A budget not given (None is a budget given as unlimited)."""

    UNSET = "unset"


UNSET = Unset.UNSET


def ref_name(ref: ModelRef) -> str:
    return ref.revision or "latest"


class Store:
    """Thread-safe and multi-process-safe. Constructing one creates the layout and runs startup recovery, which
    ends by giving space back down to the floor unless `evict_to_floor` is False (read-only commands: `ls` on a
    nearly full laptop disk must not delete cached models)."""

    def __init__(self, root: str | Path, *, budget_bytes: int | Unset | None = UNSET,
                 min_free_bytes: int | None = None, min_free_percent: float | None = None,
                 recover: bool = True, evict_to_floor: bool = True, set_by: str = "cli") -> None:
        """The floor and budget given here (None / UNSET: not given) are kept with the store for every later
        command (`set_limits`); those not given are the store's own, else the defaults (store/floor.py)."""
        self.layout = Layout(root)
        self.root = self.layout.root
        self.tree = self.layout.tree
        self.layout.create()
        stored = floor.read_limits(self.layout)
        given = not isinstance(budget_bytes, Unset) or min_free_bytes is not None or min_free_percent is not None
        self.limits = floor.SpaceLimits(min_free_bytes, min_free_percent,
                                        set_by=set_by if given else "").merged(stored)
        self.limits = dataclasses.replace(self.limits, budget_bytes=stored.budget_bytes if isinstance(
            budget_bytes, Unset) else budget_bytes)
        if given and dataclasses.replace(self.limits, set_by="") != dataclasses.replace(stored, set_by=""):
            floor.write_limits(self.layout, self.limits)
        # the cluster's say on which snapshots are among its last copies (minCopies, weightcache/kube/copies.py):
        # snapshot id -> why it stays; set by the daemon in cluster mode, consulted by every eviction
        self.keeper: Callable[[builtins.list[SnapshotInfo]], dict[str, str]] | None = None
        self._tlock = threading.RLock()
        self._depth = 0  # re-entry count of locked() in the thread that holds it
        manifests = recovery.free_space(self) if recover else {}  # before any write: on a full disk it makes room
        if recover:
            quarantine.prune(self)
        # under the store lock: processes opening a new store at once (three `prefetch --no-daemon` on a fresh
        # node) each made the index, and one that met another's making of it (its switch to WAL: "database is
        # locked"; a schema made a table at a time: "table files has columns []") took it for damage and moved it
        # aside under the process that made it, which then indexed its snapshot in the quarantined file: the
        # others found its ref but no row and fetched the model again (test_single_flight_across_three_processes)
        with self.locked():
            self.index = Index(self.layout.index, self.tree, on_full=self._release_reserve)
        self.changes = ChangeToken(self.layout)  # has the store changed? (for readers that keep what they derive)
        self._check_counts: dict[str, dict[str, int]] = {}  # snapshot id -> source_checks (manifests never change)
        self._signatures: dict[str, dict[str, str | int]] = {}  # snapshot id -> its signature record (record_signature)
        if recover:
            recovery.sync(self, manifests)
            if evict_to_floor:
                self.restore_floor()
            self.keep_reserve()

    def close(self) -> None:
        self.index.close()
        self.changes.close()

    # -- locking ----------------------------------------------------------------------------------------------
    @contextmanager
    def locked(self) -> Iterator[None]:
        """Store-wide exclusive section, across threads and processes; re-entrant in the thread holding it."""
        with self._tlock:
            if self._depth:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                return
            fd = self.open_lock("store")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._depth = 1
                yield
            finally:
                self._depth = 0
                os.close(fd)

    def open_lock(self, name: str) -> int:
        """A descriptor of lock file `locks/<name>.lock` (created; a symlink planted there is never followed)."""
        path = self.layout.lock(name)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        with self.tree.dir(path.parent, create=True) as dfd:
            try:
                return os.open(path.name, flags, 0o644, dir_fd=dfd)
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
            self.tree.quarantine(path, "is a symlink, not a lock file")
            return os.open(path.name, flags, 0o644, dir_fd=dfd)

    def partial_path(self, name: str) -> Path:
        """Where a download in flight keeps file `name`: see partial_dir."""
        return self.partial_dir() / name

    def partial_dir(self) -> Path:
        """partial/, checked (and healed) to be a real directory on each call: a fetch calls it once per plan
        and names its many files in it; the download opens each file itself with O_NOFOLLOW."""
        self.tree.ensure_dir(self.layout.partial)
        return self.layout.partial

    # -- reading ----------------------------------------------------------------------------------------------
    def lookup(self, ref: ModelRef) -> Snapshot | None:
        """The snapshot `ref` resolves to (refs/ or a snapshot id as revision), touching last_used; None if absent.

        Only a snapshot whose every file `ref` selects: a snapshot id names a snapshot fetched
        for anyone, so asking by id under narrower globs must not hand over the files they leave out
        (weightcache/access.py: no other name for a snapshot widens what was granted)."""
        snap_id = self._read_ref(ref)
        if snap_id is None and ref.revision:
            snap_id = self._snapshot_by_id_prefix(ref.revision, ref.uri)
        if snap_id is None:
            return None
        try:
            snap = self.get(snap_id)
        except NotCachedError:
            return None
        if not all(ref.matches(f.path) for f in snap.files):  # (its uri: refs/ and the id lookup are per model)
            log.info("%s names snapshot %s, which holds files its globs leave out: not served", ref, snap_id[:12])
            return None
        self.index.touch(snap_id)
        return snap

    def _read_ref(self, ref: ModelRef) -> str | None:
        record = self.read_ref_file(self.layout.ref(ref.key, ref_name(ref)))
        return record.snapshot if record else None

    def read_ref_file(self, path: Path) -> RefRecord | None:
        """A ref file's record; None when missing or damaged (a damaged one is quarantined)."""
        data = self.tree.read(path, limit=MAX_SMALL_RECORD_BYTES)
        if data is None:
            return None
        try:
            return parse_ref(data)
        except DamagedRecordError as exc:
            self.tree.quarantine(path, f"is not a valid ref ({exc})")
            return None

    def read_manifest(self, path: Path, snapshot_id: str) -> Manifest | None:
        """A manifest (in manifests/ or evicting/); None when missing or damaged (a damaged one is quarantined)."""
        data = self.tree.read(path, limit=MAX_MANIFEST_BYTES)
        if data is None:
            return None
        try:
            return parse_manifest(data, snapshot_id)
        except DamagedRecordError as exc:
            self.tree.quarantine(path, f"is not a valid manifest ({exc})")
            return None

    def _snapshot_by_id_prefix(self, prefix: str, uri: str) -> str | None:
        if len(prefix) < 8:
            return None
        rows = self.index.query("SELECT DISTINCT snapshot_id FROM refs WHERE uri=? AND snapshot_id LIKE ?",
                                (uri, _like_prefix(prefix)))
        return str(rows[0][0]) if len(rows) == 1 else None

    def is_complete(self, snapshot_id: str) -> bool:
        """Whether the snapshot's manifest (its commit marker) is in place."""
        return is_snapshot_id(snapshot_id) and self.tree.is_file(self.layout.manifest(snapshot_id))

    def get(self, snapshot_id: str) -> Snapshot:
        """A snapshot by id; raises NotCachedError."""
        rows = self.index.query("SELECT uri, revision FROM snapshots WHERE id=?", (snapshot_id,))
        if not rows or not self.is_complete(snapshot_id):
            raise NotCachedError(f"snapshot {snapshot_id[:80]} is not in the store at {self.root}; "
                                 f"see `weightcache ls`")
        files = self._files(snapshot_id)
        uri, revision = rows[0]
        return Snapshot(snapshot_id, self.layout.snapshot(snapshot_id), uri, revision,
                        sum(f.size for f in files), files)

    def _files(self, snapshot_id: str) -> tuple[FileEntry, ...]:
        rows = self.index.query(
            "SELECT path, size, sha256, etag, version_id FROM files WHERE snapshot_id=? ORDER BY path",
            (snapshot_id,))
        return tuple(_row_entry(r) for r in rows)

    def list(self) -> builtins.list[SnapshotInfo]:
        leases: dict[str, builtins.list[str]] = {}
        for holder, snap_id in self.leases().items():
            leases.setdefault(snap_id, []).append(holder)
        refs: dict[str, builtins.list[str]] = {}
        for uri, rev, snap_id in self.index.query("SELECT uri, revision, snapshot_id FROM refs ORDER BY uri"):
            refs.setdefault(snap_id, []).append(uri + (f"@{rev}" if rev else ""))
        files: dict[str, builtins.list[FileEntry]] = {}
        for sid, *rest in self.index.query(
                "SELECT snapshot_id, path, size, sha256, etag, version_id FROM files ORDER BY snapshot_id, path"):
            files.setdefault(sid, []).append(_row_entry(tuple(rest)))
        shared = {sha for (sha,) in self.index.query(
            "SELECT sha256 FROM files GROUP BY sha256 HAVING COUNT(DISTINCT snapshot_id) > 1")}
        infos = []
        for sid, uri, rev, size, last_used in self.index.query(
                "SELECT id, uri, revision, size, last_used FROM snapshots ORDER BY uri, created"):
            fl = tuple(files.get(sid, ()))
            unique = sum(f.size for f in {f.sha256: f for f in fl if f.sha256 not in shared}.values())
            infos.append(SnapshotInfo(Snapshot(sid, self.layout.snapshot(sid), uri, rev, size, fl),
                                      tuple(refs.get(sid, ())), last_used, self.is_pinned(sid),
                                      tuple(sorted(leases.get(sid, ()))), unique, self._source_check_counts(sid),
                                      self._signature_of(sid)))
        return infos

    def used_bytes(self) -> int:
        return self.index.stored_bytes()

    # -- blobs and publish ---------------------------------------------------------------------------------------
    def has_blob(self, sha256: str) -> bool:
        return self.blob_size(sha256) is not None

    def blob_size(self, sha256: str, dirs: HeldDirs | None = None) -> int | None:
        """Size of the blob with this hex digest; None when absent (or not a digest, or not a regular file).
        `dirs`: directories held open by a caller that asks about many blobs."""
        if not is_hex(sha256, SHA256_HEX):
            return None
        if dirs is None:
            with self.tree.held() as held:
                return self.blob_size(sha256, held)
        return _blob_size(self._blob_dirs(dirs), sha256)

    def source_checks(self, snapshot_id: str) -> dict[str, str]:
        """Path -> what verified it against its source, as the snapshot's manifest records it (docs/fetch.md);
        empty when the manifest predates the record (or is gone)."""
        return manifest_checks(self._manifest_object(snapshot_id))

    def signature(self, snapshot_id: str) -> dict[str, str | int]:
        """What verified the snapshot's model.sig (docs/signing.md); empty when no signature was asked for."""
        return manifest_signature(self._manifest_object(snapshot_id))

    def _signature_of(self, snapshot_id: str) -> dict[str, str | int]:
        found = self._signatures.get(snapshot_id)
        if found is None:
            found = self._signatures[snapshot_id] = self.signature(snapshot_id)
        return found

    def _manifest_object(self, snapshot_id: str) -> dict[str, Any]:
        data = self.tree.read(self.layout.manifest(snapshot_id), limit=MAX_MANIFEST_BYTES) \
            if is_snapshot_id(snapshot_id) else None
        if data is None:
            return {}
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):
            return {}  # a damaged manifest is the recovery's to quarantine; it describes nothing here
        return obj if isinstance(obj, dict) else {}

    def record_signature(self, snapshot_id: str, signature: Mapping[str, str | int]) -> None:
        """Add what verified a published snapshot to its manifest when it has no such record yet (a tree published
        first for a request that asked no signature). The files, and so the id, are unchanged; the rewrite is atomic
        like the first write."""
        with self.locked():
            data = self.tree.read(self.layout.manifest(snapshot_id), limit=MAX_MANIFEST_BYTES)
            if data is None:
                return
            manifest = parse_manifest(data, snapshot_id)
            if not manifest.signature:
                self._write_manifest(dataclasses.replace(manifest, signature=dict(signature)))
                self._signatures.pop(snapshot_id, None)

    def _source_check_counts(self, snapshot_id: str) -> dict[str, int]:
        counts = self._check_counts.get(snapshot_id)
        if counts is None:
            counts = {}
            for check in self.source_checks(snapshot_id).values():
                counts[check] = counts.get(check, 0) + 1
            self._check_counts[snapshot_id] = counts
        return counts

    def known_checks(self, uri: str, files: Iterable[tuple[str, str, int]]) -> dict[tuple[str, str, int], str]:
        """(path, ETag, size) -> what verified this node's earlier download of it (`known_sha256`'s rows), from
        the manifests that record them: a file linked on the node's own record keeps the check its download had."""
        wanted = set(files)
        if not wanted:
            return {}
        rows = self.index.query(
            "SELECT f.snapshot_id, f.path, f.etag, f.size FROM files f JOIN snapshots s ON s.id = f.snapshot_id "
            "WHERE s.uri=? AND f.etag IS NOT NULL AND f.etag != ''", (uri,))
        out: dict[tuple[str, str, int], str] = {}
        manifests: dict[str, dict[str, str]] = {}
        for sid, path, etag, size in rows:
            key = (str(path), str(etag), int(size))
            if key in wanted and key not in out:
                checks = manifests.get(sid)
                if checks is None:
                    checks = manifests[sid] = self.source_checks(str(sid))
                if check := checks.get(str(path)):
                    out[key] = check
        return out

    def known_sha256(self, uri: str) -> dict[tuple[str, str, int], str]:
        """(path, source ETag, size) -> sha256 of every file of `uri` this node recorded (one query for a whole
        listing: a query per file cost more than the rest of planning). The blob may have been evicted since:
        the caller checks that it still exists before it skips a download."""
        rows = self.index.query(
            "SELECT f.path, f.etag, f.size, f.sha256 FROM files f JOIN snapshots s ON s.id = f.snapshot_id "
            "WHERE s.uri=? AND f.etag IS NOT NULL AND f.etag != ''", (uri,))
        return {(str(path), str(etag), int(size)): str(sha) for path, etag, size, sha in rows}

    def add_blob(self, path: Path, sha256: str, *, durable: bool = True) -> None:
        """Move a fully written, verified file into blobs/ (0444); a blob that exists already wins (dedup).

        `path` is a file the caller wrote under the root; a symlink found there instead is refused, not followed.
        `durable=False` skips the fsyncs: only for a caller that synced the file's data before (a blob name
        promises its content) and syncs the filesystem before it publishes (fetch: syncfs, twice per model).
        """
        self.add_blobs([(path, sha256)], durable=durable)

    def add_blobs(self, files: Iterable[tuple[Path, str]], *, durable: bool = True) -> None:
        """add_blob for many (path, sha256) files, each directory opened once.

        Each file is moved by a rename that neither follows nor replaces (fsops.move_noreplace), and the blob is
        then checked to be a regular file with the inode found at `path`: a symlink planted at `path` is refused
        before anything moves, a symlink or another inode swapped in meanwhile is quarantined. A file that is
        0444 already (the fetch creates its small files so) costs three calls: lstat, rename, lstat.
        """
        with self.tree.held() as dirs:
            blob_dirs = self._blob_dirs(dirs, create=True)
            parents: dict[str, int] = {}  # the parts' directories by name: no Path built per file
            for path, sha256 in files:
                blob_dir = blob_dirs(sha256)
                head = os.path.dirname(path)
                dfd = parents.get(head)
                if dfd is None:
                    dfd = parents[head] = dirs.fd(path.parent)
                inode = _sealed_inode(dfd, path.name, durable=durable)
                if not move_noreplace(dfd, path.name, blob_dir, sha256):
                    os.unlink(path.name, dir_fd=dfd)  # the blob exists already: same content, one inode
                    continue
                st = os.stat(sha256, dir_fd=blob_dir, follow_symlinks=False)
                if st.st_ino != inode or not stat.S_ISREG(st.st_mode):
                    blob = self.layout.blob(sha256)
                    self.tree.quarantine(blob, f"was swapped for {path} while it became a blob")
                    raise OSError(errno.ESTALE, f"{path} was replaced while it became blob {sha256}; fetch again")
                if durable:
                    os.fsync(blob_dir)

    def sync_blob(self, sha256: str) -> None:
        """fsync blob `sha256` and its directory: durable now rather than at the fetch's syncfs (a file the fetch
        hands over before the model is whole, Fetcher.ensure's on_file). A symlink there is refused (ELOOP)."""
        with self.tree.held() as dirs:
            dfd = self._blob_dirs(dirs)(sha256)
            fd = os.open(sha256, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.fsync(dfd)

    def blob_writer(self) -> BlobWriter:
        """A writer of small verified files straight to their blobs, for one fetch (close it: `with`)."""
        dirs = self.tree.held()
        return BlobWriter(self.layout, dirs, self._blob_dirs(dirs, create=True))

    def _blob_dirs(self, dirs: HeldDirs, *, create: bool = False) -> Callable[[str], int]:
        """sha256 -> descriptor of its blobs/sha256/<ab> directory (refused unless it is a digest), held in `dirs`;
        one dict lookup per file for a caller naming thousands of blobs."""
        fds: dict[str, int] = {}
        opening = threading.Lock()  # HeldDirs is not thread-safe: a BlobWriter's workers share this

        def blob_dir(sha256: str) -> int:
            name = self.layout.blob_dir_name(sha256)
            fd = fds.get(name)
            if fd is None:
                with opening:
                    fd = fds.get(name)
                    if fd is None:
                        fd = fds[name] = dirs.child(self.layout.blobs, name, create=create)
            return fd

        return blob_dir

    def publish(self, ref: ModelRef, files: builtins.list[FileEntry], *,
                before_commit: Callable[[], object] | None = None, checks: dict[str, str] | None = None,
                signature: Mapping[str, str | int] | None = None) -> Snapshot:
        """Build the snapshot tree from blobs, rename it into place, write the manifest, index it, point the ref.
        `before_commit()` runs once the tree is built, before anything names the snapshot: the fetch waits there
        for the syncfs that makes the blobs durable (it raises to abandon the publish). `checks`: path -> what
        verified it against the source, recorded in the manifest (a tree already published keeps its record).
        `signature`: what verified its model.sig (weightcache/signatures.py), recorded there too."""
        snap_id = snapshot_id_for(files)
        for f in files:
            if not is_hex(f.sha256, SHA256_HEX):
                raise BlobMissingError(f"{f.path} has no blob: {f.sha256[:80]!r} is not a sha256 digest")
        with self.locked(), self.tree.held() as dirs:
            blob_dirs = self._blob_dirs(dirs)
            final = self.layout.snapshot(snap_id)
            if self.is_complete(snap_id):
                for f in files:
                    if _blob_size(blob_dirs, f.sha256) is None:
                        raise BlobMissingError(f"blob {f.sha256} for {f.path} vanished before publish")
                if before_commit is not None:
                    before_commit()
                if signature:
                    self.record_signature(snap_id, signature)
            else:
                self.tree.remove_tree(final)  # a tree without manifest: an interrupted publish; rebuild it
                tmp = self._build_tree(final, files, blob_dirs)
                if before_commit is not None:
                    try:
                        before_commit()
                    except BaseException:
                        self.tree.remove_tree(tmp)
                        raise
                self._commit_tree(tmp, final)
                self._write_manifest(Manifest(snap_id, ref.uri, ref.revision, time.time(), tuple(files),
                                              dict(checks or {}), dict(signature or {})))
                self._check_counts.pop(snap_id, None)
            self._index_snapshot(ref, snap_id, files)
            self._write_ref(ref, snap_id)
        size = sum(f.size for f in files)
        log.info("published %s as snapshot %s (%d files, %d bytes)", ref, snap_id, len(files), size)
        return self._published(snap_id, files, size)

    def _published(self, snap_id: str, files: builtins.list[FileEntry], size: int) -> Snapshot:
        """The snapshot just published, as get() reads it back, from the files in hand (the id is their digest:
        the same list) instead of re-reading and re-validating every index row."""
        rows = self.index.query("SELECT uri, revision FROM snapshots WHERE id=?", (snap_id,))
        if not rows or not self.is_complete(snap_id):
            return self.get(snap_id)  # evicted at once by another process: get() says so
        uri, revision = rows[0]
        return Snapshot(snap_id, self.layout.snapshot(snap_id), uri, revision, size,
                        tuple(sorted(files, key=lambda f: f.path)))

    def _build_tree(self, final: Path, files: builtins.list[FileEntry], blob_dirs: Callable[[str], int]) -> Path:
        """A temporary tree of hard links to the blobs, directories fsynced and made 0555; returns its path.

        Linking checks each blob: a missing one fails the link, and what was linked is checked to be regular files
        from the directory listings the walk reads anyway (no stat per file; nothing swapped in between a check
        and the link goes unseen). Either raises BlobMissingError (under the store lock: nothing evicts meanwhile).
        """
        tmp = tmp_name(final)
        with self.tree.dir(tmp.parent) as sfd:
            os.mkdir(tmp.name, 0o755, dir_fd=sfd)
            try:
                tfd = os.open(tmp.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=sfd)
                try:
                    with LinkTree(tfd) as links:
                        for f in files:
                            try:
                                links.link(blob_dirs(f.sha256), f.sha256, f.path)
                            except FileNotFoundError:
                                raise BlobMissingError(f"blob {f.sha256} for {f.path} vanished before publish") \
                                    from None
                    # every directory 0555 first (bottom up: the top one last), then fsynced: where the
                    # filesystem commits metadata in order, the top one's fsync makes the whole tree durable;
                    # elsewhere each one's (20 directories: 20 disk cache flushes, 3-4 ms each on a busy disk)
                    for _, _, _, dfd in os.fwalk(".", topdown=False, dir_fd=tfd):
                        _only_regular_files(dfd, tmp)
                        os.fchmod(dfd, 0o555)
                    if commits_in_order(tfd):
                        os.fsync(tfd)
                    else:
                        for _, _, _, dfd in os.fwalk(".", topdown=False, dir_fd=tfd):
                            os.fsync(dfd)
                finally:
                    os.close(tfd)
            except BaseException:
                self.tree.remove_tree(tmp)
                raise
        return tmp

    def _commit_tree(self, tmp: Path, final: Path) -> None:
        try:
            self.tree.rename(tmp, final)
        except BaseException:
            self.tree.remove_tree(tmp)
            raise

    def _write_manifest(self, manifest: Manifest) -> None:
        self.tree.write_atomic(self.layout.manifest(manifest.id), manifest_bytes(manifest), mode=0o444)

    def _index_snapshot(self, ref: ModelRef, snap_id: str, files: builtins.list[FileEntry]) -> None:
        created = time.time()

        def add(db: sqlite3.Connection) -> None:
            self.index.add_snapshot(db, snap_id, ref.uri, ref.revision, files, created)
            self.index.set_ref(db, ref.key, ref_name(ref), ref.uri, ref.revision, snap_id)

        self.index.write(add)

    def _write_ref(self, ref: ModelRef, snap_id: str) -> None:
        body = ref_bytes(RefRecord(snap_id, ref.uri, ref.revision), ref.include, ref.exclude)
        self.tree.write_atomic(self.layout.ref(ref.key, ref_name(ref)), body)

    def point(self, ref: ModelRef, snapshot_id: str) -> bool:
        """Point `ref` (its `refs/` name: `latest` for no revision) at a snapshot of the same selection already in
        the store; True when it moved. A rollout's switch (weightcache/kube/rollout.py) moves `latest` so that pods
        that name no revision get the revision the cluster serves; pods that run keep theirs through their leases."""
        with self.locked():
            snap = self.get(snapshot_id)
            if snap.uri != ref.uri or not all(ref.matches(f.path) for f in snap.files):
                raise ValueError(f"snapshot {snapshot_id[:12]} is not a snapshot of {ref}")
            if self._read_ref(ref) == snapshot_id:
                return False
            self.index.write(lambda db: self.index.set_ref(db, ref.key, ref_name(ref), ref.uri, ref.revision,
                                                           snapshot_id))
            self._write_ref(ref, snapshot_id)
        log.info("%s now names snapshot %s", ref, snapshot_id[:12])
        return True

    # -- leases and pins -----------------------------------------------------------------------------------------
    def lease(self, holder: str, snapshot_id: str) -> None:
        """Persist holder -> snapshot (idempotent for the same pair; a holder holds one snapshot)."""
        with self.locked():
            if not self.is_complete(snapshot_id):
                raise NotCachedError(f"cannot lease snapshot {snapshot_id[:80]}: it is not in the store (evicted?)")
            # not fsynced: leases track mounts and API holders, which a reboot ends; recovery reconciles them
            self.tree.write_atomic(self.layout.lease(holder), lease_bytes(snapshot_id), durable=False)
        self.index.touch(snapshot_id)

    def release(self, holder: str) -> None:
        """Drop a lease; no error when it does not exist."""
        self.tree.unlink(self.layout.lease(holder))

    def leases(self) -> dict[str, str]:
        """holder id -> snapshot id (a damaged lease file is quarantined and holds nothing)."""
        out = {}
        for name in self.tree.listdir(self.layout.leases):
            if name.startswith("."):
                continue
            path = self.layout.leases / name
            data = self.tree.read(path, limit=MAX_SMALL_RECORD_BYTES)
            if data is None:
                continue
            try:
                out[Layout.holder_of(path)] = parse_lease(data)
            except DamagedRecordError as exc:
                self.tree.quarantine(path, f"is not a valid lease ({exc})")
        return out

    def pin(self, snapshot_id: str, *, by: str = "user") -> None:
        self.get(snapshot_id)
        path = self.layout.pin(snapshot_id, by)
        with self.tree.dir(path.parent, create=True) as dfd:
            os.close(os.open(path.name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd))

    def unpin(self, snapshot_id: str, *, by: str | None = None) -> None:
        """Remove one owner's pin, or every pin when `by` is None."""
        d = self.layout.pin_dir(snapshot_id)
        with self.locked():
            if by is not None:
                self.tree.unlink(self.layout.pin(snapshot_id, by))
            if by is None or not self.tree.listdir(d):
                self.tree.remove_tree(d)

    def pins(self, snapshot_id: str) -> builtins.list[str]:
        return sorted(self.tree.listdir(self.layout.pin_dir(snapshot_id)))

    def is_pinned(self, snapshot_id: str) -> bool:
        return bool(self.pins(snapshot_id))

    # -- eviction ------------------------------------------------------------------------------------------------
    def evict(self, snapshot_id: str, *, past_floor: bool = False) -> None:
        """Remove a snapshot: refs, tree, unshared blobs; raises InUseError naming the leases/pins that hold it, or
        why the cluster keeps it (one of its last copies) unless `past_floor`: the disk is below its floor, the
        node's own health comes first, and the eviction is logged as such."""
        if not is_snapshot_id(snapshot_id):  # before any path is made of it
            raise NotCachedError(f"snapshot {snapshot_id[:80]!r} is not in the store at {self.root}: not a snapshot id")
        with self.locked():
            holders = sorted(h for h, s in self.leases().items() if s == snapshot_id)
            pins = self.pins(snapshot_id)
            if holders or pins:
                why = []
                if holders:
                    why.append(f"leased by {', '.join(holders)} (pods using it; unmount them first)")
                if pins:
                    why.append(f"pinned by {', '.join(pins)} (`weightcache unpin` or delete the ModelCache)")
                raise InUseError(f"snapshot {snapshot_id} is in use: {'; '.join(why)}")
            # only a cluster's keeper needs the listing (it reads the index; evict itself trusts only the manifest)
            kept = self.kept([i for i in self.list() if i.snapshot.id == snapshot_id]).get(snapshot_id) \
                if self.keeper is not None else None
            if kept and not past_floor:
                raise InUseError(f"snapshot {snapshot_id} is kept: {kept}")
            self._remove_snapshot(snapshot_id)
            if kept:
                log.warning("evicted snapshot %s although it is %s: the disk is below its free-space floor",
                            snapshot_id, kept)

    def kept(self, infos: builtins.list[SnapshotInfo]) -> dict[str, str]:
        """Of `infos`, those the cluster keeps (snapshot id -> why); none without a keeper or when it fails."""
        if self.keeper is None or not infos:
            return {}
        try:
            return self.keeper(infos)
        except Exception as exc:  # the cluster unreadable: evict as a node alone would, and say so
            log.warning("could not learn which snapshots are the cluster's last copies (%s); evicting as usual",
                        str(exc)[:200])
            return {}

    def _remove_snapshot(self, snapshot_id: str) -> None:
        """Commit the eviction by moving the manifest to evicting/ (a rename: no new bytes on a full disk), then
        finish it; a crash in between is finished by recovery."""
        if self.tree.lstat(self.layout.manifest(snapshot_id)) is not None:
            self.tree.rename(self.layout.manifest(snapshot_id), self.layout.eviction(snapshot_id))
        self.finish_eviction(snapshot_id)
        log.info("evicted snapshot %s", snapshot_id)

    def finish_eviction(self, snapshot_id: str, *, index: bool = True) -> None:
        """Delete what an eviction committed to remove, files first (they free the space the index write needs);
        `index=False` (recovery before the index is open) leaves the index rows and the record for later."""
        record = self.layout.eviction(snapshot_id)
        manifest = self.read_manifest(record, snapshot_id)
        if manifest is not None:
            shas = {f.sha256 for f in manifest.files}
        else:
            shas = {f.sha256 for f in self._files(snapshot_id)} if index else set()
        for ref_file in recovery.ref_files(self):
            found = self.read_ref_file(ref_file)
            if found is not None and found.snapshot == snapshot_id:
                self.tree.unlink(ref_file)
        self.tree.remove_tree(self.layout.snapshot(snapshot_id))
        self.tree.remove_tree(self.root / "hf" / snapshot_id)  # its hub cache views (hf_layout): links, too
        for sha in shas:
            self.tree.unlink_if_single_link(self.layout.blob(sha))
        if index:
            self.index.write(lambda db: self.index.remove_snapshot(db, snapshot_id))
            self.tree.unlink(record)

    def evict_to(self, target_bytes: int, *, keep: frozenset[str] = frozenset(), best_effort: bool = False,
                 used: int | None = None, past_floor: bool = False) -> builtins.list[str]:
        """LRU-evict unleased, unpinned snapshots until used bytes <= target; returns evicted ids.

        `best_effort` evicts every candidate when even that cannot reach the target, instead of raising.
        `used`: the bytes measured against the target when they are not the whole store's (the engine caches'
        own budget: their bytes, every other snapshot in `keep`). The cluster's last copies (`kept`) stay,
        unless `past_floor` (restore_floor, once the others are gone).
        """
        infos = self.list()
        if not past_floor:
            keep = keep | frozenset(self.kept(infos))
        plan = plan_eviction(infos, used_bytes=self.used_bytes() if used is None else used,
                             target_bytes=target_bytes, keep=keep, best_effort=best_effort)
        done = []
        for snap_id in plan:
            try:
                self.evict(snap_id, past_floor=past_floor)
                done.append(snap_id)
            except InUseError as exc:  # leased since we planned: skip it, the caller re-checks space
                log.info("skipping eviction: %s", exc)
        return done

    # -- space ---------------------------------------------------------------------------------------------------
    @property
    def budget_bytes(self) -> int | None:
        return self.limits.budget_bytes

    @property
    def min_free_bytes(self) -> int:
        return floor.defaulted(self.limits)[0]

    @property
    def min_free_percent(self) -> float:
        return floor.defaulted(self.limits)[1]

    def set_limits(self, *, budget_bytes: int | None, min_free_bytes: int, min_free_percent: float,
                   set_by: str) -> None:
        """Set the floor and budget (the daemon's config, live) and keep them with the store for every command."""
        self.limits = floor.SpaceLimits(min_free_bytes, min_free_percent, budget_bytes, set_by)
        floor.write_limits(self.layout, self.limits)

    def floor_bytes(self, disk_size: int) -> int:
        """Bytes the store keeps free on its filesystem: max(min_free_bytes, min_free_percent of the disk)."""
        return max(self.min_free_bytes, int(disk_size * self.min_free_percent / 100))

    def ensure_space(self, needed: int, *, uri: str, already: int = 0,
                     evictable: Callable[[Snapshot], bool] | None = None) -> None:
        """Make room for `needed` new bytes within the budget and above the free-space floor, evicting LRU;
        fail before any download. `already`: bytes of `needed` the writer has written (a writer that grows as its
        bytes arrive, intake.Room): the budget counts them, the disk's free space lacks them already.
        `evictable`: which snapshots may go to make room (None: any unleased, unpinned one)."""
        if needed <= 0:
            return
        used = self.used_bytes()
        free_disk, disk_size = disk_free(self.root)
        limit = used + free_disk + already - self.floor_bytes(disk_size)
        if self.budget_bytes is not None:
            limit = min(limit, self.budget_bytes)
        if used + needed <= limit:
            return
        target = limit - needed
        try:
            if target < 0:
                raise InsufficientSpaceError("model larger than the budget or the disk above its free-space floor")
            keep = frozenset() if evictable is None else frozenset(
                i.snapshot.id for i in self.list() if not evictable(i.snapshot))
            self.evict_to(target, keep=keep)
        except InsufficientSpaceError as exc:
            raise InsufficientSpaceError(
                f"{uri} needs {fmt_bytes(needed)} more, but the store at {self.root} uses {fmt_bytes(used)} of a "
                f"{'budget of ' + fmt_bytes(self.budget_bytes) if self.budget_bytes is not None else 'disk'} with "
                f"{fmt_bytes(free_disk)} free on disk and keeps {fmt_bytes(self.floor_bytes(disk_size))} free "
                f"(minFreeBytes/minFreePercent), and eviction cannot free enough ({exc}); "
                f"raise the disk budget, free disk space, or evict/unpin models") from None
        if self.used_bytes() + needed > limit:
            raise InsufficientSpaceError(
                f"{uri} needs {fmt_bytes(needed)} but only {fmt_bytes(max(0, limit - self.used_bytes()))} can be "
                f"made free in the store at {self.root}; evict or unpin models, or raise the disk budget")

    def floor_deficit(self) -> int:
        """Bytes the filesystem lacks to be at the free-space floor (<= 0: at or above it)."""
        free_disk, disk_size = disk_free(self.root)
        return self.floor_bytes(disk_size) - free_disk

    def restore_floor(self) -> builtins.list[str]:
        """When the filesystem is below the floor (filled by anyone), evict LRU snapshots to give space back."""
        free_disk, disk_size = disk_free(self.root)
        deficit = self.floor_bytes(disk_size) - free_disk
        if deficit <= 0:
            return []
        gone = self.evict_to(max(0, self.used_bytes() - deficit), best_effort=True)
        short = self.floor_deficit()
        if short > 0:  # the cluster's last copies too: the node's disk comes first
            gone += self.evict_to(max(0, self.used_bytes() - short),
                                  best_effort=True, past_floor=True)
        if gone:
            log.warning("the disk under %s had %s free, below the floor of %s: evicted %d snapshot(s)", self.root,
                        fmt_bytes(free_disk), fmt_bytes(self.floor_bytes(disk_size)), len(gone))
        return gone

    def keep_reserve(self) -> None:
        """Preallocate the reserve file again once the disk has room for it twice over (see RESERVE_BYTES)."""
        if self.tree.lstat(self.layout.reserve) is not None or disk_free(self.root)[0] < 2 * RESERVE_BYTES:
            return
        with self.tree.dir(self.root) as dfd:
            try:
                fd = os.open(self.layout.reserve.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                             dir_fd=dfd)
            except FileExistsError:  # another process opening the store made it since the look above (a fresh
                return  # node's pods starting at once): one reserve is all it takes, and that one is being made
            try:
                os.posix_fallocate(fd, 0, RESERVE_BYTES)
            except OSError:
                os.unlink(self.layout.reserve.name, dir_fd=dfd)
            finally:
                os.close(fd)

    def _release_reserve(self) -> bool:
        released = self.tree.unlink(self.layout.reserve)
        if released:
            log.warning("the disk under %s is full: released the %s reserve to keep the store working",
                        self.root, fmt_bytes(RESERVE_BYTES))
        return released


def disk_free(path: Path) -> tuple[int, int]:
    """(bytes available to us, size of the filesystem)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _row_entry(row: tuple[object, ...]) -> FileEntry:
    """An index row as a checked FileEntry: the index is derived data, but a path or digest from it must not
    lead outside the root either."""
    entry = file_entry(dict(zip(("path", "size", "sha256", "etag", "version_id"), row, strict=True)))
    try:
        validate_relpath(entry.path)
    except HostileKeyError as exc:
        raise DamagedRecordError(f"index row: {exc}; delete index.db to rebuild it from the tree") from None
    return entry


def _blob_size(blob_dirs: Callable[[str], int], sha256: str) -> int | None:
    """Size of the blob (not followed); None when it or its directory is missing, or it is no regular file."""
    try:
        st = os.stat(sha256, dir_fd=blob_dirs(sha256), follow_symlinks=False)
    except FileNotFoundError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _only_regular_files(dir_fd: int, tree: Path) -> None:
    """Every entry of the directory is a directory or a regular file (the type its listing gives: no stat where
    the filesystem reports types); a blob found to be anything else was planted (a symlink) and is not linked."""
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False) and not entry.is_file(follow_symlinks=False):
                raise BlobMissingError(f"{entry.name} in {tree} would link a blob that is not a regular file "
                                       f"(planted?); run `weightcache verify` and fetch again")


def _sealed_inode(dir_fd: int, name: str, *, durable: bool) -> int:
    """The inode of regular file `name`, made 0444 (and fsynced when `durable`) through a descriptor opened
    without following; a file already 0444 and not to be synced only needs an lstat."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o444 and not durable:
        return st.st_ino
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)  # ELOOP: a link
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{name} is not a regular file; it cannot become a blob")
        os.fchmod(fd, 0o444)
        if durable:
            os.fsync(fd)
        return st.st_ino
    finally:
        os.close(fd)


def _like_prefix(text: str) -> str:
    """A LIKE pattern matching `text` literally as a prefix (ids are hex: anything else matches nothing)."""
    return text + "%" if all(c in "0123456789abcdef" for c in text) else "\0"


__all__ = ["TMP_PREFIX", "BlobMissingError", "Store", "disk_free", "ref_name"]
