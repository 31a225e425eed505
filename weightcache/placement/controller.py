"""The placement controller: gated pods -> demand on chosen nodes -> release to the nodes that hold the model.

Level-triggered and stateless: every pass derives the demand from the API (gated pods, bound pods, the
ModelCaches it owns, node labels, ModelCacheNode reports), so a restart or a new leader picks up where the
last one stopped, and nothing is released on a memory of readiness — only on the node labels of this pass.

    watch pods, nodes, ModelCaches, ModelCacheNodes ─► pass (leader only, on change and every `resync` s):
        choice.admit ─► the pods the policy and the caps allow; a Warning Event on each other one
        choice.plan  ─► ModelCache placement-<hash> {source, nodeNames, demandNamespaces}   create / patch / delete
                        (at most `max_writes` a pass, round-robin over the namespaces that asked)
        memory       ─► status.memoryNodes of every ModelCache with spec.memory.nodes
        rollouts     ─► status.revision and status.rollout of every ModelCache (weightcache/kube/rollout.py)
        per gated pod: ready on a node it may run on (with room for its GPUs when one has room)?
            yes ─► one JSON patch: test resourceVersion, add required affinity (label In [ready]), remove gate
            no  ─► Event on the pod: the model's bytes and ETA on the chosen node, at most every `event_interval`

Every pod is untrusted (annotations stay editable after CREATE): an error in one pod is logged and put in an
Event on that pod, and the pass goes on for the others.
"""

from __future__ import annotations

import datetime
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import urllib3

from weightcache.kube import API_VERSION, GROUP, MODELCACHES, VERSION, listers, rollout
from weightcache.kube.client import ApiClient, ApiException, CoreV1Api, CustomObjectsApi
from weightcache.kube.cluster_cli import model_cache_body
from weightcache.kube.watch import ModelCacheWatcher
from weightcache.placement import CONTROLLER, MANAGED_BY, choice
from weightcache.placement.choice import MAX_DEMAND_PER_NAMESPACE
from weightcache.placement.lease import LeaderElector
from weightcache.placement.nodes import NodeFacts, eligible, gpu_request, node_facts
from weightcache.pods.annotations import MAX_MODELS, PLACEMENT
from weightcache.pods.patch import required_affinity
from weightcache.progress import Progress
from weightcache.redact import redact
from weightcache.uri import ModelRef, model_key, parse_ref
from weightcache.vocabulary import DRA_DRIVER, GATE, MODEL_KEY_LABEL

log = logging.getLogger(__name__)

MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


@dataclass
class _Seen:
    """What the last progress Event of a pod said, and the bytes it saw then (for a rate)."""

    at: float
    message: str
    bytes_done: int


@dataclass(frozen=True)
class Pass:
    """What one pass did (for tests and logs)."""

    released: tuple[str, ...]
    demand: dict[str, tuple[str, ...]]  # demand name -> nodes
    refused: dict[str, choice.Refusal]  # pod (ns/name) -> why it makes no demand
    pending: int = 0  # demand writes left for the next pass (over `max_writes`)


