"""Store: the public face of the on-disk cache. (API contract; bodies land shortly.)"""

from __future__ import annotations

from pathlib import Path

from weightcache.store.types import Snapshot, SnapshotInfo
from weightcache.uri import ModelRef


class Store:
    """Thread-safe and multi-process-safe. Constructing one creates the layout and runs startup recovery."""

    def __init__(self, root: str | Path, *, budget_bytes: int | None = None) -> None:
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        raise NotImplementedError

    def lookup(self, ref: ModelRef) -> Snapshot | None:
        """The snapshot `ref` resolves to (refs/ or a snapshot id as revision), touching last_used; None if absent."""
        raise NotImplementedError

    def get(self, snapshot_id: str) -> Snapshot:
        """A snapshot by id; raises NotCachedError."""
        raise NotImplementedError

    def list(self) -> list[SnapshotInfo]:
        raise NotImplementedError

    def lease(self, holder: str, snapshot_id: str) -> None:
        """Persist holder -> snapshot (idempotent for the same pair; a holder holds one snapshot)."""
        raise NotImplementedError

    def release(self, holder: str) -> None:
        """Drop a lease; no error when it does not exist."""
        raise NotImplementedError

    def leases(self) -> dict[str, str]:
        """holder id -> snapshot id."""
        raise NotImplementedError

    def pin(self, snapshot_id: str) -> None:
        raise NotImplementedError

    def unpin(self, snapshot_id: str) -> None:
        raise NotImplementedError

    def evict(self, snapshot_id: str) -> None:
        """Remove refs -> snapshot -> unshared blobs; raises InUseError naming the leases/pin that hold it."""
        raise NotImplementedError

    def evict_to(self, target_bytes: int) -> list[str]:
        """LRU-evict unleased, unpinned snapshots until used bytes <= target; returns evicted ids."""
        raise NotImplementedError

    def used_bytes(self) -> int:
        raise NotImplementedError
