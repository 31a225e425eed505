"""SQLite index over the store tree: fast listing, LRU times, blob sharing. Derived data only.

The tree (manifests/, refs/) is the truth: recovery (weightcache.store.recovery) makes the index agree with it at
startup. An index.db that is missing, damaged, a symlink, or of another schema is moved to quarantine/ and
rebuilt from the tree, losing nothing but last-used times. A full disk is not damage: the store's `on_full`
callback gets room (it releases the reserve file) and the write is tried once more.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from weightcache.errors import InsufficientSpaceError
from weightcache.store.floor import full_disk_advice
from weightcache.store.fsops import Tree
from weightcache.store.types import FileEntry

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1  # PRAGMA user_version of the index this code writes
SCHEMA = """
CREATE TABLE IF NOT EXISTS snapshots (
  id TEXT PRIMARY KEY, uri TEXT NOT NULL, revision TEXT, size INTEGER NOT NULL, nfiles INTEGER NOT NULL,
  created REAL NOT NULL, last_used REAL NOT NULL);
CREATE TABLE IF NOT EXISTS files (
  snapshot_id TEXT NOT NULL, path TEXT NOT NULL, size INTEGER NOT NULL, sha256 TEXT NOT NULL, etag TEXT,
  version_id TEXT, PRIMARY KEY (snapshot_id, path));
CREATE INDEX IF NOT EXISTS files_sha ON files (sha256);
CREATE TABLE IF NOT EXISTS refs (
  model_key TEXT NOT NULL, name TEXT NOT NULL, uri TEXT NOT NULL, revision TEXT, snapshot_id TEXT NOT NULL,
  PRIMARY KEY (model_key, name));
