"""Revision rollouts: a ModelCache's new `spec.revision` is fetched beside the old one on the nodes that hold the
ModelCache, a few nodes at a time, then every node switches at once; the first node that fails stops it.

Pure functions of the ModelCache and the ModelCacheNode reports. The placement controller (leader-elected) runs
`step` on every pass and writes what it returns to the ModelCache's status subresource; every daemon reads the
result through `revisions` (weightcache/kube/desired.py):

    status.revision          the revision the nodes serve: their pin, their readiness and the store's `latest`
                             ref of the selection follow it, so a pod that mounts the model without a revision
                             gets it ("" = the source's latest). Written at the controller's first sight of a
                             ModelCache, then only by a rollout's switch.
    status.rollout           {from, to, phase (Progressing, Complete, Failed), generation, nodes (asked to fetch
                             `to` so far), old, fetching, new, failed (node names), progress ("2/3"), message}

A node in `rollout.nodes` of a Progressing rollout keeps serving `from` and fetches `to` beside it (pinned, through
its fetch queue, so from peers that hold it already), reporting it in its ModelCacheNode as `<name>@<to>`; a
ModelCache name is a DNS subdomain and a revision has no '@', so the key names no ModelCache. Once every node that
reports the ModelCache holds `to`, `status.revision` becomes `to`: each daemon then pins `to`, unpins `from`
(leases keep it for the pods that run on it until they end) and points `latest` at `to`. A node whose fetch of `to`
fails stops the rollout (phase Failed, the node and its error in `message`): nodes stop fetching, serve `from`,
and nothing is switched; any later edit of the spec (a new `metadata.generation`) starts it again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

PROGRESSING, COMPLETE, FAILED = "Progressing", "Complete", "Failed"
DEFAULT_MAX_CONCURRENT = 1


def next_key(name: str, revision: str) -> str:
    """The ModelCacheNode status key of a rollout's fetch of `revision` for ModelCache `name`."""
    return f"{name}@{revision}"


def managed(mc: Mapping[str, Any]) -> bool:
    """Whether the controller has taken this ModelCache's served revision in hand (`status.revision` is set)."""
    return "revision" in _map(mc.get("status"))


def revisions(mc: Mapping[str, Any], node_name: str | None) -> tuple[str, str | None]:
    """(serving, next) on this node: the revision it serves, and the one a rollout asks it to fetch beside
    (None: none). Before the controller has written `status.revision`, the spec's is served."""
    spec, status = _map(mc.get("spec")), _map(mc.get("status"))
    wanted = _revision(spec.get("revision"))
    if not managed(mc):
        return wanted, None
    serving = _revision(status.get("revision"))
    rollout = _map(status.get("rollout"))
    if (wanted != serving and rollout.get("phase") == PROGRESSING and _revision(rollout.get("to")) == wanted
            and node_name is not None and node_name in _names(rollout.get("nodes"))):
        return serving, wanted
    return serving, None


