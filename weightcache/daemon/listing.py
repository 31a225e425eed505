"""GET /v1/models without re-reading the store when nothing changed.

`Store.list()` reads the whole index (20-40 ms at 1,000 snapshots), so the daemon keeps the rendered answer and
re-renders only when a cheap change token moves:
    SQLite `PRAGMA data_version` of a read-only connection of our own: it changes whenever any other connection
        (this daemon's store, a CLI, the CSI plugin) commits to index.db; plus index.db's inode (a rebuilt index)
    the mtimes of leases/ and pins/ (leases and pins are files; adding or removing one renames in those dirs)
A directory changed within the last RACY_S may change again inside the same timestamp tick, so such an answer
is served but not kept (git's "racy clean" rule).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import TypedDict

from weightcache.store import Snapshot, SnapshotInfo, Store

RACY_S = 0.05


class SnapshotBody(TypedDict):
    id: str
    path: str
    uri: str
    revision: str | None
    size: int
    files: int


class InfoBody(SnapshotBody):
    refs: list[str]
    last_used: float
    pinned: bool
    leases: list[str]
    unique_bytes: int
    source_checks: dict[str, int]  # files per what verified them against the source (docs/fetch.md)


def snapshot_body(s: Snapshot) -> SnapshotBody:
    """A snapshot as the API and the CLI show it."""
    return {"id": s.id, "path": str(s.path), "uri": s.uri, "revision": s.revision, "size": s.size,
            "files": len(s.files)}


def info_body(i: SnapshotInfo) -> InfoBody:
    """A listed snapshot as `GET /v1/models` and `weightcache ls` show it, whichever way the CLI went."""
    return {**snapshot_body(i.snapshot), "refs": list(i.refs), "last_used": i.last_used,
            "pinned": i.pinned, "leases": list(i.leases), "unique_bytes": i.unique_bytes,
            "source_checks": dict(i.source_checks)}


class Listing:
    def __init__(self, store: Store, render: Callable[[list[SnapshotInfo]], bytes]) -> None:
        self._store = store
        self._render = render
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._inode = 0
        self._token: tuple[int, ...] | None = None
        self._body = b""

    def get(self) -> bytes:
        """The rendered listing; blocking (call from a thread)."""
        with self._lock:
            token, newest = self._current()
            if token == self._token:
                return self._body
            body = self._render(self._store.list())
            if time.time() - newest > RACY_S:
                self._token, self._body = token, body
            return body

    def _current(self) -> tuple[tuple[int, ...], float]:
        layout = self._store.layout
        inode = os.stat(layout.index).st_ino
        if self._db is None or inode != self._inode:
            if self._db is not None:
                self._db.close()
            self._db = sqlite3.connect(f"file:{layout.index}?mode=ro", uri=True, check_same_thread=False)
            self._inode = inode
        (version,) = self._db.execute("PRAGMA data_version").fetchone()
        dirs = [os.stat(d).st_mtime_ns for d in (layout.leases, layout.pins)]
        return (inode, version, *dirs), max(dirs) / 1e9

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