"""
COLUMNS = {
    "snapshots": ["id", "uri", "revision", "size", "nfiles", "created", "last_used"],
    "files": ["snapshot_id", "path", "size", "sha256", "etag", "version_id"],
    "refs": ["model_key", "name", "uri", "revision", "snapshot_id"],
}
Row = tuple[Any, ...]


FULL_BELOW_BYTES = 1 << 20  # an I/O error with less than this free is the disk being full, not damage


def is_disk_full(exc: BaseException, path: Path) -> bool:
    """SQLITE_FULL, or any I/O error while the filesystem under `path` has (almost) nothing free: SQLite reports
    a failed -shm or WAL extension as a disk I/O error, and a full disk must never look like a damaged index."""
    if not isinstance(exc, sqlite3.Error):
        return False
    if getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "disk is full" in str(exc):
        return True
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize < FULL_BELOW_BYTES


class Index:
    def __init__(self, path: Path, tree: Tree, on_full: Callable[[], bool] = lambda: False) -> None:
        self.path = path
        self._tree = tree
        self._on_full = on_full
        self._lock = threading.RLock()
        self._db = self._retry_when_full(self._open)

    # -- opening --------------------------------------------------------------------------------------------
    def _open(self) -> sqlite3.Connection:
        try:
            return self._open_checked()
        except sqlite3.DatabaseError as exc:
            if is_disk_full(exc, self.path.parent):
                raise
            self._move_aside(str(exc))
            return self._open_checked()

    def _open_checked(self) -> sqlite3.Connection:
        self._refuse_planted_files()
        db = self._connect()
        try:
            self._check(db)
        except BaseException:
            db.close()
            raise
        return db

    def _refuse_planted_files(self) -> None:
        """SQLite follows symlinks: index.db, -wal and -shm must be regular files we made, or absent."""
        for suffix in ("", "-wal", "-shm"):
            st = self._tree.lstat(Path(str(self.path) + suffix))
            if st is not None and not stat.S_ISREG(st.st_mode):
                raise sqlite3.DatabaseError(f"index.db{suffix} is not a regular file")

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
        except BaseException:
            db.close()
            raise
        return db

    def _check(self, db: sqlite3.Connection) -> None:
        """Refuse a damaged index or one of another schema (a foreign file, an older or newer weightcache)."""
        if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
            raise sqlite3.DatabaseError("quick_check failed")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if version == 0 and not tables:
            db.executescript(SCHEMA)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            return
        if version not in (0, SCHEMA_VERSION):
            raise sqlite3.DatabaseError(f"schema version {version}, this weightcache writes {SCHEMA_VERSION}")
        for table, columns in COLUMNS.items():
            found = [row[1] for row in db.execute(f"PRAGMA table_info({table})")]
            if found != columns:
                raise sqlite3.DatabaseError(f"table {table} has columns {found}, expected {columns}")
        if version == 0:  # made before the version stamp, same tables
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def _move_aside(self, why: str) -> None:
        log.warning("index %s is unusable (%s); moving it to quarantine and rebuilding it from the tree",
                    self.path, why)
        for suffix in ("", "-wal", "-shm"):
            self._tree.quarantine(Path(str(self.path) + suffix), f"is unusable as the index ({why})")

    # -- access ---------------------------------------------------------------------------------------------
    def write(self, fn: Callable[[sqlite3.Connection], None]) -> None:
        """Run `fn` in one immediate transaction; on a full disk, get room once and run it again."""
        def attempt() -> None:
            with self._lock:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    fn(self._db)
                    self._db.execute("COMMIT")
                except BaseException:
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                    raise

        self._retry_when_full(attempt)

    def _retry_when_full(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except sqlite3.Error as exc:
            if not is_disk_full(exc, self.path.parent):
                raise
            if self._on_full():
                try:
                    return fn()
                except sqlite3.Error as again:
                    if not is_disk_full(again, self.path.parent):
                        raise
            raise InsufficientSpaceError(
                f"the disk under {self.path.parent} is full and the store's index cannot be written; "
                f"{full_disk_advice(self.path.parent)}") from None

    def stored_bytes(self) -> int:
        """Bytes of the blobs the store's snapshots link, each once (a read: it works on a full disk too)."""
        rows = self.query("SELECT COALESCE(SUM(size), 0) FROM (SELECT DISTINCT sha256, size FROM files)")
        return int(rows[0][0])

    def query(self, sql: str, args: tuple[Any, ...] = ()) -> list[Row]:
        with self._lock:
            rows: list[Row] = self._db.execute(sql, args).fetchall()
            return rows

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- writes (inside `write`) ----------------------------------------------------------------------------
    @staticmethod
    def add_snapshot(db: sqlite3.Connection, snapshot_id: str, uri: str, revision: str | None,
                     files: Iterable[FileEntry], created: float, last_used: float | None = None) -> None:
        files = list(files)
        db.execute("INSERT OR IGNORE INTO snapshots VALUES (?,?,?,?,?,?,?)",
                   (snapshot_id, uri, revision, sum(f.size for f in files), len(files), created,
                    last_used if last_used is not None else created))
        db.executemany("INSERT OR IGNORE INTO files VALUES (?,?,?,?,?,?)",
                       [(snapshot_id, f.path, f.size, f.sha256, f.etag, f.version_id) for f in files])

    @staticmethod
    def remove_snapshot(db: sqlite3.Connection, snapshot_id: str) -> None:
        db.execute("DELETE FROM snapshots WHERE id=?", (snapshot_id,))
        db.execute("DELETE FROM files WHERE snapshot_id=?", (snapshot_id,))
        db.execute("DELETE FROM refs WHERE snapshot_id=?", (snapshot_id,))

    @staticmethod
    def set_ref(db: sqlite3.Connection, model_key: str, name: str, uri: str, revision: str | None,
                snapshot_id: str) -> None:
        db.execute("INSERT OR REPLACE INTO refs VALUES (?,?,?,?,?)", (model_key, name, uri, revision, snapshot_id))

    def touch(self, snapshot_id: str, when: float | None = None) -> None:
        """Record a use (LRU order). Best effort on a full disk: a lost time must not fail a cache hit."""
        try:
            with self._lock:
                self._db.execute("UPDATE snapshots SET last_used=? WHERE id=?", (when or time.time(), snapshot_id))
        except sqlite3.Error as exc:
            if not is_disk_full(exc, self.path.parent):
                raise
            log.warning("could not record the use of snapshot %s: the disk is full", snapshot_id)