def step(mc: Mapping[str, Any], reports: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    """The status patch that moves this ModelCache's rollout on (None: nothing to write). `reports`: node name ->
    its ModelCacheNode `status.models`."""
    meta, spec, status = _map(mc.get("metadata")), _map(mc.get("spec")), _map(mc.get("status"))
    wanted = _revision(spec.get("revision"))
    if "revision" not in status:
        return {"revision": wanted}  # first sight: nothing is served yet that a switch would replace
    serving = _revision(status.get("revision"))
    old = _map(status.get("rollout"))
    if wanted == serving:  # nothing to roll (a rollout set back before its switch is dropped)
        return None if not old or _revision(old.get("to")) == serving else {"rollout": None}
    rollout = _started(old, serving, wanted, meta.get("generation"))
    if rollout is None:
        return None  # stopped: it waits for an edit of the spec
    _advance(rollout, str(meta.get("name", "")), spec, reports)
    patch: dict[str, Any] = {}
    if rollout["phase"] == COMPLETE:
        patch["revision"] = wanted
    if rollout != old:
        patch["rollout"] = rollout
    return patch or None


def _started(old: Mapping[str, Any], serving: str, wanted: str, generation: Any) -> dict[str, Any] | None:
    """The rollout to move on: `old` while it progresses, a new one for a new revision or a retried failure (a new
    generation); None while a stopped one waits for an edit of the spec."""
    generation = generation if isinstance(generation, int) else 0
    if _revision(old.get("to")) != wanted or (old.get("phase") == FAILED and old.get("generation") != generation):
        return {"from": serving, "to": wanted, "phase": PROGRESSING, "generation": generation, "nodes": []}
    return dict(old) if old.get("phase") == PROGRESSING else None


class _Nodes(NamedTuple):
    """The nodes that report a ModelCache, by where each is with the rollout's revision."""

    targets: list[str]  # every node that reports the ModelCache
    new: list[str]  # hold `to`
    failed: list[str]  # asked, and their fetch of `to` failed (this generation)
    fetching: list[str]  # asked, neither yet
    waiting: list[str]  # not asked yet: holders of the old revision first
    state: dict[str, Mapping[str, Any]]  # each target's report of its fetch of `to`


def _tally(rollout: Mapping[str, Any], name: str, reports: Mapping[str, Mapping[str, Any]]) -> _Nodes:
    targets = sorted(n for n, models in reports.items() if isinstance(_map(models).get(name), Mapping))
    asked = [n for n in _names(rollout.get("nodes")) if n in targets]
    state = {n: _map(_map(reports[n]).get(next_key(name, rollout["to"]))) for n in targets}
    new = [n for n in targets if state[n].get("phase") == "Ready"]
    failed = [n for n in asked if state[n].get("phase") == "Failed" and _generation(state[n]) >= rollout["generation"]]
    waiting = [n for n in targets if n not in new and n not in asked]
    waiting.sort(key=lambda n: _map(_map(reports[n]).get(name)).get("phase") != "Ready")
    return _Nodes(targets, new, failed, [n for n in asked if n not in new and n not in failed], waiting, state)


def _advance(rollout: dict[str, Any], name: str, spec: Mapping[str, Any],
             reports: Mapping[str, Mapping[str, Any]]) -> None:
    """Count the nodes by where they are with `rollout["to"]`, then fail, complete or ask more nodes to fetch it."""
    wanted, serving = rollout["to"], rollout["from"]
    nodes = _tally(rollout, name, reports)
    fetching, waiting = nodes.fetching, nodes.waiting
    if nodes.failed:
        first = nodes.failed[0]
        why = str(nodes.state[first].get("message") or "no reason given")
        rollout.update(phase=FAILED, message=f"node {first} could not fetch revision {wanted or '(latest)'}: "
                       f"{why}; nodes keep serving {serving or '(latest)'}; edit the spec to try again")
    elif len(nodes.new) == len(nodes.targets):
        rollout.update(phase=COMPLETE, message="")
    else:
        room = max(0, max_concurrent(spec, len(nodes.targets)) - len(fetching))
        fetching, waiting = fetching + waiting[:room], waiting[room:]
    asked = set(fetching) | set(nodes.failed) | {n for n in _names(rollout.get("nodes")) if n in nodes.targets}
    rollout.update(nodes=sorted(asked), old=sorted(waiting), fetching=sorted(fetching), new=nodes.new,
                   failed=nodes.failed, progress=f"{len(nodes.new)}/{len(nodes.targets)}")


def max_concurrent(spec: Mapping[str, Any], nodes: int) -> int:
    """`spec.rollout.maxConcurrent`: a count, or a percentage of the nodes ("25%", rounded up); at least 1."""
    value = _map(spec.get("rollout")).get("maxConcurrent", DEFAULT_MAX_CONCURRENT)
    if isinstance(value, str) and value.endswith("%") and value[:-1].isdigit():
        return max(1, math.ceil(int(value[:-1]) * nodes / 100))
    if isinstance(value, int) and not isinstance(value, bool):
        return max(1, value)
    return DEFAULT_MAX_CONCURRENT  # the CRD's schema refuses anything else


def _revision(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _generation(state: Mapping[str, Any]) -> int:
    value = state.get("observedGeneration")
    return value if isinstance(value, int) else 0


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _names(value: Any) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []
