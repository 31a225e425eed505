"""This node's ResourceSlices: built from the store's devices and kept current in the API server.

The pool is named after the node and holds every device of the node; past the API's 128 devices per slice it
spans several slices (`resourceSliceCount`). Any change bumps `pool.generation` in every slice of the pool, the
rule consumers rely on to ignore a half-written pool. Slices are named `<node>-models.weightcache.io-<i>`, so a
restarted daemon finds and replaces its own; it starts from the highest generation it finds.

kubelet deletes every ResourceSlice of its node when it starts, and a driver's slices when the driver's plugin
stays unreachable: so besides the cheap change check, the publisher re-reads its slices every `resync_s` (10 s)
and puts back what is missing.

Every slice names its Node as owner (`metadata.ownerReferences`, with the Node's uid, read once and again on each
full sync), so the garbage collector deletes the slices of a Node that is deleted, as kubelet's own helper does:
otherwise the scheduler would keep allocating devices of a node that no longer exists. A Node that cannot be
read (a daemon started before its Node object, RBAC without `get nodes`) is logged once and its slices carry no
owner until it can be read.

An API server without a field's feature gate drops the field silently (an exclusive device instead of a shared
one; a fetchable device without its binding conditions, which the scheduler would bind at once): the publisher
compares what the server stored with what it sent and reports the dropped fields (`dropped_fields`) to
`on_dropped`, which the daemon answers by publishing without them (weightcache/daemon/dra.py).

`SlicePublisher.sync()` blocks (the kubernetes client is synchronous): the daemon runs it in a thread, from a
loop that wakes every `interval` seconds. A tick costs one stat of the snapshot and manifest directories unless
something changed. Every API call has a timeout, so a hung API server never holds a worker thread for long.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from weightcache.dra import DRIVER_NAME

if TYPE_CHECKING:
    from weightcache.kube.client import ApiClient

log = logging.getLogger(__name__)

GROUP = "resource.k8s.io"
PLURAL = "resourceslices"
MAX_DEVICES_PER_SLICE = 128
API_TIMEOUT_S = 10.0

Devices = Callable[[], list[dict[str, Any]]]


def slice_name(node_name: str, index: int) -> str:
    return f"{node_name}-{DRIVER_NAME}-{index}"


def node_owner(node_name: str, uid: str) -> dict[str, Any]:
    """The ownerReference that ties a node-local slice to its Node (garbage-collected with it)."""
    return {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": uid, "controller": True}


def build_slices(node_name: str, devices: list[dict[str, Any]], generation: int, *,
                 api_version: str = "v1", node_uid: str | None = None,
                 shared_counters: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The ResourceSlice objects of this node's pool at `generation` (at least one, possibly without devices);
    owned by the Node when its uid is known. `shared_counters` get a slice of their own, the pool's first: since
    1.35 a slice holds devices or sharedCounters, never both, and a counter set is defined once per pool. A slice
    whose devices consume counters or carry taints holds at most 64 of them (the API's limit), else 128."""
    per_slice = MAX_DEVICES_PER_SLICE // 2 if any(d.get("consumesCounters") or d.get("taints") for d in devices) \
        else MAX_DEVICES_PER_SLICE  # the API's limit is 64 too for a slice with a tainted device
    chunks = [devices[i:i + per_slice] for i in range(0, len(devices), per_slice)] or [[]]
    specs: list[dict[str, Any]] = [{"devices": chunk} for chunk in chunks]
    if shared_counters:
        specs.insert(0, {"sharedCounters": shared_counters})
        if not devices:
            specs.pop()  # the counters slice alone
    slices: list[dict[str, Any]] = [{
        "apiVersion": f"{GROUP}/{api_version}",
        "kind": "ResourceSlice",
        "metadata": {"name": slice_name(node_name, i),
                     "labels": {"app.kubernetes.io/managed-by": "weightcache"},
                     **({"ownerReferences": [node_owner(node_name, node_uid)]} if node_uid else {})},
        "spec": {
            "driver": DRIVER_NAME,
            "nodeName": node_name,
            "pool": {"name": node_name, "generation": generation, "resourceSliceCount": len(specs)},
            **content,
        },
    } for i, content in enumerate(specs)]
    return slices


def dropped_fields(sent: list[dict[str, Any]], stored: list[dict[str, Any]]) -> set[str]:
    """The device and slice fields of `sent` slices the API server did not store (`capacity.<name>.requestPolicy`
    is reported as `capacity.requestPolicy`)."""
    dropped: set[str] = set()
    stored_devices = {str(d.get("name")): d for obj in stored for d in (obj.get("spec") or {}).get("devices") or []}
    for i, obj in enumerate(sent):
        spec = obj.get("spec") or {}
        if spec.get("sharedCounters") and i < len(stored) and not (stored[i].get("spec") or {}).get("sharedCounters"):
            dropped.add("sharedCounters")
        for device in spec.get("devices") or []:
            back = stored_devices.get(str(device.get("name")))
            if back is not None:
                dropped |= _dropped_device_fields(device, back)
    return dropped


def _dropped_device_fields(device: dict[str, Any], back: dict[str, Any]) -> set[str]:
    kept = back.get("capacity") or {}
    policy = any("requestPolicy" in capacity and "requestPolicy" not in (kept.get(name) or {})
                 for name, capacity in (device.get("capacity") or {}).items())
    return {k for k in device if k not in back} | ({"capacity.requestPolicy"} if policy else set())


def _owners(obj: dict[str, Any]) -> Any:
    return (obj.get("metadata") or {}).get("ownerReferences")


