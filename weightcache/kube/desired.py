"""Which ModelCaches this node should hold: a pure function of the ModelCache objects and the node's labels.

Selection is matchLabels-style: every key of `spec.nodeSelector` must be a node label with exactly that value;
`spec.nodeNames` (written by the placement controller for the pods it holds back) names nodes outright.
Demand the controller wrote (label app.kubernetes.io/managed-by: weightcache-placement) carries the namespaces
of the pods it was made for in `spec.demandNamespaces`: the daemon authorizes it for them, never as an admin's.
A rollout (weightcache/kube/rollout.py) makes a node serve `status.revision` and, while it is asked to, fetch the
next revision beside it as a second DesiredModel.
With `spec.memory.nodes: N` the placement controller picks N selected nodes (spread over zones) into
`status.memoryNodes`: those keep the model in the RAM tier, the others on disk.
An empty or missing nodeSelector selects NO node: such a ModelCache only declares a model for the namespace
policy (pods fetch it on demand through CSI); prefetching on every node of a fleet must be asked for
explicitly, e.g. with a label every GPU node carries. Pure and allocation-light: 500 ModelCaches reconcile in
well under a millisecond each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from weightcache.errors import InvalidReferenceError
from weightcache.kube import MESSAGE_MAX, adapters, rollout
from weightcache.redact import redact
from weightcache.uri import ModelRef, parse_ref
from weightcache.vocabulary import CONTROLLER, MANAGED_BY

TIERS = ("disk", "memory")


@dataclass(frozen=True)
class DesiredModel:
    """One model this node should fetch and pin, from the ModelCache `name`."""

    name: str
    ref: ModelRef
    tier: str
    priority: int
    label_key: str  # node label reporting readiness: weightcache.uri.readiness_label(ref)
    generation: int | None = None  # ModelCache metadata.generation, echoed as observedGeneration in reports
    # Who asked: None for a ModelCache a cluster admin wrote; for the placement controller's demand, the
    # namespaces of its pods (spec.demandNamespaces; empty when missing: nobody asked, so nothing is granted).
    namespaces: tuple[str, ...] | None = None
    # spec.warmBeforeSchedulable: the node keeps its startup taint until this model is on it (docs/startup-taint.md)
    warm_first: bool = False
    # The ModelCache this comes from: `name` itself, but for a rollout's fetch of the next revision, reported
    # under `<name>@<revision>` (weightcache/kube/rollout.py)
    model_cache: str = ""
    # The revision the nodes serve is managed by rollouts (status.revision is set): the store's `latest` ref of the
    # selection follows this want's snapshot, so pods that name no revision get it
    serves: bool = False


@dataclass(frozen=True)
class InvalidSpec:
    """A selected ModelCache whose spec cannot be used; the daemon turns it into a Warning Event."""

    name: str
    error: str  # credentials already redacted


def selects(node_labels: Mapping[str, str], node_selector: Mapping[str, str] | None) -> bool:
    """True when a non-empty selector's every key=value is among the node's labels."""
    if not node_selector:
        return False
    return all(node_labels.get(k) == v for k, v in node_selector.items())


def plan(model_caches: Iterable[Mapping[str, Any]], node_labels: Mapping[str, str],
         node_name: str | None = None, adapter_views: Mapping[str, tuple[str, ...]] | None = None,
         ) -> tuple[list[DesiredModel], list[InvalidSpec]]:
    """The models this node should hold (priority high first, then name) and the selected specs that are invalid.

    `adapter_views`: base model uri -> the namespaces of the pods on this node with an adapter directory for it
    (docs/adapters.md). An adapter's ModelCache for such a base is wanted here as those namespaces' demand when
    nothing else selects the node: decided for them, as if their pods asked."""
    wanted: list[DesiredModel] = []
    invalid: list[InvalidSpec] = []
    for mc in model_caches:
        meta = mc.get("metadata") or {}
        spec = mc.get("spec") or {}
        name = str(meta.get("name", ""))
        selector = spec.get("nodeSelector")
        named = node_name is not None and node_name in _strings(spec.get("nodeNames"))
        for_pods = (adapter_views or {}).get(adapters.base_of(mc) or "")
        if not isinstance(selector, Mapping) and not named and not for_pods:
            if selector is not None:
                invalid.append(InvalidSpec(name, "spec.nodeSelector must be a map of label names to values"))
            continue
        selected = named or (isinstance(selector, Mapping) and selects(node_labels, selector))
        if not selected and not for_pods:
            continue
        namespaces = _demand_namespaces(meta, spec) if selected else tuple(sorted(set(for_pods or ())))
        try:
            serving, following = rollout.revisions(mc, node_name)
            current = _desired(name, {**spec, "revision": serving}, meta.get("generation"), _in_memory(mc, node_name),
                               namespaces)
            wanted.append(dataclasses.replace(current, model_cache=name,
                                              serves=rollout.managed(mc) and bool(serving)))
            if following is not None:  # a rollout's next revision, beside: on disk only, never the startup taint's
                nxt = _desired(name, {**spec, "revision": following}, meta.get("generation"), False, current.namespaces)
                wanted.append(dataclasses.replace(nxt, name=rollout.next_key(name, following), model_cache=name,
                                                  warm_first=False))
        except (InvalidReferenceError, ValueError, TypeError) as exc:
            invalid.append(InvalidSpec(name, redact(str(exc), limit=MESSAGE_MAX)))
    wanted.sort(key=lambda d: (-d.priority, d.name))
    return wanted, invalid


def _strings(value: Any) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _in_memory(mc: Mapping[str, Any], node_name: str | None) -> bool | None:
    """With spec.memory: whether this node is one of status.memoryNodes; None without spec.memory."""
    if not isinstance((mc.get("spec") or {}).get("memory"), Mapping):
        return None
    status = mc.get("status") if isinstance(mc.get("status"), Mapping) else {}
    return node_name is not None and node_name in _strings(status.get("memoryNodes"))  # type: ignore[union-attr]


def _demand_namespaces(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> tuple[str, ...] | None:
    """None for an admin's ModelCache; the namespaces a controller demand was made for (empty: nobody's)."""
    labels = meta.get("labels")
    if not isinstance(labels, Mapping) or labels.get(MANAGED_BY) != CONTROLLER:
        return None
    return tuple(sorted(set(_strings(spec.get("demandNamespaces")))))


def _desired(name: str, spec: Mapping[str, Any], generation: Any, in_memory: bool | None = None,
             namespaces: tuple[str, ...] | None = None) -> DesiredModel:
    tier = spec.get("tier") or "disk"
    if in_memory is not None:
        tier = "memory" if in_memory else "disk"
    if tier not in TIERS:
        raise ValueError(f"spec.tier {tier!r} is not one of {', '.join(TIERS)}")
    priority = spec.get("priority") or 0
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise TypeError(f"spec.priority {priority!r} must be an integer")
    ref = parse_ref_of(spec)
    warm_first = spec.get("warmBeforeSchedulable") or False
    if not isinstance(warm_first, bool):
        raise TypeError(f"spec.warmBeforeSchedulable {warm_first!r} must be true or false")
    gen = generation if isinstance(generation, int) else None
    return DesiredModel(name, ref, tier, priority, ref.label_key, gen, namespaces, warm_first)


def parse_ref_of(spec: Mapping[str, Any]) -> ModelRef:
    """The model a ModelCache spec names (source, revision, globs); ValueError/TypeError/InvalidReferenceError."""
    return parse_ref(str(spec.get("source") or ""), revision=spec.get("revision") or None,
                     include=_globs(spec, "include"), exclude=_globs(spec, "exclude"))


def _globs(spec: Mapping[str, Any], field: str) -> tuple[str, ...]:
    value = spec.get(field) or ()
    if isinstance(value, str) or not all(isinstance(g, str) for g in value):
        raise TypeError(f"spec.{field} must be a list of glob strings such as ['*.safetensors']")
    return tuple(value)
