"""The daemon's bridge to Kubernetes (weightcache.kube) and to the CSI server (weightcache.csi).

Cluster mode is on when `weightcache.kube.client.load_api_client()` finds a config. The bridge turns the
watcher's ModelCaches and the node's labels into reconcile `Want`s, and the reconcile loop's results into
ModelCacheNode status, node labels and Events. Every method blocks (the kubernetes client is synchronous):
call them from a thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from weightcache.daemon.node import Node, Service, Want
from weightcache.errors import WeightcacheError
from weightcache.settings import node_name
from weightcache.vocabulary import STARTUP_TAINT, STARTUP_TAINT_EFFECT

if TYPE_CHECKING:
    from weightcache.csi.telemetry import Pod
    from weightcache.kube.client import ApiClient

log = logging.getLogger(__name__)

MAX_PENDING_EVENTS = 1024  # pod Events waiting for the API server; past this a new one is logged and dropped


class Cluster:
    def __init__(self, api_client: ApiClient, node_name: str, on_change: Callable[[], None],
                 disk_budget: Callable[[], int | None] = lambda: None) -> None:
        from weightcache.kube.report import NodeReporter
        from weightcache.kube.watch import ModelCacheWatcher

        self.node_name = node_name
        self.api_client = api_client  # also read by peer discovery (weightcache/peers/discovery.py)
        self.watcher = ModelCacheWatcher(api_client, on_change=lambda _items: on_change())
        self.reporter = NodeReporter(api_client, node_name)
        self._disk_budget = disk_budget  # read at each report: the budget is a live setting
        self._labels: dict[str, str] = {}
        self._node: dict[str, Any] = {}  # the Node as read by the last `desired()` call (JSON)
        self.started = time.time()  # the startup taint's clock when the Node carries no creationTimestamp
        self._invalid: dict[str, str] = {}  # ModelCache name -> error already reported as an Event
        # pods' Events are written on a thread of their own: a slow API server never holds up CSI calls
        self._events = ThreadPoolExecutor(1, thread_name_prefix="wc-pod-events")
        self._events_lock = threading.Lock()
        self._events_pending = 0

    def start(self) -> None:
        self.watcher.start()

    def stop(self) -> None:
        self.watcher.stop()
        self._events.shutdown(wait=False, cancel_futures=True)
        try:
            self.reporter.close()
        except WeightcacheError as exc:
            log.warning("final status write failed: %s", exc)

    def advertise_peer(self, address: str | None) -> None:
        """This node's peer listener, sent with each status write: other daemons fetch from it."""
        self.reporter.peer_address = address

    def synced(self) -> bool:
        return self.watcher.wait_synced(0)

    def model_caches(self) -> list[dict[str, Any]]:
        return self.watcher.items()

    def node_labels(self) -> dict[str, str]:
        """The labels read by the last `desired()` call (one Node read per reconcile pass)."""
        return dict(self._labels)

    def node(self) -> dict[str, Any]:
        """The Node read by the last `desired()` call."""
        return self._node

    def has_startup_taint(self) -> bool:
        from weightcache.kube.taint import has_taint

        return has_taint(self._node, STARTUP_TAINT, STARTUP_TAINT_EFFECT)

    def remove_startup_taint(self) -> bool:
        """Remove the startup taint from this Node, keeping its other taints; False when it was gone already."""
        from weightcache.kube.taint import remove_taint

        return remove_taint(self.api_client, self.node_name, STARTUP_TAINT, STARTUP_TAINT_EFFECT)

    def pod_event(self, pod: Pod, reason: str, message: str, type: str) -> None:
        """Queue an Event on `pod` (the CSI plugin's hook: never blocks)."""
        with self._events_lock:
            if self._events_pending >= MAX_PENDING_EVENTS:
                log.warning("Event %s on pod %s dropped: %d Events wait for the API server", reason, pod,
                            self._events_pending)
                return
            self._events_pending += 1

        def write() -> None:
            try:
                self.reporter.pod_event(pod.namespace, pod.name, pod.uid, reason, message, type)
            finally:
                with self._events_lock:
                    self._events_pending -= 1
        try:
            self._events.submit(write)
        except RuntimeError:  # stopping
            with self._events_lock:
                self._events_pending -= 1

    def node_event(self, reason: str, message: str, type: str) -> None:
        self.reporter.node_event(reason, message, type, uid=(self._node.get("metadata") or {}).get("uid"))

    def desired(self, adapter_views: Mapping[str, tuple[str, ...]] | None = None) -> list[Want]:
        """`adapter_views`: base model uri -> namespaces of the pods here with an adapter directory for it."""
        from weightcache.kube.desired import plan
        from weightcache.kube.report import node_labels

        self._node = self.reporter.read_node()
        self._labels = node_labels(self._node)
        caches = {str((mc.get("metadata") or {}).get("name")): mc for mc in self.model_caches()}
        wanted, invalid = plan(caches.values(), self._labels, self.node_name, adapter_views)
        for bad in invalid:
            if self._invalid.get(bad.name) != bad.error:
                self._invalid[bad.name] = bad.error
                self.reporter.event(caches[bad.name], "InvalidSpec", bad.error)
        return [Want(d.name, d.ref, d.tier, True, d.priority, caches[d.model_cache or d.name], d.namespaces,
                     d.warm_first, d.serves) for d in wanted]

    def report_many(self, states: Sequence[tuple[Want, str, Any, str]]) -> None:
        """(want, phase, snapshot or None, message) for each ModelCache whose state changed, in one write."""
        from weightcache.kube.report import ModelState

        batch: dict[str, ModelState | None] = {}
        self.reporter.disk_budget = self._disk_budget()
        for want, phase, snapshot, message in states:
            size = snapshot.size if snapshot is not None else 0
            batch[want.name] = ModelState(phase, bytes_done=size, bytes_total=size,  # type: ignore[arg-type]
                                          snapshot=snapshot.id if snapshot is not None else "",
                                          message=message, observed_generation=_generation(want))
        try:
            self.reporter.report_many(batch)
        except WeightcacheError as exc:
            log.warning("reporting the state of %d ModelCaches failed: %s", len(batch), exc)
        for want, phase, _, message in states:
            if phase == "Failed" and want.model_cache is not None:
                self.reporter.event(dict(want.model_cache), "FetchFailed", f"node {self.node_name}: {message}")

    def progress(self, want: Want, done: int, total: int) -> None:
        """Bytes of a fetch in progress (the reporter coalesces these into a write every few seconds)."""
        from weightcache.kube.report import ModelState

        try:
            self.reporter.report(want.name, ModelState("Fetching", bytes_done=done, bytes_total=total,
                                                       observed_generation=_generation(want)))
        except WeightcacheError as exc:
            log.debug("progress of %s not reported: %s", want.name, exc)

    def set_labels(self, changes: Mapping[str, str | None]) -> None:
        if changes:
            self.reporter.set_labels(dict(changes))
            self._labels.update({k: v for k, v in changes.items() if v is not None})
            for key in [k for k, v in changes.items() if v is None]:
                self._labels.pop(key, None)

    def forget(self, name: str) -> None:
        self.reporter.forget(name)


