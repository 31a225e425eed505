"""What this node tells the cluster: readiness labels on its Node, its own ModelCacheNode status, and Events.

Wire format of the per-node object, written only by the daemon on node `<node>` (one writer: no contention):

    apiVersion: weightcache.io/v1alpha1
    kind: ModelCacheNode
    metadata: {name: <node>, ownerReferences: [Node <node>]}   # deleted with its Node
    status:
      updated: 2026-12-02T16:00:00Z
      ready: 1/2                               # models Ready of those listed (`kubectl get mcn`)
      progress: 3.2 GiB / 16 GiB               # bytes done of all, summed (`kubectl get mcn -o wide`)
      peerAddress: http://10.0.0.5:9479        # this node's peer listener (docs/peers.md), when peerListen is set
      models:
        <ModelCache name>: {phase: Fetching, bytesDone: 1, bytesTotal: 4, snapshot: "", message: "", time: ...,
                            observedGeneration: 3}

Progress is coalesced: a phase change is written at once, byte counts at most once per `min_interval` seconds,
so a fetch costs the API server a handful of writes. Every message passes `redact` first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException

from weightcache.errors import ClusterError
from weightcache.kube import (
    API_VERSION,
    GROUP,
    MESSAGE_MAX,
    MODELCACHE_KIND,
    MODELCACHENODE_KIND,
    MODELCACHENODES,
    VERSION,
)
from weightcache.kube.taint import read_node
from weightcache.redact import redact
from weightcache.units import fmt_bytes

log = logging.getLogger(__name__)


Phase = Literal["Pending", "Fetching", "Ready", "Failed"]
PHASES: tuple[str, ...] = ("Pending", "Fetching", "Ready", "Failed")
MERGE_PATCH = "application/merge-patch+json"
MAX_EVENT_NAMES = 4096  # Events whose count is remembered (repeats bump it); the oldest is forgotten past this


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class ModelState:
    """One model's state on this node."""

    phase: Phase
    bytes_done: int = 0
    bytes_total: int = 0
    snapshot: str = ""
    message: str = ""
    time: str = field(default_factory=_now)  # RFC 3339, UTC
    observed_generation: int | None = None  # the ModelCache generation this state answers

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase {self.phase!r} is not one of {', '.join(PHASES)}")


class ModelStateWire(TypedDict, total=False):
    phase: str
    bytesDone: int
    bytesTotal: int
    snapshot: str
    message: str
    time: str
    observedGeneration: int


def to_wire(state: ModelState) -> ModelStateWire:
    wire: ModelStateWire = {
        "phase": state.phase,
        "bytesDone": state.bytes_done,
        "bytesTotal": state.bytes_total,
        "snapshot": state.snapshot,
        "message": redact(state.message, limit=MESSAGE_MAX),
        "time": state.time,
    }
    if state.observed_generation is not None:
        wire["observedGeneration"] = state.observed_generation
    return wire


def from_wire(wire: dict[str, Any]) -> ModelState:
    phase = wire.get("phase") if wire.get("phase") in PHASES else "Pending"
    return ModelState(
        phase=phase,  # type: ignore[arg-type]
        bytes_done=int(wire.get("bytesDone") or 0),
        bytes_total=int(wire.get("bytesTotal") or 0),
        snapshot=str(wire.get("snapshot") or ""),
        message=str(wire.get("message") or ""),
        time=str(wire.get("time") or ""),
        observed_generation=wire.get("observedGeneration"),
    )


@contextlib.contextmanager
def _api(what: str) -> Iterator[None]:
    """Turn the client's failures into ClusterError: the daemon handles one error type, without raw responses."""
    try:
        yield
    except ApiException as exc:
        raise ClusterError(f"{what} failed: HTTP {exc.status} {exc.reason}; check the daemon's RBAC "
                           "(deploy/daemonset/rbac.yaml) and the API server", status=exc.status or 0) from exc
    except urllib3.exceptions.HTTPError as exc:
        raise ClusterError(f"{what} failed: API server unreachable ({type(exc).__name__}); it will be retried") from exc


def _same(a: ModelState, b: ModelState) -> bool:
    """Equal apart from the timestamp: nothing new to write."""
    return dataclasses.replace(a, time=b.time) == b


