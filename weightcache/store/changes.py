"""Has the store changed? A cheap token for a reader that keeps what it derives from the store (the API's listing,
the DRA ResourceSlice's devices) and redoes the work only when the token moves.

    index.db: `PRAGMA data_version` on a read-only connection of the token's own, which changes whenever any other
        connection (the daemon's store, a CLI, the CSI plugin) commits; and index.db's inode (a rebuilt index)
    leases/, pins/ and manifests/: their mtimes (leases and pins are files; adding or removing one renames in those
        dirs; a manifest is rewritten by a rename only to add its signature record, Store.record_signature)

Publishing and evicting a snapshot both commit to the index, so they move the token too. A directory changed
within the last RACY_S may change again inside the same timestamp tick: `read` returns the newest mtime with the
token, and a reader serves what it derived then without keeping it (git's "racy clean" rule).

One per Store (`Store.changes`), opened at the first read and closed with the store.
"""

from __future__ import annotations

import os
import sqlite3
import threading

from weightcache.store.layout import Layout

RACY_S = 0.05


class ChangeToken:
    """Blocking (call from a thread); thread-safe."""

    def __init__(self, layout: Layout) -> None:
        self._layout = layout
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._inode = 0

    def read(self) -> tuple[tuple[int, ...], float]:
        """The store's state now (equal tokens: nothing a listing shows changed between them), and the newest of
        the directory mtimes in it (seconds), for the racy rule."""
        layout = self._layout
        with self._lock:
            inode = os.stat(layout.index).st_ino
            if self._db is None or inode != self._inode:
                if self._db is not None:
                    self._db.close()
                self._db = sqlite3.connect(f"file:{layout.index}?mode=ro", uri=True, check_same_thread=False)
                self._inode = inode
            (version,) = self._db.execute("PRAGMA data_version").fetchone()
            dirs = [os.stat(d).st_mtime_ns for d in (layout.leases, layout.pins, layout.manifests)]
            return (inode, version, *dirs), max(dirs) / 1e9

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
