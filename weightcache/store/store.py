"""Store: the public face of the on-disk cache (layout in weightcache.store.layout).

Every change is an atomic rename of a fully written, fsynced file; a manifest written last marks a snapshot
complete. Short critical sections (publish, lease, evict) take the store-wide flock `locks/store.lock`, so a
lease can never be granted on a snapshot that an eviction in another process is removing.
"""

from __future__ import annotations

import builtins
import fcntl
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from weightcache.errors import InsufficientSpaceError, InUseError, NotCachedError, StoreError
from weightcache.store.evict import plan_eviction
from weightcache.store.index import Index
from weightcache.store.layout import Layout, fsync_dir, tmp_name, write_atomic
from weightcache.store.types import FileEntry, Snapshot, SnapshotInfo
from weightcache.units import fmt_bytes
from weightcache.uri import ModelRef

log = logging.getLogger(__name__)

MANIFEST_VERSION = 1


class BlobMissingError(StoreError):
    """A blob the fetch planned to reuse vanished before publish (evicted meanwhile): plan again."""


def snapshot_id_for(files: Iterable[FileEntry]) -> str:
    """Digest of (path, size, sha256) of every file: the same tree gets the same id, whoever fetched it."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.path):
        h.update(f"{f.path}\0{f.size}\0{f.sha256}\n".encode())
    return h.hexdigest()[:40]


def _crash_point(name: str) -> None:
    """Tests kill the process here (WEIGHTCACHE_CRASH_AT=<name>) to prove every publish step recovers."""
    if os.environ.get("WEIGHTCACHE_CRASH_AT") == name:
        os._exit(137)


def ref_name(ref: ModelRef) -> str:
    return ref.revision or "latest"


class Store:
    """Thread-safe and multi-process-safe. Constructing one creates the layout and runs startup recovery."""

    def __init__(self, root: str | Path, *, budget_bytes: int | None = None, recover: bool = True) -> None:
        self.layout = Layout(root)
        self.root = self.layout.root
        self.budget_bytes = budget_bytes
        self.layout.create()
        self._tlock = threading.RLock()
        self.index = Index(self.layout.index)
        if recover:
            from weightcache.store.recovery import recover as run_recovery

            run_recovery(self)

    def close(self) -> None:
        self.index.close()

    # -- locking ----------------------------------------------------------------------------------------------
    @contextmanager
    def locked(self) -> Iterator[None]:
        """Store-wide exclusive section, across threads and processes. Keep it short."""
        with self._tlock:
            fd = os.open(self.layout.lock("store"), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)

    # -- reading ----------------------------------------------------------------------------------------------
    def lookup(self, ref: ModelRef) -> Snapshot | None:
        """The snapshot `ref` resolves to (refs/ or a snapshot id as revision), touching last_used; None if absent."""
        snap_id = self._read_ref(ref)
        if snap_id is None and ref.revision:
            snap_id = self._snapshot_by_id_prefix(ref.revision, ref.uri)
        if snap_id is None:
            return None
        try:
            snap = self.get(snap_id)
        except NotCachedError:
            return None
        self.index.touch(snap_id)
        return snap

    def _read_ref(self, ref: ModelRef) -> str | None:
        try:
            data = json.loads(self.layout.ref(ref.key, ref_name(ref)).read_text())
        except (FileNotFoundError, ValueError):
            return None
        return str(data.get("snapshot")) or None

    def _snapshot_by_id_prefix(self, prefix: str, uri: str) -> str | None:
        if len(prefix) < 8:
            return None
        rows = self.index.query("SELECT DISTINCT snapshot_id FROM refs WHERE uri=? AND snapshot_id LIKE ?",
                                (uri, prefix + "%"))
        return rows[0][0] if len(rows) == 1 else None

    def get(self, snapshot_id: str) -> Snapshot:
        """A snapshot by id; raises NotCachedError."""
        rows = self.index.query("SELECT uri, revision FROM snapshots WHERE id=?", (snapshot_id,))
        if not rows or not self.layout.manifest(snapshot_id).exists():
            raise NotCachedError(f"snapshot {snapshot_id} is not in the store at {self.root}; see `weightcache ls`")
        files = self._files(snapshot_id)
        uri, revision = rows[0]
        return Snapshot(snapshot_id, self.layout.snapshot(snapshot_id), uri, revision,
                        sum(f.size for f in files), files)

    def _files(self, snapshot_id: str) -> tuple[FileEntry, ...]:
        rows = self.index.query(
            "SELECT path, size, sha256, etag, version_id FROM files WHERE snapshot_id=? ORDER BY path",
            (snapshot_id,))
        return tuple(FileEntry(*r) for r in rows)

    def find(self, text: str) -> builtins.list[Snapshot]:
        """Snapshots matching a reference string, a snapshot id or an id prefix (for the CLI)."""
        from weightcache.uri import parse_ref

        rows = self.index.query("SELECT id FROM snapshots WHERE id LIKE ?", (text + "%",)) if len(text) >= 8 else []
        if not rows and "://" in text:
            ref = parse_ref(text)
            if ref.revision:
                snap = self.lookup(ref)
                return [snap] if snap else []
            rows = self.index.query("SELECT DISTINCT snapshot_id FROM refs WHERE uri=?", (ref.uri,))
        return [self.get(r[0]) for r in rows]

    def list(self) -> list[SnapshotInfo]:
        leases: dict[str, list[str]] = {}
        for holder, snap_id in self.leases().items():
            leases.setdefault(snap_id, []).append(holder)
        refs: dict[str, list[str]] = {}
        for uri, rev, snap_id in self.index.query("SELECT uri, revision, snapshot_id FROM refs ORDER BY uri"):
            refs.setdefault(snap_id, []).append(uri + (f"@{rev}" if rev else ""))
        files: dict[str, list[FileEntry]] = {}
        for sid, *rest in self.index.query(
                "SELECT snapshot_id, path, size, sha256, etag, version_id FROM files ORDER BY snapshot_id, path"):
            files.setdefault(sid, []).append(FileEntry(*rest))
        shared = {sha for (sha,) in self.index.query(
            "SELECT sha256 FROM files GROUP BY sha256 HAVING COUNT(DISTINCT snapshot_id) > 1")}
        infos = []
        for sid, uri, rev, size, last_used in self.index.query(
                "SELECT id, uri, revision, size, last_used FROM snapshots ORDER BY uri, created"):
            fl = tuple(files.get(sid, ()))
            unique = sum(f.size for f in {f.sha256: f for f in fl if f.sha256 not in shared}.values())
            infos.append(SnapshotInfo(Snapshot(sid, self.layout.snapshot(sid), uri, rev, size, fl),
                                      tuple(refs.get(sid, ())), last_used, self.is_pinned(sid),
                                      tuple(sorted(leases.get(sid, ()))), unique))
        return infos

    def used_bytes(self) -> int:
        rows = self.index.query("SELECT COALESCE(SUM(size), 0) FROM (SELECT DISTINCT sha256, size FROM files)")
        return int(rows[0][0])

    # -- blobs and publish ---------------------------------------------------------------------------------------
    def has_blob(self, sha256: str) -> bool:
        return self.layout.blob(sha256).exists()

    def known_sha256(self, uri: str, path: str, etag: str | None, size: int) -> str | None:
        """sha256 of a file we already hold with the same source ETag and size (skips re-downloading it)."""
        if not etag:
            return None
        rows = self.index.query(
            "SELECT f.sha256 FROM files f JOIN snapshots s ON s.id = f.snapshot_id "
            "WHERE s.uri=? AND f.path=? AND f.etag=? AND f.size=? LIMIT 1", (uri, path, etag, size))
        return rows[0][0] if rows and self.has_blob(rows[0][0]) else None

    def add_blob(self, path: Path, sha256: str) -> None:
        """Move a fully written, verified file into blobs/ (0444); a blob that exists already wins (dedup)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fchmod(fd, 0o444)
            os.fsync(fd)
        finally:
            os.close(fd)
        blob = self.layout.blob(sha256)
        blob.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, blob)
            fsync_dir(blob.parent)
        except FileExistsError:
            pass
        path.unlink()

    def publish(self, ref: ModelRef, files: builtins.list[FileEntry]) -> Snapshot:
        """Build the snapshot tree from blobs, rename it into place, write the manifest, index it, point the ref."""
        snap_id = snapshot_id_for(files)
        with self.locked():
            for f in files:
                if not self.has_blob(f.sha256):
                    raise BlobMissingError(f"blob {f.sha256} for {f.path} vanished before publish")
            final = self.layout.snapshot(snap_id)
            if not self.layout.manifest(snap_id).exists():
                if final.exists():  # a tree without manifest: an interrupted publish; rebuild it
                    remove_tree(final)
                self._build_tree(final, files)
                _crash_point("tree_renamed")
                manifest = {"version": MANIFEST_VERSION, "id": snap_id, "uri": ref.uri, "revision": ref.revision,
                            "created": time.time(), "files": [f.__dict__ for f in files]}
                write_atomic(self.layout.manifest(snap_id), json.dumps(manifest, indent=1).encode(), mode=0o444)
                _crash_point("manifest_written")
            created = time.time()
            with self.index.tx() as db:
                self.index.add_snapshot(db, snap_id, ref.uri, ref.revision, files, created)
                self.index.set_ref(db, ref.key, ref_name(ref), ref.uri, ref.revision, snap_id)
            _crash_point("indexed")
            self._write_ref(ref, snap_id)
        log.info("published %s as snapshot %s (%d files, %d bytes)", ref, snap_id, len(files),
                 sum(f.size for f in files))
        return self.get(snap_id)

    def _write_ref(self, ref: ModelRef, snap_id: str) -> None:
        body = {"snapshot": snap_id, "uri": ref.uri, "revision": ref.revision,
                "include": list(ref.include), "exclude": list(ref.exclude)}
        write_atomic(self.layout.ref(ref.key, ref_name(ref)), json.dumps(body).encode())

    def _build_tree(self, final: Path, files: builtins.list[FileEntry]) -> None:
        tmp = tmp_name(final)
        tmp.mkdir(mode=0o755)
        try:
            for f in files:
                dest = tmp / f.path
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.link(self.layout.blob(f.sha256), dest)
            dirs = sorted((p for p in tmp.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
            for d in dirs:
                fsync_dir(d)
                d.chmod(0o555)
            fsync_dir(tmp)
            tmp.chmod(0o555)
            _crash_point("tree_built")
            os.rename(tmp, final)
            fsync_dir(final.parent)
        except BaseException:
            remove_tree(tmp)
            raise

    # -- leases and pins -----------------------------------------------------------------------------------------
    def lease(self, holder: str, snapshot_id: str) -> None:
        """Persist holder -> snapshot (idempotent for the same pair; a holder holds one snapshot)."""
        with self.locked():
            if not self.layout.manifest(snapshot_id).exists():
                raise NotCachedError(f"cannot lease snapshot {snapshot_id}: it is not in the store (evicted?)")
            # not fsynced: leases track mounts and API holders, which a reboot ends; recovery reconciles them
            write_atomic(self.layout.lease(holder), (snapshot_id + "\n").encode(), durable=False)
        self.index.touch(snapshot_id)

    def release(self, holder: str) -> None:
        """Drop a lease; no error when it does not exist."""
        self.layout.lease(holder).unlink(missing_ok=True)

    def leases(self) -> dict[str, str]:
        """holder id -> snapshot id."""
        out = {}
        for p in self.layout.leases.iterdir():
            if p.name.startswith("."):
                continue
            try:
                out[Layout.holder_of(p)] = p.read_text().strip()
            except FileNotFoundError:
                continue
        return out

    def pin(self, snapshot_id: str, *, by: str = "user") -> None:
        self.get(snapshot_id)
        path = self.layout.pin(snapshot_id, by)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()

    def unpin(self, snapshot_id: str, *, by: str | None = None) -> None:
        """Remove one owner's pin, or every pin when `by` is None."""
        d = self.layout.pins / snapshot_id
        if by is not None:
            self.layout.pin(snapshot_id, by).unlink(missing_ok=True)
        else:
            shutil.rmtree(d, ignore_errors=True)
        if d.exists() and not any(d.iterdir()):
            d.rmdir()

    def pins(self, snapshot_id: str) -> builtins.list[str]:
        d = self.layout.pins / snapshot_id
        return sorted(p.name for p in d.iterdir()) if d.exists() else []

    def is_pinned(self, snapshot_id: str) -> bool:
        return bool(self.pins(snapshot_id))

    # -- eviction ------------------------------------------------------------------------------------------------
    def evict(self, snapshot_id: str) -> None:
        """Remove refs -> snapshot -> unshared blobs; raises InUseError naming the leases/pin that hold it."""
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
            self._remove_snapshot(snapshot_id)

    def _remove_snapshot(self, snapshot_id: str) -> None:
        rows = self.index.query("SELECT model_key, name FROM refs WHERE snapshot_id=?", (snapshot_id,))
        for model_key, name in rows:
            self.layout.ref(model_key, name).unlink(missing_ok=True)
        blobs = {f.sha256 for f in self._files(snapshot_id)}
        self.layout.manifest(snapshot_id).unlink(missing_ok=True)  # from here on the snapshot is incomplete
        remove_tree(self.layout.snapshot(snapshot_id))
        with self.index.tx() as db:
            self.index.remove_snapshot(db, snapshot_id)
        for sha in blobs:
            remove_orphan_blob(self.layout.blob(sha))
        log.info("evicted snapshot %s", snapshot_id)

    def evict_to(self, target_bytes: int, *, keep: frozenset[str] = frozenset()) -> builtins.list[str]:
        """LRU-evict unleased, unpinned snapshots until used bytes <= target; returns evicted ids."""
        plan = plan_eviction(self.list(), used_bytes=self.used_bytes(), target_bytes=target_bytes, keep=keep)
        done = []
        for snap_id in plan:
            try:
                self.evict(snap_id)
                done.append(snap_id)
            except InUseError as exc:  # leased since we planned: skip it, the caller re-checks space
                log.info("skipping eviction: %s", exc)
        return done

    def ensure_space(self, needed: int, *, uri: str) -> None:
        """Make room for `needed` new bytes within the budget and on the disk, evicting LRU; fail before any download."""
        if needed <= 0:
            return
        used = self.used_bytes()
        free_disk, disk_size = disk_free(self.root)
        reserve = min(64 << 20, disk_size // 50)  # headroom for manifests, index and other writers
        limit = used + free_disk - reserve
        if self.budget_bytes is not None:
            limit = min(limit, self.budget_bytes)
        if used + needed <= limit:
            return
        target = limit - needed
        try:
            if target < 0:
                raise InsufficientSpaceError("model larger than the budget")
            self.evict_to(target)
        except InsufficientSpaceError as exc:
            raise InsufficientSpaceError(
                f"{uri} needs {fmt_bytes(needed)} more, but the store at {self.root} uses {fmt_bytes(used)} of a "
                f"{'budget of ' + fmt_bytes(self.budget_bytes) if self.budget_bytes is not None else 'disk'} with "
                f"{fmt_bytes(free_disk)} free on disk, and eviction cannot free enough ({exc}); "
                f"raise the disk budget, free disk space, or evict/unpin models") from None
        if self.used_bytes() + needed > limit:
            raise InsufficientSpaceError(
                f"{uri} needs {fmt_bytes(needed)} but only {fmt_bytes(max(0, limit - self.used_bytes()))} can be "
                f"made free in the store at {self.root}; evict or unpin models, or raise the disk budget")


def disk_free(path: Path) -> tuple[int, int]:
    """(bytes available to us, size of the filesystem)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def remove_tree(path: Path) -> None:
    """rmtree that first makes our 0555 directories writable again."""
    if not path.exists():
        return
    for d in [path, *(p for p in path.rglob("*") if p.is_dir() and not p.is_symlink())]:
        try:
            d.chmod(0o755)
        except OSError:
            pass
    shutil.rmtree(path, ignore_errors=True)


def remove_orphan_blob(blob: Path) -> bool:
    """Delete a blob no snapshot links any more (link count 1: only blobs/ holds it)."""
    try:
        if blob.stat().st_nlink == 1:
            blob.unlink()
            return True
    except FileNotFoundError:
        pass
    return False


def verify_snapshot(store: Store, snapshot_id: str, *, chunk: int = 8 << 20) -> list[str]:
    """Re-hash every file of a snapshot against its manifest digest; returns the paths that do not match."""
    snap = store.get(snapshot_id)
    bad = []
    buf = memoryview(bytearray(chunk))
    for f in snap.files:
        h = hashlib.sha256()
        try:
            with open(snap.path / f.path, "rb", buffering=0) as fh:
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
        shas = {f.sha256 for f in snap.files if f.path in bad_paths}
        store.unpin(snapshot_id)
        store._remove_snapshot(snapshot_id)
        for sha in shas:
            store.layout.blob(sha).unlink(missing_ok=True)
    return refs


def collect_garbage(store: Store) -> int:
    """Remove blobs no snapshot links and partial downloads no fetch holds; returns bytes freed."""
    freed = 0
    with store.locked():
        for blob in store.layout.blobs.rglob("*"):
            if blob.is_file():
                size = blob.stat().st_size
                if remove_orphan_blob(blob):
                    freed += size
    busy = set()
    for lock in store.layout.locks.glob("m*.lock"):
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            busy.add(lock.stem)
        finally:
            os.close(fd)
    for p in store.layout.partial.iterdir():
        if p.name.split(".")[0] not in busy:
            freed += p.stat().st_size
            p.unlink(missing_ok=True)
    return freed