class NodeReporter:
    """Writes this node's labels, its ModelCacheNode status and Events. Thread-safe; calls block (use a thread)."""

    def __init__(
        self,
        api_client: kubernetes.client.ApiClient,
        node_name: str,
        *,
        namespace_for_events: str = "default",
        min_interval: float = 3.0,
        component: str = "weightcache-daemon",
    ) -> None:
        """`namespace_for_events`: core/v1 Events about a cluster-scoped object (ModelCache) must live in
        "default"; the API server rejects them in any other namespace."""
        self._core = kubernetes.client.CoreV1Api(api_client)
        self._custom = kubernetes.client.CustomObjectsApi(api_client)
        self.node_name = node_name
        self.namespace_for_events = namespace_for_events
        self.min_interval = min_interval
        self.component = component
        self._lock = threading.Lock()
        # one status write at a time, in the order their states were taken: two threads' patches (a fetch's
        # "Fetching", its "Ready" a moment later) could reach the API server crossed, and the older one stayed
        self._writing = threading.Lock()
        self._pending: dict[str, ModelState | None] = {}
        self._written: dict[str, ModelState] = {}
        self._last_write = 0.0
        self._timer: threading.Timer | None = None
        self._object_ready = False
        self._event_counts: dict[str, int] = {}
        self.writes = 0  # status writes sent (for tests and metrics)
        self.disk_budget: int | None = None  # sent with each status write: placement asks no more of the node
        self.peer_address: str | None = None  # sent with each status write: other daemons fetch from it

    # labels -----------------------------------------------------------------------------------------------------
    def read_node(self) -> dict[str, Any]:
        """This Node as the API server serves it (JSON): its labels, taints and creation time."""
        return read_node(self._core.api_client, self.node_name)

    def node_labels(self) -> dict[str, str]:
        """The Node's current labels (what `desired.plan` selects on)."""
        return node_labels(self.read_node())

    def set_labels(self, labels: dict[str, str | None]) -> None:
        """Set labels on this Node, or remove those whose value is None, in one JSON merge patch (null deletes)."""
        if not labels:
            return
        with _api(f"labelling Node {self.node_name}"):
            self._core.patch_node(self.node_name, {"metadata": {"labels": labels}}, _content_type=MERGE_PATCH)

    # per-node status --------------------------------------------------------------------------------------------
    def report(self, model_name: str, state: ModelState) -> None:
        """Record a model's state; written now on a phase change, else coalesced to one write per min_interval.
        A state equal to the one already written (time aside) writes nothing."""
        with self._lock:
            written = self._written.get(model_name)
            if model_name not in self._pending and written is not None and _same(state, written):
                return
            previous = self._pending.get(model_name) or written
            self._pending[model_name] = state
            urgent = previous is None or previous.phase != state.phase
            due = time.monotonic() - self._last_write >= self.min_interval
        if urgent or due:
            self.flush()
        else:
            self._schedule()

    def report_many(self, states: Mapping[str, ModelState | None]) -> None:
        """Record several models' states (None forgets one) and write them in one merge patch: a daemon starting
        with 500 ModelCaches makes one status write, not 500."""
        with self._lock:
            self._pending.update(states)
        self.flush()

    def forget(self, model_name: str) -> None:
        """Remove a model from this node's status (its ModelCache was deleted or no longer selects the node)."""
        with self._lock:
            self._pending[model_name] = None
        self.flush()

    def flush(self) -> None:
        """Write every pending state now, in one merge patch of the status subresource."""
        with self._writing:
            self._flush()

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        if not pending:
            return
        patch: dict[str, Any] = {"status": {"updated": _now(), **self._summary(pending),
                                            "models": {k: (to_wire(v) if v else None) for k, v in pending.items()}}}
        if self.disk_budget is not None:
            patch["status"]["diskBudgetBytes"] = self.disk_budget
        if self.peer_address is not None:
            patch["status"]["peerAddress"] = self.peer_address
        try:
            self._patch_status(patch)
        except ClusterError:
            with self._lock:  # keep what failed so the next flush retries it, unless newer states arrived
                for key, value in pending.items():
                    self._pending.setdefault(key, value)
            raise
        with self._lock:
            self._last_write = time.monotonic()
            for key, value in pending.items():
                if value is None:
                    self._written.pop(key, None)
                else:
                    self._written[key] = value

    def _summary(self, pending: Mapping[str, ModelState | None]) -> dict[str, str]:
        """`kubectl get mcn`'s columns (the CRD's printer columns cannot add up a map): models Ready of all, and
        bytes done of all (-o wide), over what was written and what this patch writes."""
        with self._lock:
            states = [v for v in ({**self._written, **pending}).values() if v is not None]
        done, total = sum(s.bytes_done for s in states), sum(s.bytes_total for s in states)
        return {"ready": f"{sum(s.phase == 'Ready' for s in states)}/{len(states)}",
                "progress": f"{fmt_bytes(done)} / {fmt_bytes(total)}"}

    def close(self) -> None:
        """Flush what is pending and stop the coalescing timer."""
        self.flush()

    def _schedule(self) -> None:
        with self._lock:
            if self._timer is not None:
                return
            delay = max(0.0, self.min_interval - (time.monotonic() - self._last_write))
            self._timer = threading.Timer(delay, self._flush_quietly)
            self._timer.daemon = True
            self._timer.start()

    def _flush_quietly(self) -> None:
        with self._lock:
            self._timer = None
        try:
            self.flush()
        except ClusterError as exc:  # a timer thread has no caller: log, and the next report retries
            log.warning("writing ModelCacheNode %s status failed: %s", self.node_name, exc)

    def _patch_status(self, patch: dict[str, Any]) -> None:
        what = f"writing ModelCacheNode {self.node_name} status"
        if not self._object_ready:
            self._ensure_object()
        try:
            with _api(what):
                self._custom.patch_cluster_custom_object_status(GROUP, VERSION, MODELCACHENODES, self.node_name, patch)
        except ClusterError as exc:
            if exc.status != 404:
                raise
            self._ensure_object()  # deleted under us (e.g. by hand): recreate once
            with _api(what):
                self._custom.patch_cluster_custom_object_status(GROUP, VERSION, MODELCACHENODES, self.node_name, patch)
        self.writes += 1

    def _ensure_object(self) -> None:
        body: dict[str, Any] = {
            "apiVersion": API_VERSION,
            "kind": MODELCACHENODE_KIND,
            "metadata": {"name": self.node_name},
            "spec": {"nodeName": self.node_name},
        }
        try:  # owned by the Node: the garbage collector removes it with the Node
            uid = self._core.read_node(self.node_name).metadata.uid
            owner = {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": uid}
            body["metadata"]["ownerReferences"] = [owner]
        except (ApiException, urllib3.exceptions.HTTPError) as exc:
            log.warning("Node %s not readable (%s); ModelCacheNode created without owner", self.node_name,
                        type(exc).__name__)
        try:
            with _api(f"creating ModelCacheNode {self.node_name}"):
                self._custom.create_cluster_custom_object(GROUP, VERSION, MODELCACHENODES, body)
        except ClusterError as exc:
            if exc.status != 409:  # 409: it exists already, which is what we want
                raise
        self._object_ready = True

    # events -----------------------------------------------------------------------------------------------------
    def event(self, model_cache: dict[str, Any], reason: str, message: str, type: str = "Warning") -> None:
        """Record a core/v1 Event about a ModelCache; repeats of the same (node, reason, message) bump `count`."""
        meta = model_cache.get("metadata") or {}
        self._record({"apiVersion": API_VERSION, "kind": MODELCACHE_KIND, "name": str(meta.get("name", "")),
                      "uid": meta.get("uid"), "resourceVersion": meta.get("resourceVersion")}, reason, message, type)

    def node_event(self, reason: str, message: str, type: str = "Normal", uid: str | None = None) -> None:
        """Record a core/v1 Event about this Node (cluster-scoped: in `namespace_for_events`, as kubelet's are)."""
        self._record({"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": uid}, reason, message, type)

    def pod_event(self, namespace: str, name: str, uid: str, reason: str, message: str,
                  type: str = "Normal") -> None:
        """Record a core/v1 Event about a pod on this node, in the pod's namespace (its cold-start stages and its
        engine's compile-cache result: docs/telemetry.md). deploy/daemonset/node-policy.yaml lets the daemon write
        only Events that name its own node as their source."""
        self._record({"apiVersion": "v1", "kind": "Pod", "name": name, "namespace": namespace, "uid": uid}, reason,
                     message, type, namespace=namespace)

    def _record(self, involved: dict[str, Any], reason: str, message: str, type: str, *,
                namespace: str | None = None) -> None:
        what = f"{involved['kind']} {involved['name']}"
        events_ns = namespace or self.namespace_for_events
        message = redact(message, limit=MESSAGE_MAX)
        digest = hashlib.sha256(f"{self.node_name}\0{reason}\0{message}".encode()).hexdigest()[:16]
        name = f"{involved['name'][:230]}.{digest}"  # pod names run to 253 characters; an Event's must fit too
        now = _now()
        with self._lock:
            count = self._event_counts.get(name, 0) + 1
            if count == 1 and len(self._event_counts) >= MAX_EVENT_NAMES:  # every pod adds some: keep the newest
                del self._event_counts[next(iter(self._event_counts))]
            self._event_counts[name] = count
        try:
            if count > 1:
                try:
                    self._core.patch_namespaced_event(name, events_ns,
                                                      {"count": count, "lastTimestamp": now}, _content_type=MERGE_PATCH)
                    return
                except ApiException as exc:
                    if exc.status != 404:
                        raise
            body = {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": name, "namespace": events_ns},
                "involvedObject": {k: v for k, v in involved.items() if v},
                "reason": reason,
                "message": message,
                "type": type,
                "source": {"component": self.component, "host": self.node_name},
                "reportingComponent": f"{GROUP}/daemon",
                "reportingInstance": self.node_name,
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
            }
            try:
                self._core.create_namespaced_event(events_ns, body)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                self._core.patch_namespaced_event(name, events_ns,
                                                  {"count": count + 1, "lastTimestamp": now}, _content_type=MERGE_PATCH)
        except ApiException as exc:  # Events are best effort: never fail a reconcile because of one
            log.warning("recording Event %s on %s failed: HTTP %s %s", reason, what, exc.status, exc.reason)
        except urllib3.exceptions.HTTPError as exc:
            log.warning("recording Event %s on %s failed: %s", reason, what, exc.__class__.__name__)


def node_labels(node: Mapping[str, Any]) -> dict[str, str]:
    """The labels of a Node read as JSON (`read_node`)."""
    labels = (node.get("metadata") or {}).get("labels")
    return {str(k): str(v) for k, v in labels.items()} if isinstance(labels, Mapping) else {}