def _generation(want: Want) -> int | None:
    generation = ((want.model_cache or {}).get("metadata") or {}).get("generation")
    return generation if isinstance(generation, int) else None


async def connect(node: Node) -> Cluster | None:
    """The cluster bridge, started, or None off-cluster (no Kubernetes config found)."""
    import asyncio

    from weightcache.kube import may_be_in_a_cluster
    if not may_be_in_a_cluster():
        return None
    from weightcache.kube.client import load_api_client

    api_client = await asyncio.to_thread(load_api_client)
    if api_client is None:
        return None
    from weightcache.daemon.reconcile import stored_labels
    from weightcache.kube.copies import Keeper

    loop = asyncio.get_running_loop()

    def changed() -> None:  # on the watch's thread
        node.kick()
        loop.call_soon_threadsafe(node.heard_from_cluster)

    cluster = Cluster(api_client, node_name(node.settings.cluster.node_name), changed,
                      lambda: node.settings.store.disk_budget)
    cluster.start()
    # every eviction on this node asks which snapshots are the cluster's last copies (minCopies, docs/modelcache.md)
    node.store.keeper = Keeper(api_client, cluster.node_name, cluster.model_caches, lambda: stored_labels(node.store))
    return cluster


async def serve_csi(node: Node) -> Service:
    """Start the CSI plugin on the daemon's loop, sharing its store, fetch queue, authority and metrics (a
    grpc.aio.Server: the daemon stops it, never imports grpc)."""
    from weightcache.csi.server import serve_csi as serve

    s = node.settings
    return await serve(s.csi.endpoint or "", store=node.store, fetches=node.fetches,
                       node_id=node_name(s.cluster.node_name),
                       authority=node.authority, kubelet_dir=s.csi.kubelet_dir, tier=node.tier,
                       observe=node.metrics.observe_csi,
                       observe_stage=node.metrics.observe_stage, engine_limits=s.store.engine_limits,
                       pod_event=node.cluster.pod_event if node.cluster is not None else None,
                       observe_compile=node.metrics.observe_compile, on_adapters=node.kick)
