"""GET /v1/models without re-reading the store when nothing changed.

`Store.list()` reads the whole index (20-40 ms at 1,000 snapshots), so the daemon keeps the rendered answer and
re-renders only when the store's change token moves (`Store.changes`, weightcache/store/changes.py). An answer
rendered while a directory had changed within the last RACY_S is served but not kept (git's "racy clean" rule).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypedDict

from weightcache.store import Snapshot, SnapshotInfo, Store
from weightcache.store.changes import RACY_S


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
    signature: dict[str, str | int]  # what verified its model.sig (docs/signing.md); {} when none was asked for


def snapshot_body(s: Snapshot) -> SnapshotBody:
    """A snapshot as the API and the CLI show it."""
    return {"id": s.id, "path": str(s.path), "uri": s.uri, "revision": s.revision, "size": s.size,
            "files": len(s.files)}


def info_body(i: SnapshotInfo) -> InfoBody:
    """A listed snapshot as `GET /v1/models` and `weightcache ls` show it, whichever way the CLI went."""
    return {**snapshot_body(i.snapshot), "refs": list(i.refs), "last_used": i.last_used,
            "pinned": i.pinned, "leases": list(i.leases), "unique_bytes": i.unique_bytes,
            "source_checks": dict(i.source_checks), "signature": dict(i.signature)}


class Listing:
    def __init__(self, store: Store, render: Callable[[list[SnapshotInfo]], bytes]) -> None:
        self._store = store
        self._render = render
        self._lock = threading.Lock()
        self._token: tuple[int, ...] | None = None
        self._body = b""

    def get(self) -> bytes:
        """The rendered listing; blocking (call from a thread)."""
        with self._lock:
            token, newest = self._store.changes.read()
            if token == self._token:
                return self._body
            body = self._render(self._store.list())
            if time.time() - newest > RACY_S:
                self._token, self._body = token, body
            return body
