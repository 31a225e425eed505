"""Could this pod run on this node? The scheduler's filters that placement needs, as pure functions on API dicts.

Covered: spec.nodeSelector, required node affinity (matchExpressions In/NotIn/Exists/DoesNotExist/Gt/Lt and
matchFields metadata.name; terms ORed, expressions ANDed, an empty term matches nothing), taints with effect
NoSchedule/NoExecute against tolerations (Equal/Exists, empty key with Exists tolerates all), unschedulable
nodes, and `nvidia.com/gpu` allocatable minus what the node's pods request. Not covered (the scheduler still
decides): pod (anti-)affinity, topology spread, other resources. Node and pod dicts are untrusted: a field of
the wrong shape matches nothing instead of raising.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

GPU = "nvidia.com/gpu"
_REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
_BLOCKING = ("NoSchedule", "NoExecute")


@dataclass(frozen=True)
class NodeFacts:
    """What placement needs to know about one node."""

    name: str
    labels: Mapping[str, str]
    taints: tuple[Mapping[str, Any], ...] = ()
    unschedulable: bool = False
    gpus_allocatable: int = 0
    gpus_requested: int = 0  # by the pods bound to it that still run

    @property
    def gpus_free(self) -> int:
        return max(0, self.gpus_allocatable - self.gpus_requested)


def node_facts(node: Mapping[str, Any], pods_on_node: Iterable[Mapping[str, Any]] = ()) -> NodeFacts:
    """NodeFacts of a Node object; `pods_on_node` are the pods bound to it (terminated ones are skipped)."""
    meta, spec, status = _obj(node, "metadata"), _obj(node, "spec"), _obj(node, "status")
    labels = {str(k): str(v) for k, v in _obj(meta, "labels").items()}
    taints = tuple(t for t in _seq(spec, "taints") if isinstance(t, Mapping))
    requested = sum(gpu_request(p) for p in pods_on_node if _running(p))
    return NodeFacts(str(meta.get("name", "")), labels, taints, spec.get("unschedulable") is True,
                     _count(_obj(status, "allocatable").get(GPU)), requested)


def gpu_request(pod: Mapping[str, Any]) -> int:
    """GPUs a pod asks for, as the scheduler counts them: max(sum over app containers, any init container)."""
    spec = _obj(pod, "spec")

    def each(key: str) -> list[int]:
        return [_count(_obj(_obj(c, "resources"), "requests").get(GPU) or _obj(_obj(c, "resources"), "limits").get(GPU))
                for c in _seq(spec, key) if isinstance(c, Mapping)]

    return max([sum(each("containers")), *each("initContainers")])


def eligible(pod: Mapping[str, Any], node: NodeFacts) -> bool:
    """True when the pod's own constraints let it run on the node (resources aside)."""
    spec = _obj(pod, "spec")
    if node.unschedulable or not _tolerated(node.taints, _seq(spec, "tolerations")):
        return False
    selector = spec.get("nodeSelector") or {}
    if not isinstance(selector, Mapping) or any(node.labels.get(str(k)) != v for k, v in selector.items()):
        return False
    required = _obj(_obj(_obj(spec, "affinity"), "nodeAffinity"), _REQUIRED)
    if not required:
        return True
    return any(_term_matches(t, node) for t in _seq(required, "nodeSelectorTerms") if isinstance(t, Mapping))


def _term_matches(term: Mapping[str, Any], node: NodeFacts) -> bool:
    exprs = [e for e in _seq(term, "matchExpressions") if isinstance(e, Mapping)]
    fields = [e for e in _seq(term, "matchFields") if isinstance(e, Mapping)]
    if not exprs and not fields:
        return False  # an empty term matches no node
    return all(_requirement(e, node.labels) for e in exprs) and all(
        e.get("key") == "metadata.name" and _requirement(e, {"metadata.name": node.name}) for e in fields
    )


def _requirement(expr: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, op = str(expr.get("key", "")), expr.get("operator")
    values = [str(v) for v in expr.get("values") or [] if isinstance(v, str | int)]
    present = key in labels
    if op == "In":
        return present and labels[key] in values
    if op == "NotIn":
        return not present or labels[key] not in values
    if op == "Exists":
        return present
    if op == "DoesNotExist":
        return not present
    if op in ("Gt", "Lt") and present and len(values) == 1:
        try:
            have, bound = int(labels[key]), int(values[0])
        except ValueError:
            return False
        return have > bound if op == "Gt" else have < bound
    return False


def _tolerated(taints: Iterable[Mapping[str, Any]], tolerations: list[Any]) -> bool:
    return all(
        any(_tolerates(t, taint) for t in tolerations if isinstance(t, Mapping))
        for taint in taints if taint.get("effect") in _BLOCKING
    )


def _tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    if toleration.get("effect") and toleration.get("effect") != taint.get("effect"):
        return False
    key = toleration.get("key") or ""
    if toleration.get("operator") == "Exists":
        return not key or key == taint.get("key")
    return bool(key == taint.get("key") and (toleration.get("value") or "") == (taint.get("value") or ""))


def _running(pod: Mapping[str, Any]) -> bool:
    return _obj(pod, "status").get("phase") not in ("Succeeded", "Failed")


def _count(value: Any) -> int:
    """A GPU quantity ("2", 2); anything else (fractions, garbage) counts as 0."""
    try:
        return max(0, int(str(value)))
    except (TypeError, ValueError):
        return 0


def _obj(d: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = d.get(key)
    return value if isinstance(value, Mapping) else {}


def _seq(d: Mapping[str, Any], key: str) -> list[Any]:
    value = d.get(key)
    return value if isinstance(value, list) else []
