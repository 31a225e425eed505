"""Keep a cluster's last copies: the one decision of which snapshots on this node a ModelCache's `minCopies` keeps.

A ModelCache with `spec.minCopies: N` asks that N nodes keep its model. Who holds a copy is what the cluster already
says: the Node readiness label (`weightcache.io/m<hash>: ready`, weightcache/kube/report.py), kept by each daemon
while a snapshot of that selection stays in its store, wanted or not. A node's snapshot is kept when the nodes so
labelled, this one included, are no more than N: evicting it would leave fewer copies than the ModelCache wants.
The store consults this at every eviction (Store.keeper) and evicts such a snapshot only when its disk is below the
free-space floor, logging it (Store.evict).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import urllib3

from weightcache.errors import ClusterError, WeightcacheError
from weightcache.kube.client import ApiException, CoreV1Api
from weightcache.kube.desired import parse_ref_of
from weightcache.store.types import SnapshotInfo
from weightcache.uri import readiness_label
from weightcache.vocabulary import READY

if TYPE_CHECKING:
    from weightcache.kube.client import ApiClient

MAX_COPIES = 1000  # the CRD's bound on spec.minCopies


def min_copies(caches: Iterable[Mapping[str, Any]]) -> dict[str, list[tuple[str, int]]]:
    """Readiness label key -> [(ModelCache name, minCopies)] of every ModelCache that asks for copies; a spec
    this function cannot read asks for none (its InvalidSpec Event comes from the reconcile pass)."""
    out: dict[str, list[tuple[str, int]]] = {}
    for mc in caches:
        spec = mc.get("spec") if isinstance(mc.get("spec"), Mapping) else {}
        wanted = spec.get("minCopies")  # type: ignore[union-attr]
        if not isinstance(wanted, int) or isinstance(wanted, bool) or not 0 < wanted <= MAX_COPIES:
            continue
        try:
            ref = parse_ref_of(spec)  # type: ignore[arg-type]
        except (ValueError, TypeError, WeightcacheError):
            continue
        name = str((mc.get("metadata") or {}).get("name") or "")
        out.setdefault(readiness_label(ref), []).append((name, wanted))
    return out


def last_copies(held: Mapping[str, Sequence[str]], caches: Iterable[Mapping[str, Any]],
                holders: Mapping[str, Sequence[str]], node_name: str) -> dict[str, str]:
    """Snapshot id -> why it stays, for those this node must keep.

    `held`: snapshot id -> the readiness label keys its refs answer (a snapshot may serve several selections);
    `holders`: readiness label key -> the nodes labelled ready for it (this node's own label may lag: it counts
    as a holder either way)."""
    asks = min_copies(caches)
    out: dict[str, str] = {}
    for sid, keys in held.items():
        for key in keys:
            others = sorted(n for n in holders.get(key, ()) if n != node_name)
            for name, wanted in asks.get(key, ()):
                if len(others) + 1 <= wanted:
                    out[sid] = (f"one of the last copies of ModelCache {name}, which wants {wanted} (minCopies); "
                                f"{len(others) + 1} node(s) hold it: {', '.join([node_name, *others[:8]])}")
                    break
            if sid in out:
                break
    return out


class Keeper:
    """Store.keeper for a node in a cluster: the ModelCaches from the daemon's watcher, the holders from the Nodes'
    readiness labels (one list per model that asks for copies and is held here). Blocking: evictions run in
    threads."""

    def __init__(self, api_client: ApiClient, node_name: str, caches: Callable[[], list[dict[str, Any]]],
                 model_keys: Callable[[], Mapping[str, Sequence[str]]]) -> None:
        self.api_client, self.node_name, self.caches, self.model_keys = api_client, node_name, caches, model_keys

    def __call__(self, infos: Sequence[SnapshotInfo]) -> dict[str, str]:
        caches = self.caches()
        asked = min_copies(caches)
        if not asked:
            return {}
        keys = self.model_keys()
        held = {i.snapshot.id: [k for k in keys.get(i.snapshot.id, ()) if k in asked] for i in infos}
        held = {sid: ks for sid, ks in held.items() if ks}
        core = CoreV1Api(self.api_client)
        holders: dict[str, list[str]] = {}
        for key in sorted({k for ks in held.values() for k in ks}):
            try:
                nodes = core.list_node(label_selector=f"{key}={READY}").items or []
            except (ApiException, urllib3.exceptions.HTTPError) as exc:
                raise ClusterError(f"listing the Nodes that hold {key} failed: {type(exc).__name__}") from exc
            holders[key] = [n.metadata.name for n in nodes if n.metadata is not None]
        return last_copies(held, caches, holders, self.node_name)
