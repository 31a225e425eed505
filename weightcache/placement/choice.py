"""Placement decisions as pure functions of API objects: which nodes fetch, which pods go, which nodes keep RAM.

    pod_state(pod)            -> gated / bound / waiting / done / invalid, and the models its annotations name
    admit(pods, grants)       -> the pods whose demand the controller makes, and why each other one is refused:
                                   the namespace policy (weightcache.policy.decide, as in cluster mode), the
                                   webhook's cap on models a pod, `per_namespace` demanded models a namespace
    ready_nodes(pod, refs, N) -> the nodes it may run on that hold every one of its models (label = ready)
    plan(pods, nodes, current)-> model -> nodes that must hold it:
                                   gated pod  : its chosen node (one per pod; see `_rank`)
                                   bound pod  : its node (a model in use stays pinned there)
                                   released, not yet bound: the nodes already asked (the pod's affinity may
                                   point at any of them, so they keep the model until it is bound)
    memory_nodes(nodes, N, prev) -> N of the nodes, spread over zones, keeping previous picks

Every input is untrusted: annotations stay editable after CREATE and a tenant may set spec.nodeName itself, so
the webhook's checks at CREATE prove nothing here. A pod whose annotations do not parse, or that the policy or a
cap refuses, is left out of the demand with the reason (the controller puts it in an Event on the pod); an
error in one pod never costs another pod its pass.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from weightcache.errors import AnnotationError, InvalidReferenceError
from weightcache.placement.nodes import NodeFacts, eligible, gpu_request
from weightcache.pods.annotations import MAX_MODELS, parse_annotations, wants_injection
from weightcache.policy import decide
from weightcache.uri import ModelRef
from weightcache.vocabulary import GATE as GATE  # re-exported: tests read choice.GATE
from weightcache.vocabulary import READY
from weightcache.vocabulary import VIA_ANNOTATION as VIA

log = logging.getLogger(__name__)

ZONE = "topology.kubernetes.io/zone"
MAX_DEMAND_PER_NAMESPACE = 64  # demanded models (demand names) one namespace's pods may hold at once
State = Literal["gated", "bound", "waiting", "done", "invalid"]


@dataclass(frozen=True)
class PodModels:
    state: State
    refs: tuple[ModelRef, ...] = ()
    node: str = ""  # spec.nodeName of a bound pod
    error: str = ""  # why an `invalid` pod's annotations cannot be used


@dataclass(frozen=True)
class Refusal:
    """Why the controller makes no demand for a pod: an Event `reason` and a message that says what to do."""

    reason: str
    message: str


@dataclass
class Admission:
    pods: list[Mapping[str, Any]] = field(default_factory=list)  # the pods whose demand the controller makes
    refused: dict[str, Refusal] = field(default_factory=dict)  # pod (ns/name) -> why not


@dataclass
class Plan:
    nodes: dict[str, set[str]] = field(default_factory=dict)  # demand name -> nodes
    refs: dict[str, ModelRef] = field(default_factory=dict)  # demand name -> model
    chosen: dict[str, str] = field(default_factory=dict)  # gated pod (ns/name) -> the node chosen to fetch for it
    namespaces: dict[str, set[str]] = field(default_factory=dict)  # demand name -> namespaces of its pods
    failed: dict[str, str] = field(default_factory=dict)  # pod (ns/name) -> an error met planning it (skipped)

    def ask(self, ref: ModelRef, pod: Mapping[str, Any], nodes: Iterable[str]) -> None:
        """`nodes` must hold `ref` for `pod`."""
        name = demand_name(ref)
        self.refs.setdefault(name, ref)
        self.nodes.setdefault(name, set()).update(nodes)
        self.namespaces.setdefault(name, set()).add(str((pod.get("metadata") or {}).get("namespace") or ""))


def demand_name(ref: ModelRef) -> str:
    """The ModelCache that carries the controller's demand for `ref` (revision included): stable across restarts."""
    digest = hashlib.sha256(f"{ref.key}\0{ref.revision or ''}".encode()).hexdigest()[:16]
    return f"placement-{digest}"


