"""The startup taint: a new node takes no pods until the models it was asked to warm first are on it.

A node pool creates its nodes with `weightcache.io/models-pending:NoSchedule` (Karpenter `startupTaints`, the
cluster autoscaler's `--startup-taint`; docs/startup-taint.md). After each reconcile pass has settled the store and
the memory tier, this node's daemon looks at the ModelCaches that select the node with
`spec.warmBeforeSchedulable: true`:

    each one on disk (tier disk), or resident in RAM (tier memory)   remove the taint (after this pass's readiness
                                                                      labels are set); Event ModelsReady (Normal)
    the Node is older than `startupTaintDeadline`                     remove it anyway; Event StartupTaintDeadline
                                                                      (Warning) naming the models still missing
    otherwise                                                         keep it; the loop wakes again at the deadline

A ModelCache this node may not fetch (refused by policy) or cannot parse never reaches the wanted list, so it holds
nothing back; one that fails to fetch does, until the deadline. The deadline counts from the Node's
creationTimestamp, so a daemon that restarts mid-fetch does not restart the clock. Level-triggered like the rest
of reconcile: the Node read of this pass says whether the taint is there; the write is a JSON patch that removes
only this taint (weightcache/kube/taint.py), and node-policy.yaml lets the daemon's token do no more to its Node.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from weightcache.errors import ClusterError
from weightcache.vocabulary import STARTUP_TAINT, STARTUP_TAINT_EFFECT

if TYPE_CHECKING:
    from weightcache.daemon.node import ClusterBridge, Want

log = logging.getLogger(__name__)

TAINT = f"{STARTUP_TAINT}:{STARTUP_TAINT_EFFECT}"


def waiting_on(wanted: Sequence[Want], cached: Mapping[str, str], resident: frozenset[str]) -> list[str]:
    """Pure: the warm-first wants not yet where their tier keeps them (`cached`: want name -> snapshot id)."""
    waiting = []
    for w in wanted:
        snapshot = cached.get(w.name)
        if w.warm_first and (snapshot is None or (w.tier == "memory" and snapshot not in resident)):
            waiting.append(w.name)
    return waiting


def created_at(node: Mapping[str, Any]) -> float | None:
    """The Node's metadata.creationTimestamp as a Unix time, or None when it is missing or not RFC 3339."""
    stamp = (node.get("metadata") or {}).get("creationTimestamp")
    try:
        return datetime.datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def release(cluster: ClusterBridge, waiting: Sequence[str], deadline_s: float, *, now: float | None = None,
            observe: Callable[[str, float], None] = lambda reason, seconds: None) -> float | None:
    """Remove the startup taint when nothing is `waiting` or the deadline has passed. Blocks (call from a thread).
    `observe(reason, seconds since the Node's creation)` hears each removal (models_ready or deadline).

    Returns the seconds until the deadline while the taint stays, so the loop wakes for it; None otherwise."""
    node = cluster.node()
    if not cluster.has_startup_taint():
        return None
    now = time.time() if now is None else now
    created = created_at(node) or cluster.started
    left = created + deadline_s - now
    if waiting and left > 0:
        log.info("keeping %s on node %s for %.0fs more: waiting for %s", TAINT, cluster.node_name, left,
                 ", ".join(waiting))
        return left
    try:
        removed = cluster.remove_startup_taint()
    except ClusterError as exc:  # level-triggered: the next pass tries again
        log.warning("%s stays on node %s for now: %s", TAINT, cluster.node_name, exc)
        return None
    if not removed:
        return None
    observe("deadline" if waiting else "models_ready", max(0.0, now - created))
    if waiting:
        message = (f"removed {TAINT} at its deadline, {deadline_s:.0f}s after the node joined; not on the node yet: "
                   f"{', '.join(waiting)}")
        cluster.node_event("StartupTaintDeadline", message, "Warning")
    else:
        message = f"removed {TAINT}: the ModelCaches marked warmBeforeSchedulable are on the node"
        cluster.node_event("ModelsReady", message, "Normal")
    log.info("%s", message)
    return None