class Controller:
    def __init__(self, api_client: ApiClient, *, elector: LeaderElector | None = None,
                 event_interval: float = 5.0, resync: float = 2.0,
                 clock: Callable[[], float] = time.monotonic,
                 max_demand_per_namespace: int = MAX_DEMAND_PER_NAMESPACE, max_writes: int = 64,
                 max_models: int = MAX_MODELS) -> None:
        self._core = CoreV1Api(api_client)
        self._custom = CustomObjectsApi(api_client)
        self.elector = elector
        self.event_interval, self.resync, self._clock = event_interval, resync, clock
        # A namespace may hold at most this many demanded models; a pass writes at most `max_writes` demand
        # changes, so one tenant's thousand models cannot hold up another tenant's one for long.
        self.max_demand_per_namespace, self.max_writes = max_demand_per_namespace, max_writes
        self.max_models = max_models  # the webhook's --max-models: a pod over it makes no demand
        self._wake = threading.Event()

        def kick(_items: list[dict[str, Any]]) -> None:
            self._wake.set()

        self.pods = ModelCacheWatcher(api_client, lister=listers.pods(api_client), on_change=kick)
        self.nodes = ModelCacheWatcher(api_client, lister=listers.nodes(api_client), on_change=kick)
        self.reports = ModelCacheWatcher(api_client, lister=listers.model_cache_nodes(api_client), on_change=kick)
        self.caches = ModelCacheWatcher(api_client, on_change=kick)
        self._watchers = (self.pods, self.nodes, self.reports, self.caches)
        # ResourceSlices, for `via: dra` pods only: not in `synced()`, so a cluster without resource.k8s.io/v1
        # places CSI pods as before, and a DRA pod waits until the slices are listed.
        self.slices = ModelCacheWatcher(api_client, lister=listers.resource_slices(api_client), on_change=kick)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: dict[str, _Seen] = {}
        self.passes = 0

    # lifecycle --------------------------------------------------------------------------------------------------
    def start(self, *, loop: bool = True) -> None:
        """`loop=False` only watches: the caller runs `reconcile()` itself (tests that count one pass's writes)."""
        for w in (*self._watchers, self.slices):
            w.start()
        if self.elector is not None:
            self.elector.start()
        if loop:
            self._thread = threading.Thread(target=self._run, name="placement", daemon=True)
            self._thread.start()

    def stop(self, *, release: bool = True) -> None:
        """`release=False` leaves the Lease to expire, as a crashed leader would."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10.0)
        for w in (*self._watchers, self.slices):
            w.stop()
        if self.elector is not None:
            self.elector.stop(release=release)

    def leading(self) -> bool:
        return self.elector is None or self.elector.is_leader()

    def synced(self) -> bool:
        return all(w.wait_synced(0) for w in self._watchers)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.resync)
            self._wake.clear()
            if self._stop.is_set() or not self.leading() or not self.synced():
                continue  # a pass on a partial view could delete demand that still exists
            try:
                self.reconcile()
            except Exception:  # level-triggered: the next pass starts over
                log.exception("placement pass failed")

    # one pass ---------------------------------------------------------------------------------------------------
    def reconcile(self) -> Pass:
        pods = self.pods.items()
        facts = self._facts(pods)
        caches = self.caches.items()
        owned = {mc["metadata"]["name"]: mc for mc in caches if _owned(mc)}
        current = {name: _names((mc.get("spec") or {}).get("nodeNames")) for name, mc in owned.items()}
        budgets, sizes = _budgets_and_sizes(self.reports.items())
        admission = choice.admit(pods, [mc for mc in caches if not _owned(mc)],
                                 per_namespace=self.max_demand_per_namespace, max_models=self.max_models)
        plan = choice.plan(admission.pods, facts, current, budgets=budgets, sizes=sizes, max_models=self.max_models)
        refused = dict(admission.refused)
        refused.update({k: choice.Refusal("PlacementFailed", f"the placement controller could not place this pod "
                                                             f"({why}); it stays as it is")
                        for k, why in plan.failed.items()})
        demand = {name: tuple(sorted(nodes)) for name, nodes in plan.nodes.items() if nodes}
        pending = self._write_demand(demand, plan, owned)
        self._memory(caches, facts)
        self._rollouts(caches)
        self._label_keys(caches)
        by_key = {choice.pod_key(p): p for p in pods}
        self._refuse(refused, by_key)
        admitted = {choice.pod_key(p) for p in admission.pods} - set(plan.failed)
        released = [choice.pod_key(p) for p in pods
                    if choice.pod_key(p) in admitted and choice.gated(p) and self._release_or_report(p, facts, plan)]
        self._seen = {k: v for k, v in self._seen.items() if k in by_key}
        self.passes += 1
        if pending:
            self._wake.set()  # the rest of the demand goes out in the next pass, without waiting for `resync`
        return Pass(tuple(released), demand, refused, pending)

    def _facts(self, pods: list[dict[str, Any]]) -> list[NodeFacts]:
        """Each node's facts, with the pods bound to it."""
        by_node: dict[str, list[dict[str, Any]]] = {}
        for pod in pods:
            by_node.setdefault(str((pod.get("spec") or {}).get("nodeName") or ""), []).append(pod)
        return [node_facts(n, by_node.get(str((n.get("metadata") or {}).get("name")), [])) for n in self.nodes.items()]

    def _refuse(self, refused: Mapping[str, choice.Refusal], by_key: Mapping[str, dict[str, Any]]) -> None:
        """A Warning Event on each refused pod, at most `max_writes` a pass: a thousand bad pods must not delay
        one."""
        budget = self.max_writes
        for key, refusal in refused.items():
            if budget > 0 and key in by_key and self.leading():
                budget -= self._event(by_key[key], refusal.reason, refusal.message, "Warning")

    def _write_demand(self, demand: Mapping[str, tuple[str, ...]], plan: choice.Plan,
                      owned: Mapping[str, dict[str, Any]]) -> int:
        """Create, patch and delete demand, at most `max_writes` a pass taken round-robin over the namespaces
        that asked (deletes take turns as one more), so a namespace with many models delays another's first
        model by one turn, not by all of its own. Returns how many writes are left for the next pass."""
        queues: dict[str, list[Callable[[], bool]]] = {}
        for name, nodes in demand.items():
            namespaces = sorted(plan.namespaces.get(name, ()))
            spec = (owned.get(name) or {}).get("spec") or {}
            if name in owned and (_names(spec.get("nodeNames")), _names(spec.get("demandNamespaces"))) == (
                    list(nodes), namespaces):
                continue
            queues.setdefault(namespaces[0] if namespaces else "", []).append(
                functools.partial(self._put_demand, name, plan.refs[name], nodes, namespaces, name in owned))
        for name in owned:
            if name not in demand:  # no pod needs it any more: the daemons unpin it
                queues.setdefault("(deletes)", []).append(functools.partial(self._delete_demand, name))
        writes = [w for turn in itertools.zip_longest(*(queues[k] for k in sorted(queues))) for w in turn if w]
        done = 0
        for write in writes[:self.max_writes]:
            if not self.leading():
                return 0
            done += write()
        # Left over only counts when this pass got writes through: a failing API waits for `resync`, unhurried.
        return max(0, len(writes) - self.max_writes) if done else 0

    def _put_demand(self, name: str, ref: ModelRef, nodes: tuple[str, ...], namespaces: list[str],
                    exists: bool) -> bool:
        if exists:
            ok = self._call(f"patching ModelCache {name}", self._custom.patch_cluster_custom_object, GROUP, VERSION,
                            MODELCACHES, name, {"spec": {"nodeNames": list(nodes), "demandNamespaces": namespaces}})
        else:
            body = model_cache_body(ref, name=name, node_selector={}, tier="disk", allowed_namespaces=[])
            body["metadata"]["labels"][MANAGED_BY] = CONTROLLER
            # demand grants no namespace anything; it says which asked, and each node decides for them
            body["spec"].update(nodeNames=list(nodes), demandNamespaces=namespaces, allowedNamespaces=[])
            ok = self._call(f"creating ModelCache {name}", self._custom.create_cluster_custom_object,
                            GROUP, VERSION, MODELCACHES, body)
        log.info("demand %s (%s) on %s for %s", name, ref, ", ".join(nodes), ", ".join(namespaces))
        return ok

    def _delete_demand(self, name: str) -> bool:
        ok = self._call(f"deleting ModelCache {name}", self._custom.delete_cluster_custom_object,
                        GROUP, VERSION, MODELCACHES, name)
        log.info("demand %s released: no pod needs it", name)
        return ok

    def _label_keys(self, caches: list[dict[str, Any]]) -> None:
        """Every ModelCache carries `weightcache.io/model-key`, the key of its source, whoever wrote it: the DRA
        claim policy (deploy/dra/claim-policy.yaml) finds a model's ModelCaches by that label (CEL cannot hash
        `spec.source`), so one applied by hand without it would leave its model's devices claimable from any
        namespace. At most `max_writes` labels a pass."""
        budget = self.max_writes
        for mc in caches:
            try:
                key = model_key(parse_ref(str((mc.get("spec") or {}).get("source") or "")).uri)
            except ValueError:  # a source the nodes refuse too: no devices to protect
                continue
            name = str((mc.get("metadata") or {}).get("name"))
            if ((mc.get("metadata") or {}).get("labels") or {}).get(MODEL_KEY_LABEL) == key or budget <= 0:
                continue
            budget -= 1
            if self._call(f"labelling ModelCache {name}", self._custom.patch_cluster_custom_object, GROUP, VERSION,
                          MODELCACHES, name, {"metadata": {"labels": {MODEL_KEY_LABEL: key}}}):
                log.info("labelled ModelCache %s %s=%s for the DRA claim policy", name, MODEL_KEY_LABEL, key)

    def _memory(self, caches: list[dict[str, Any]], facts: list[NodeFacts]) -> None:
        """status.memoryNodes of every ModelCache with spec.memory.nodes (desired.plan reads it on each node)."""
        for mc in caches:
            spec, status = mc.get("spec") or {}, mc.get("status") or {}
            memory = spec.get("memory")
            if not isinstance(memory, Mapping) or not isinstance(memory.get("nodes"), int):
                continue
            selector = spec.get("nodeSelector") if isinstance(spec.get("nodeSelector"), Mapping) else {}
            names = set(_names(spec.get("nodeNames")))
            selected = [n for n in facts if n.name in names
                        or (selector and all(n.labels.get(k) == v for k, v in selector.items()))]
            picked = choice.memory_nodes(selected, memory["nodes"], _names(status.get("memoryNodes")))
            if picked != _names(status.get("memoryNodes")) and self.leading():
                name = mc["metadata"]["name"]
                self._call(f"writing ModelCache {name} status", self._custom.patch_cluster_custom_object_status,
                           GROUP, VERSION, MODELCACHES, name, {"status": {"memoryNodes": picked}})

    def _rollouts(self, caches: list[dict[str, Any]]) -> None:
        """Move each ModelCache's revision rollout on (weightcache/kube/rollout.py): status.revision and
        status.rollout, which every daemon reads. Its own demand never changes revision: it has no rollout."""
        reports = {str((r.get("spec") or {}).get("nodeName") or (r.get("metadata") or {}).get("name")):
                   (r.get("status") or {}).get("models") or {} for r in self.reports.items()}
        for mc in caches:
            patch = None if _owned(mc) else rollout.step(mc, reports)
            if patch is not None and self.leading():
                name = mc["metadata"]["name"]
                if self._call(f"writing ModelCache {name} status", self._custom.patch_cluster_custom_object_status,
                              GROUP, VERSION, MODELCACHES, name, {"status": patch}):
                    log.info("ModelCache %s rollout: %s", name, _rollout_line(patch))

    def _release_or_report(self, pod: dict[str, Any], facts: list[NodeFacts], plan: choice.Plan) -> bool:
        try:
            return self._release_or_report_one(pod, facts, plan)
        except Exception as exc:  # one pod's odd spec must not stop the release of the others
            log.exception("placement of pod %s failed", choice.pod_key(pod))
            self._event(pod, "PlacementFailed", f"the placement controller could not place this pod "
                        f"({type(exc).__name__}); it stays gated", "Warning")
            return False

    def _release_or_report_one(self, pod: dict[str, Any], facts: list[NodeFacts], plan: choice.Plan) -> bool:
        state = choice.pod_state(pod, max_models=self.max_models)
        if state.state != "gated" or not self.leading():
            return False
        ready = set(choice.ready_nodes(pod, state.refs, facts))
        if choice.via_dra(pod):  # released only to a node whose ResourceSlice lists the models' devices
            held = choice.slice_models(self.slices.items(), DRA_DRIVER) if self.slices.wait_synced(0) else {}
            ready = set(choice.dra_ready_nodes(ready, state.refs, held))
        need = gpu_request(pod)
        roomy = {n.name for n in facts if n.gpus_free >= need and eligible(pod, n)}
        if ready and (ready & roomy or not roomy):  # a ready node with room, or no room anywhere to wait for
            return self._release(pod, state)
        self._report(pod, state, plan.chosen.get(choice.pod_key(pod)))
        return False

    def _release(self, pod: dict[str, Any], state: choice.PodModels) -> bool:
        spec, meta = pod.get("spec") or {}, pod.get("metadata") or {}
        gates = spec.get("schedulingGates") or []
        i = next(i for i, g in enumerate(gates) if isinstance(g, Mapping) and g.get("name") == GATE)
        ops: list[Any] = [{"op": "test", "path": "/metadata/resourceVersion", "value": meta.get("resourceVersion")}]
        ops += required_affinity(spec, [r.label_key for r in state.refs])
        ops.append({"op": "remove", "path": f"/spec/schedulingGates/{i}"})
        ok = self._call(f"releasing pod {choice.pod_key(pod)}", self._core.patch_namespaced_pod,
                        meta["name"], meta["namespace"], ops, _content_type=JSON_PATCH)
        if ok:
            log.info("released pod %s: its models are ready on a node it may run on", choice.pod_key(pod))
            self._event(pod, "ModelReady", "models ready on a node; scheduling gate removed", "Normal", force=True)
        return ok

    def _report(self, pod: dict[str, Any], state: choice.PodModels, node: str | None) -> None:
        if node is None:
            self._event(pod, "NoNodeForModel", "no node can run this pod (nodeSelector, affinity, taints); it "
                        f"stays gated until one can (or set {PLACEMENT}: prefer)", "Warning")
            return
        done, total, parts = _fetch_progress(state, self._node_models(node))
        key, now = choice.pod_key(pod), self._clock()
        seen = self._seen.get(key)
        rate = (done - seen.bytes_done) / (now - seen.at) if seen and now > seen.at and done >= seen.bytes_done else 0.0
        eta = (total - done) / rate if rate > 0 and total else None
        line = Progress(", ".join(str(r) for r in state.refs), "downloading" if total else "queued", done, total,
                        0, 0, rate, eta).describe()
        message = f"waiting for the model on node {node}: {line} [{'; '.join(parts)}]"
        self._event(pod, "FetchingModel", message, "Normal", bytes_done=done)

    def _node_models(self, node: str) -> dict[str, Any]:
        """The models its ModelCacheNode reports (wire form, by demand name); none when it has no report."""
        report = next((r for r in self.reports.items() if (r.get("spec") or {}).get("nodeName") == node
                       or (r.get("metadata") or {}).get("name") == node), {})
        return dict((report.get("status") or {}).get("models") or {})

    def _event(self, pod: Mapping[str, Any], reason: str, message: str, kind: str, *, force: bool = False,
               bytes_done: int = 0) -> bool:
        """One Event per pod (created, then patched): at most every `event_interval` seconds, and only when it
        says something new. True when it tried to write one."""
        meta = pod.get("metadata") or {}
        key, now = choice.pod_key(pod), self._clock()
        seen = self._seen.get(key)
        if not force and seen is not None and (now - seen.at < self.event_interval or seen.message == message):
            return False
        self._seen[key] = _Seen(now, message, bytes_done)
        # pod names run to 253 characters; the Event's must stay within them
        name, ns, stamp = f"{str(meta['name'])[:230]}.weightcache-placement", meta["namespace"], _now()
        message = redact(message)[:1024]
        patch = {"message": message, "reason": reason, "type": kind, "lastTimestamp": stamp}
        try:
            self._core.patch_namespaced_event(name, ns, patch, _content_type=MERGE)
            return True
        except ApiException as exc:
            if exc.status != 404:
                log.warning("Event on pod %s not written: HTTP %s", key, exc.status)
                return True
        except urllib3.exceptions.HTTPError as exc:
            log.warning("Event on pod %s not written: %s", key, type(exc).__name__)
            return True
        body = {"apiVersion": "v1", "kind": "Event", "metadata": {"name": name, "namespace": ns},
                "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "namespace": ns,
                                   "uid": meta.get("uid")},
                "reason": reason, "message": message, "type": kind, "source": {"component": CONTROLLER},
                "reportingComponent": f"{GROUP}/placement", "reportingInstance": CONTROLLER,
                "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1}
        self._call(f"recording an Event on pod {key}", self._core.create_namespaced_event, ns, body)
        return True

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        """Writes are level-triggered: a failure is logged and the next pass tries again."""
        try:
            fn(*args, **kwargs)
        except ApiException as exc:
            log.warning("%s failed: HTTP %s %s", what, exc.status, exc.reason)
            return False
        except urllib3.exceptions.HTTPError as exc:
            log.warning("%s failed: %s", what, type(exc).__name__)
            return False
        return True


