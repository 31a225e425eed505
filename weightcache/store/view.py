"""What recovery and quarantine need of a Store, as a Protocol: they take the store as a parameter, never import it.

store.py calls recovery and quarantine; with this view neither imports store.py back, so the store package has no
import circle (docs/architecture.md). `Store` satisfies it structurally; mypy checks that at each call.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

from weightcache.store.fsops import Tree
from weightcache.store.index import Index
from weightcache.store.layout import Layout
from weightcache.store.records import Manifest, RefRecord


class LayoutView(Protocol):
    """The tree and its named places: all quarantine needs."""

    @property
    def layout(self) -> Layout: ...

    @property
    def tree(self) -> Tree: ...


class StoreView(LayoutView, Protocol):
    """The parts of a Store that startup recovery reads and repairs."""

    @property
    def index(self) -> Index: ...

    def locked(self) -> AbstractContextManager[None]: ...

    def open_lock(self, name: str) -> int: ...

    def read_ref_file(self, path: Path) -> RefRecord | None: ...

    def read_manifest(self, path: Path, snapshot_id: str) -> Manifest | None: ...

    def leases(self) -> dict[str, str]: ...

    def release(self, holder: str) -> None: ...

    def finish_eviction(self, snapshot_id: str, *, index: bool = True) -> None: ...


__all__ = ["LayoutView", "StoreView"]
