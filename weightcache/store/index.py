"""SQLite index over the store tree: fast listing, LRU times, blob sharing. Derived data only.

The tree (manifests/, refs/) is the truth. `sync_from_tree` makes the index agree with it at startup, and a
missing or damaged index.db is moved aside and rebuilt, losing nothing but last-used times.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from weightcache.store.types import FileEntry

log = logging.getLogger(__name__)

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


class Index:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.RLock()
        self._db = self._open()

    def _open(self) -> sqlite3.Connection:
        try:
            db = self._connect()
            if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                raise sqlite3.DatabaseError("quick_check failed")
            return db
        except sqlite3.DatabaseError as exc:
            aside = self.path.with_name(f"index.db.damaged-{int(time.time())}")
            log.warning("index %s is damaged (%s); moved to %s and rebuilding from the tree", self.path, exc, aside)
            for suffix in ("", "-wal", "-shm"):
                p = Path(str(self.path) + suffix)
                if p.exists():
                    p.rename(Path(str(aside) + suffix))
            return self._connect()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
        return db

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def query(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- writes ---------------------------------------------------------------------------------------------
    def add_snapshot(self, db: sqlite3.Connection, snapshot_id: str, uri: str, revision: str | None,
                     files: Iterable[FileEntry], created: float, last_used: float | None = None) -> None:
        files = list(files)
        db.execute("INSERT OR IGNORE INTO snapshots VALUES (?,?,?,?,?,?,?)",
                   (snapshot_id, uri, revision, sum(f.size for f in files), len(files), created,
                    last_used if last_used is not None else created))
        db.executemany("INSERT OR IGNORE INTO files VALUES (?,?,?,?,?,?)",
                       [(snapshot_id, f.path, f.size, f.sha256, f.etag, f.version_id) for f in files])

    def remove_snapshot(self, db: sqlite3.Connection, snapshot_id: str) -> None:
        db.execute("DELETE FROM snapshots WHERE id=?", (snapshot_id,))
        db.execute("DELETE FROM files WHERE snapshot_id=?", (snapshot_id,))
        db.execute("DELETE FROM refs WHERE snapshot_id=?", (snapshot_id,))

    def set_ref(self, db: sqlite3.Connection, model_key: str, name: str, uri: str, revision: str | None,
                snapshot_id: str) -> None:
        db.execute("INSERT OR REPLACE INTO refs VALUES (?,?,?,?,?)", (model_key, name, uri, revision, snapshot_id))

    def touch(self, snapshot_id: str, when: float | None = None) -> None:
        with self._lock:
            self._db.execute("UPDATE snapshots SET last_used=? WHERE id=?", (when or time.time(), snapshot_id))