def _fetch_progress(state: choice.PodModels, models: Mapping[str, Any]) -> tuple[int, int, list[str]]:
    """(bytes done, bytes in all, `ref: phase (message)` for each) of a pod's models on a node."""
    done = total = 0
    parts = []
    for ref in state.refs:
        wire = models.get(choice.demand_name(ref)) or {}
        done, total = done + int(wire.get("bytesDone") or 0), total + int(wire.get("bytesTotal") or 0)
        message = f" ({redact(str(wire.get('message')))})" if wire.get("message") else ""
        parts.append(f"{ref}: {wire.get('phase') or 'Pending'}{message}")
    return done, total, parts


def _budgets_and_sizes(reports: list[dict[str, Any]]) -> tuple[dict[str, int], dict[str, int]]:
    """(node -> disk budget, model -> bytes) from the ModelCacheNode reports; what a node does not report
    is unknown and does not limit."""
    budgets: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for report in reports:
        node = str((report.get("spec") or {}).get("nodeName") or (report.get("metadata") or {}).get("name"))
        status = report.get("status") or {}
        if isinstance(status.get("diskBudgetBytes"), int):
            budgets[node] = status["diskBudgetBytes"]
        for name, wire in (status.get("models") or {}).items():
            total = wire.get("bytesTotal") if isinstance(wire, Mapping) else None
            if isinstance(total, int):
                sizes[name] = max(sizes.get(name, 0), total)
    return budgets, sizes


def _rollout_line(patch: Mapping[str, Any]) -> str:
    r = patch.get("rollout") or {}
    served = f"serving {patch['revision'] or '(latest)'}" if "revision" in patch else ""
    return " ".join(x for x in (served, str(r.get("phase") or ""), str(r.get("progress") or ""),
                                str(r.get("message") or "")) if x)


def _owned(mc: Mapping[str, Any]) -> bool:
    labels = (mc.get("metadata") or {}).get("labels") or {}
    return bool(labels.get(MANAGED_BY) == CONTROLLER and mc.get("apiVersion", API_VERSION) == API_VERSION)


def _names(value: Any) -> list[str]:
    return sorted(v for v in value if isinstance(v, str)) if isinstance(value, list) else []


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
