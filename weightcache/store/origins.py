"""What this node's index says it fetched, for its peer server: read-only, on a connection of the reader's own.

The peer server answers "which blob is this origin object?" and "which files make this engine cache?" from the
manifests this node wrote. The SQL stays beside the schema (index.py); the peer server matches the rows against
the object it was asked for (peers/identity.py, `record_matches`).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
from pathlib import Path

from weightcache.store.records import is_hex
from weightcache.vocabulary import ENGINE_CACHE_ADMIN_DOMAIN, ENGINE_CACHE_SCHEME

log = logging.getLogger(__name__)

# (model uri, path in the model, etag, version id, size, sha256) of a file this node published
FileRow = tuple[str, str, str | None, str | None, int, str]


class IndexReader:
    """Blocking (call from a thread); each call opens and closes its own read-only connection."""

    def __init__(self, index_path: Path) -> None:
        self.index_path = index_path

    def _open(self) -> sqlite3.Connection | None:
        try:
            if not stat.S_ISREG(os.lstat(self.index_path).st_mode):  # never a symlink planted as the index
                return None
            return sqlite3.connect(f"file:{self.index_path}?mode=ro", uri=True, timeout=5)
        except (OSError, sqlite3.Error):
            return None

    def files_with_etag(self, etag: str | None, size: int) -> list[FileRow]:
        """The published files recorded with this ETag and size (none when the index cannot be read)."""
        db = self._open()
        if db is None:
            return []
        try:
            rows = db.execute(
                "SELECT s.uri, f.path, f.etag, f.version_id, f.size, f.sha256 FROM files f "
                "JOIN snapshots s ON s.id = f.snapshot_id WHERE f.etag = ? AND f.size = ?", (etag, size)).fetchall()
        except sqlite3.Error as exc:
            log.info("index lookup of an origin object: index unreadable (%s)", exc)
            return []
        finally:
            db.close()
        return [(str(u), str(p), e, v, int(n), str(h)) for u, p, e, v, n, h in rows if p and is_hex(str(h), 64)]

    def engine_cache_files(self, snapshot_id: str) -> list[list[str | int]] | None:
        """[[path, size, sha256], ...] of snapshot `snapshot_id` when it is an engine cache of the admin's domain
        (`weightcache-engine-cache://<model>/<engine>/<version>/<device>/_admin/`); None for anything else."""
        db = self._open()
        if db is None:
            return None
        try:
            rows = db.execute("SELECT uri FROM snapshots WHERE id = ?", (snapshot_id,)).fetchall()
            if not rows or not str(rows[0][0]).startswith(ENGINE_CACHE_SCHEME + "://") or \
                    not str(rows[0][0]).endswith(f"/{ENGINE_CACHE_ADMIN_DOMAIN}/"):
                return None
            files = db.execute("SELECT path, size, sha256 FROM files WHERE snapshot_id = ? ORDER BY path",
                               (snapshot_id,)).fetchall()
        except sqlite3.Error as exc:
            log.info("peer lookup of engine cache %s: index unreadable (%s)", snapshot_id[:12], exc)
            return None
        finally:
            db.close()
        return [[str(p), int(n), str(h)] for p, n, h in files] or None
