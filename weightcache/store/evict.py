"""Eviction planning: a pure function from snapshots to the ones to remove, least recently used first."""

from __future__ import annotations

from collections.abc import Sequence

from weightcache.errors import InsufficientSpaceError
from weightcache.store.types import SnapshotInfo


def plan_eviction(
    infos: Sequence[SnapshotInfo],
    *,
    used_bytes: int,
    target_bytes: int,
    keep: frozenset[str] = frozenset(),
    best_effort: bool = False,
) -> list[str]:
    """Ids to evict (oldest first) so that used bytes fall to `target_bytes`.

    Never a leased or pinned snapshot, nor one in `keep`. Freed bytes are counted per blob, so a blob shared by
    two candidates counts once, when its last holder goes. Raises InsufficientSpaceError when even evicting every
    candidate is not enough, unless `best_effort`: then every candidate is returned.
    """
    if used_bytes <= target_bytes:
        return []
    holders: dict[str, set[str]] = {}
    for info in infos:
        for f in info.snapshot.files:
            holders.setdefault(f.sha256, set()).add(info.snapshot.id)
    sizes = {f.sha256: f.size for info in infos for f in info.snapshot.files}
    candidates = sorted(
        (i for i in infos if not i.leases and not i.pinned and i.snapshot.id not in keep),
        key=lambda i: (i.last_used, i.snapshot.id),
    )
    plan: list[str] = []
    freed = 0
    gone: set[str] = set()
    for info in candidates:
        plan.append(info.snapshot.id)
        gone.add(info.snapshot.id)
        for sha in {f.sha256 for f in info.snapshot.files}:
            if holders[sha] <= gone:
                freed += sizes[sha]
        if used_bytes - freed <= target_bytes:
            return plan
    if best_effort:
        return plan
    held = [i for i in infos if i.leases or i.pinned]
    raise InsufficientSpaceError(
        f"cannot free enough space: {used_bytes} bytes used, target {target_bytes}, evicting every unpinned and "
        f"unleased snapshot frees only {freed}; {len(held)} snapshot(s) are pinned or leased "
        f"(see `weightcache ls`); unpin models, stop the pods using them, or raise the disk budget"
    )