def pod_key(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def gated(pod: Mapping[str, Any]) -> bool:
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return isinstance(gates, list) and any(isinstance(g, Mapping) and g.get("name") == GATE for g in gates)


def pod_state(pod: Mapping[str, Any], *, max_models: int = MAX_MODELS) -> PodModels:
    """`max_models`: the webhook's cap (its `--max-models`), checked again: annotations change after CREATE."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    annotations = meta.get("annotations") or {}
    phase = (pod.get("status") or {}).get("phase")
    if meta.get("deletionTimestamp") or phase in ("Succeeded", "Failed") or not isinstance(annotations, Mapping):
        return PodModels("done")
    if not wants_injection(annotations):
        return PodModels("done")
    try:
        refs = tuple(m.ref for m in parse_annotations(annotations, max_models=max_models).models)
    except (AnnotationError, InvalidReferenceError) as exc:  # edited after CREATE, past the webhook
        return PodModels("invalid", error=str(exc))
    if gated(pod):
        return PodModels("gated", refs)
    node = spec.get("nodeName")
    if isinstance(node, str) and node:
        return PodModels("bound", refs, node)
    return PodModels("waiting", refs)


def admit(pods: Iterable[Mapping[str, Any]], grants: Sequence[Mapping[str, Any]], *,
          per_namespace: int = MAX_DEMAND_PER_NAMESPACE, max_models: int = MAX_MODELS) -> Admission:
    """The pods the controller makes demand for, and a Refusal for each other pod that names models.

    `grants`: the ModelCaches an admin wrote (never the controller's own demand: it grants nothing); each of a
    pod's models must be allowed to its namespace as in cluster mode (`allow_undeclared` False), because a
    demand makes a node fetch and pin it. Pods in use come first (bound, then released), then gated pods oldest
    first: a namespace at its cap keeps what runs, and its newest pods wait."""
    out = Admission()
    decided: dict[tuple[ModelRef, str], str | None] = {}  # a Deployment's pods ask alike: decide once a pass
    held: dict[str, set[str]] = {}  # namespace -> demand names admitted so far
    states: list[tuple[Mapping[str, Any], PodModels]] = []
    for pod in pods:
        try:
            states.append((pod, pod_state(pod, max_models=max_models)))
        except Exception as exc:  # a bug only a hostile pod finds: it costs that pod, not the pass
            log.exception("pod %s: annotations unreadable", pod_key(pod))
            out.refused[pod_key(pod)] = Refusal("InvalidAnnotations", f"the placement controller cannot read this "
                                                f"pod's annotations ({type(exc).__name__}); fix or remove them")
    order = {"bound": 0, "waiting": 1, "gated": 2}
    states.sort(key=lambda ps: (order.get(ps[1].state, 3), _created(ps[0]), pod_key(ps[0])))
    for pod, state in states:
        key, ns = pod_key(pod), str((pod.get("metadata") or {}).get("namespace") or "")
        if state.state == "invalid":
            out.refused[key] = Refusal("InvalidAnnotations", f"{state.error}; no model is fetched for this pod "
                                                             "until its annotations are fixed")
            continue
        if state.state == "done":
            continue
        why = None
        for ref in state.refs:
            if (ref, ns) not in decided:
                decision = decide(ref, ns, grants, allow_undeclared=False)
                decided[ref, ns] = None if decision.allowed else decision.reason
            if why := decided[ref, ns]:
                break
        if why:
            out.refused[key] = Refusal("NotAllowed", f"no model is fetched for this pod: {why}")
            continue
        have = held.setdefault(ns, set())
        names = {demand_name(r) for r in state.refs}
        if len(have | names) > per_namespace:
            out.refused[key] = Refusal("TooManyModels", (
                f"namespace {ns} already holds {len(have)} models demanded for its pods, and the placement "
                f"controller demands at most {per_namespace} per namespace; this pod waits until fewer are "
                f"demanded (or a cluster admin prefetches its models with a ModelCache)"))
            continue
        have |= names
        out.pods.append(pod)
    return out


def _created(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("creationTimestamp") or "")


def holds(node: NodeFacts, refs: Iterable[ModelRef]) -> int:
    return sum(node.labels.get(r.label_key) == READY for r in refs)


def ready_nodes(pod: Mapping[str, Any], refs: Sequence[ModelRef], nodes: Iterable[NodeFacts]) -> list[str]:
    """Nodes the pod may run on that hold all its models: where releasing it lets it mount at once."""
    return sorted(n.name for n in nodes if holds(n, refs) == len(refs) and eligible(pod, n))


def via_dra(pod: Mapping[str, Any]) -> bool:
    """A pod whose models come through DRA (`weightcache.io/via: dra` or `dra-extended`): its node must list the
    devices."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(VIA) if isinstance(annotations, Mapping) else None
    return isinstance(value, str) and value.strip() in ("dra", "dra-extended")


def slice_models(slices: Iterable[Mapping[str, Any]], driver: str) -> dict[str, set[tuple[str, str | None]]]:
    """node -> (model key, revision) of every held device `driver`'s ResourceSlices list for it. A device that
    is only fetchable (attribute `ready` false, binding conditions) is not held."""
    out: dict[str, set[tuple[str, str | None]]] = {}
    for obj in slices:
        spec = obj.get("spec") or {}
        node = spec.get("nodeName")
        if spec.get("driver") != driver or not isinstance(node, str) or not node:
            continue
        held = out.setdefault(node, set())
        for device in spec.get("devices") or []:
            attrs = device.get("attributes") or {} if isinstance(device, Mapping) else {}
            if (attrs.get("ready") or {}).get("bool") is not True or device.get("bindingConditions"):
                continue
            key = (attrs.get("model") or {}).get("string")
            if isinstance(key, str):
                revision = (attrs.get("revision") or {}).get("string")
                held.add((key, revision if isinstance(revision, str) else None))
    return out


def dra_ready_nodes(ready: Iterable[str], refs: Sequence[ModelRef],
                    held: Mapping[str, set[tuple[str, str | None]]]) -> list[str]:
    """The `ready` nodes whose ResourceSlices list a device of each model (of its revision, when one is asked):
    a `via: dra` pod released earlier would find no device to allocate and fail scheduling."""
    from weightcache.uri import model_key

    def listed(node: str, ref: ModelRef) -> bool:
        key = model_key(ref.uri)
        return any(k == key and (not ref.revision or r == ref.revision) for k, r in held.get(node, ()))
    return sorted(n for n in ready if all(listed(n, ref) for ref in refs))


def plan(pods: Iterable[Mapping[str, Any]], nodes: Sequence[NodeFacts], current: Mapping[str, Iterable[str]],
         *, budgets: Mapping[str, int] | None = None, sizes: Mapping[str, int] | None = None,
         max_models: int = MAX_MODELS) -> Plan:
    """Which nodes must hold which models. `current`: demand name -> nodes already asked (from the API).
    `budgets` (node -> disk budget in bytes) and `sizes` (demand name -> bytes, where a node reported it) keep
    a node from being asked for more than its budget holds; an unknown budget or size does not limit."""
    out = Plan()
    asked = {name: set(ns) for name, ns in current.items()}
    assigned: dict[str, int] = {}  # node -> GPUs promised to gated pods in this plan
    by_name = {n.name: n for n in nodes}
    gated_pods = _placed_and_gated(pods, out, asked, max_models)
    on_node: dict[str, set[str]] = {}  # node -> demand names it is asked to hold
    for name, ns in [*asked.items(), *out.nodes.items()]:
        for n in ns:
            on_node.setdefault(n, set()).add(name)

    def fits(node: NodeFacts, refs: Sequence[ModelRef]) -> bool:
        budget = (budgets or {}).get(node.name)
        if budget is None:
            return True
        held = on_node.get(node.name, set()) | {demand_name(r) for r in refs}
        return sum((sizes or {}).get(name, 0) for name in held) <= budget

    for pod, state in gated_pods:
        try:
            need = gpu_request(pod)
            candidates = [n for n in nodes if eligible(pod, n) and (holds(n, state.refs) or fits(n, state.refs))]
            if not candidates:
                continue  # nothing can run it: no demand; the progress Event says why
            best = min(candidates, key=lambda n: _rank(n, state.refs, asked, need, assigned))
        except Exception as exc:  # one pod's spec must not stop the choice for the others
            out.failed[pod_key(pod)] = f"{type(exc).__name__}: {exc}"
            continue
        out.chosen[pod_key(pod)] = best.name
        assigned[best.name] = assigned.get(best.name, 0) + need
        for ref in state.refs:
            out.ask(ref, pod, (best.name,))
            asked.setdefault(demand_name(ref), set()).add(best.name)
            on_node.setdefault(best.name, set()).add(demand_name(ref))
    out.nodes = {name: {n for n in ns if n in by_name} for name, ns in out.nodes.items()}
    return out


def _placed_and_gated(pods: Iterable[Mapping[str, Any]], out: Plan, asked: Mapping[str, set[str]],
                      max_models: int) -> list[tuple[Mapping[str, Any], PodModels]]:
    """The demand of pods already bound or waiting into `out`; the gated pods, oldest first, to choose for."""
    gated: list[tuple[Mapping[str, Any], PodModels]] = []
    for pod in pods:
        try:
            state = pod_state(pod, max_models=max_models)
        except Exception as exc:  # admit() refused it already in the controller; a pure caller learns it here
            out.failed[pod_key(pod)] = f"{type(exc).__name__}: {exc}"
            continue
        if state.state == "gated":
            gated.append((pod, state))
        elif state.state == "bound":
            for ref in state.refs:
                out.ask(ref, pod, (state.node,))
        elif state.state == "waiting":
            for ref in state.refs:
                out.ask(ref, pod, asked.get(demand_name(ref), ()))
    return sorted(gated, key=lambda p: (_created(p[0]), pod_key(p[0])))


def _rank(node: NodeFacts, refs: Sequence[ModelRef], asked: Mapping[str, set[str]], need: int,
          assigned: Mapping[str, int]) -> tuple[int, int, int, int, str]:
    """Smaller is better: room for the pod's GPUs, then models held, then models being fetched, then free GPUs."""
    free = node.gpus_free - assigned.get(node.name, 0)
    fetching = sum(node.name in asked.get(demand_name(r), ()) for r in refs)
    return (0 if free >= need else 1, -holds(node, refs), -fetching, -free, node.name)


def memory_nodes(nodes: Sequence[NodeFacts], count: int, previous: Iterable[str]) -> list[str]:
    """`count` of `nodes` to keep a model resident in RAM: previous picks that are still there first (a move
    costs a reload) unless two of them share a zone while another zone has none (a node seen late, e.g. one the
    autoscaler added: the spread is worth one reload), then round-robin over zones (most free GPUs first within a
    zone), so one zone's outage leaves the others hot."""
    if count <= 0:
        return []
    by_name = {n.name: n for n in nodes}

    def zone(name: str) -> str:
        return by_name[name].labels.get(ZONE, "")

    still = [name for name in sorted(set(previous)) if name in by_name]
    picked: list[str] = []
    for name in still:  # the first previous pick of each zone stays
        if len(picked) < count and zone(name) not in {zone(p) for p in picked}:
            picked.append(name)
    unused_zones = len({n.labels.get(ZONE, "") for n in nodes}) - len({zone(p) for p in picked})
    room = (count - len(picked)) - min(count - len(picked), unused_zones)  # slots no unused zone needs
    picked += [name for name in still if name not in picked][:room]
    return sorted(picked + _round_robin(nodes, count - len(picked), picked))


def _round_robin(nodes: Sequence[NodeFacts], count: int, picked: Sequence[str]) -> list[str]:
    """`count` more of `nodes`, one zone after another (zones `picked` has none of first), most free GPUs first
    within a zone."""
    zones: dict[str, list[NodeFacts]] = {}
    for n in sorted(nodes, key=lambda n: (-n.gpus_free, n.name)):
        if n.name not in picked:
            zones.setdefault(n.labels.get(ZONE, ""), []).append(n)
    used = {n.labels.get(ZONE, "") for n in nodes if n.name in picked}
    more: list[str] = []
    while len(more) < count and any(zones.values()):
        for z in sorted(zones, key=lambda z: (z in used, z)):
            if zones[z] and len(more) < count:
                more.append(zones[z].pop(0).name)
                used.add(z)
    return more
