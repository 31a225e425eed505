"""Files handed to `Fetcher.ensure(on_file=...)` while the rest downloads (stream_load.py reads them at once):
each file once per listing, only once verified and durable. Several workers may see a file complete; the one
that claims it hands it over, and a claim that fails verification is given back for the round's end to judge."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from weightcache.fetch.items import Item
from weightcache.store import FileEntry, Snapshot, Store


@dataclass(frozen=True)
class DurableFile:
    """A file of a fetch whose blob is verified (in-order sha256, the source's check, a safetensors header) and
    durable in the store (fsynced, named): `Fetcher.ensure(on_file=...)` hands these over while the rest downloads.
    The snapshot is still published only when whole; until then the blob is an orphan a gc keeps for
    ORPHAN_BLOB_GRACE_S (store/recovery.py), so a reader opens it at once (an open file outlives an unlink)."""

    entry: FileEntry
    blob: Path
    planned: frozenset[str]  # every path of this listing (oci tar layers unexpanded): what else is coming


class HandOver:
    """The claims and the callback of one `ensure(on_file=...)`; without a callback (`on_file=None`), only the
    claims: a fetch of few files makes each durable on its own as it completes (Fetcher.FEW_FILES)."""

    def __init__(self, on_file: Callable[[DurableFile], None] | None, store: Store) -> None:
        self.on_file, self.store = on_file, store
        self._mu = threading.Lock()
        self._planned: frozenset[str] = frozenset()
        self._claimed: set[int] = set()

    def snapshot(self, snap: Snapshot) -> Snapshot:
        """A cache hit: every file of a published snapshot is durable already."""
        planned = frozenset(f.path for f in snap.files)
        if (on_file := self.on_file) is not None:
            for f in snap.files:
                on_file(DurableFile(f, self.store.layout.blob(f.sha256), planned))
        return snap

    def listed(self, items: list[Item]) -> None:
        """A new listing (a restart's too): its files, no claims (an old item's id may be a new one's), and the
        files linked from a blob on trusted evidence handed over now (synced first unless a record says so)."""
        with self._mu:
            self._planned = frozenset(i.relpath for i in items)
            self._claimed.clear()
        for item in items:
            if item.sha256 is not None:
                if item.unsynced_blob:
                    self.store.sync_blob(item.sha256)
                self.give(item)

    def claim(self, item: Item) -> bool:
        """True for the one caller that hands `item` over (several workers may see it complete)."""
        with self._mu:
            if item.reported or id(item) in self._claimed:
                return False
            self._claimed.add(id(item))
            return True

    def unclaim(self, item: Item) -> None:
        with self._mu:
            self._claimed.discard(id(item))

    def give(self, item: Item) -> None:
        if item.sha256 and self.on_file is not None:
            entry = FileEntry(item.relpath, item.size, item.sha256, item.obj.etag, item.obj.version_id)
            self.on_file(DurableFile(entry, self.store.layout.blob(item.sha256), self._planned))