def _same(existing: dict[str, dict[str, Any]], current: list[dict[str, Any]]) -> bool:
    """The API server holds exactly `current` (specs and owners), slice for slice."""
    stored = [existing.get(s["metadata"]["name"], {}) for s in current]
    return len(existing) == len(current) and [s.get("spec") for s in stored] == [s["spec"] for s in current] \
        and [_owners(s) for s in stored] == [_owners(s) for s in current]


class SlicePublisher:
    """Publishes the devices `devices()` returns as this node's pool; `sync()` writes only on change."""

    def __init__(self, api_client: ApiClient, node_name: str, devices: Devices, *, api_version: str = "v1",
                 change_token: Callable[[], object] = lambda: None, resync_s: float = 10.0,
                 counters: Callable[[], list[dict[str, Any]]] | None = None,
                 on_dropped: Callable[[set[str]], None] | None = None) -> None:
        from weightcache.kube.client import CoreV1Api, CustomObjectsApi

        self._api = CustomObjectsApi(api_client)
        self._core = CoreV1Api(api_client)
        self._node_uid: str | None = None
        self._uid_warned = False
        self._node = node_name
        self._devices = devices
        self._counters = counters
        self._version = api_version
        self._token = change_token
        self._resync_s = resync_s
        self._published: list[dict[str, Any]] | None = None
        self._published_counters: list[dict[str, Any]] | None = None
        self._last_token: object = object()
        self._generation = 0
        self._on_dropped = on_dropped

    def sync(self, *, full: bool = False) -> bool:
        """Publish the current devices when they changed; `full` also re-reads the API server's slices (someone may
        have deleted or edited them). True when something was written."""
        token = self._token()
        if not full and self._published is not None and token == self._last_token:
            return False
        devices = self._devices()
        counters = self._counters() if self._counters is not None else None
        self._last_token = token
        if not full and devices == self._published and counters == self._published_counters:
            return False
        if full or self._node_uid is None:
            self._read_node_uid()
        existing = self._existing()
        if self._published is None:  # first sync of this process: continue the pool's generation
            self._generation = max((int(s["spec"]["pool"].get("generation", 0)) for s in existing.values()),
                                   default=0)
        current = build_slices(self._node, devices, self._generation, api_version=self._version,
                               node_uid=self._node_uid, shared_counters=counters)
        if _same(existing, current):
            self._published, self._published_counters = devices, counters
            return False
        self._generation += 1
        wanted = build_slices(self._node, devices, self._generation, api_version=self._version,
                              node_uid=self._node_uid, shared_counters=counters)
        stored = self._write(wanted, existing)
        self._published, self._published_counters = devices, counters
        log.info("ResourceSlice pool %s generation %d: %d devices in %d slices", self._node, self._generation,
                 len(devices), len(wanted))
        dropped = dropped_fields(wanted, stored)
        if dropped and self._on_dropped is not None:
            self._on_dropped(dropped)
        return True

    def _write(self, wanted: list[dict[str, Any]], existing: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        """Replace the slices that exist, create the others, delete those of a larger pool than now; the slices as
        the API server stored them."""
        stored = []
        for obj in wanted:
            name = obj["metadata"]["name"]
            if name in existing:
                obj["metadata"]["resourceVersion"] = existing.pop(name)["metadata"]["resourceVersion"]
                stored.append(self._api.replace_cluster_custom_object(GROUP, self._version, PLURAL, name, obj,
                                                                      _request_timeout=API_TIMEOUT_S))
            else:
                stored.append(self._api.create_cluster_custom_object(GROUP, self._version, PLURAL, obj,
                                                                     _request_timeout=API_TIMEOUT_S))
        for name in existing:
            self._api.delete_cluster_custom_object(GROUP, self._version, PLURAL, name,
                                                   _request_timeout=API_TIMEOUT_S)
        return [s for s in stored if isinstance(s, dict)]

    def published_names(self) -> list[str]:
        """The names of the devices last published (empty before the first write)."""
        return [str(d["name"]) for d in self._published or ()]

    def _read_node_uid(self) -> None:
        from weightcache.kube.client import ApiException

        try:
            node = self._core.read_node(self._node, _request_timeout=API_TIMEOUT_S)
        except ApiException as exc:
            if not self._uid_warned:
                self._uid_warned = True
                log.warning("reading Node %s for the ResourceSlices' owner failed: HTTP %s %s; publishing them "
                            "without an owner until it can be read (the daemon needs `get` on nodes)",
                            self._node, exc.status, exc.reason)
            return
        uid = node.metadata.uid if node.metadata is not None else None
        if uid and uid != self._node_uid:
            self._node_uid = uid

    def _existing(self) -> dict[str, dict[str, Any]]:
        listing = self._api.list_cluster_custom_object(
            GROUP, self._version, PLURAL, field_selector=f"spec.nodeName={self._node},spec.driver={DRIVER_NAME}",
            _request_timeout=API_TIMEOUT_S)
        return {item["metadata"]["name"]: item for item in listing.get("items", [])}

    async def run(self, interval: float = 2.0) -> None:
        """Sync every `interval` seconds, and in full every `resync_s`; errors are retried at the next tick."""
        loop = asyncio.get_running_loop()
        last_full = 0.0
        while True:
            full = loop.time() - last_full >= self._resync_s
            try:
                await asyncio.to_thread(self.sync, full=full)
                if full:
                    last_full = loop.time()
            except Exception as exc:
                log.warning("publishing ResourceSlices for node %s failed: %s; retrying", self._node,
                            _short(exc))
                self._last_token = object()  # recompute next time
            await asyncio.sleep(interval)


def _short(exc: Exception) -> str:
    from weightcache.kube.client import ApiException

    if isinstance(exc, ApiException) and exc.status:
        return f"HTTP {exc.status} {exc.reason}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
