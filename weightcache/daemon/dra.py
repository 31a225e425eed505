"""The daemon's DRA plugin: weightcache.dra.server's `serve_dra` wired to the node's store, policy and memory tier,
and to the cluster's ResourceClaims and ResourceSlices through the official client.

The daemon composes the node services (docs/architecture.md): this wiring lives here, so the DRA driver never
imports the daemon's Node.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightcache.daemon.node import Node
from weightcache.dra.binding import ClaimBinder
from weightcache.dra.claims import ClaimBook
from weightcache.dra.devices import devices_for, latest_ids
from weightcache.dra.eviction import ExtendedPodEvictor
from weightcache.dra.fetchable import Fetchable, cache_counters, declared, fetchable_devices
from weightcache.dra.server import DraPlugin, claim_reader, serve_dra
from weightcache.dra.slices import SlicePublisher
from weightcache.errors import ConfigError
from weightcache.settings import node_name as node_name_of
from weightcache.uri import model_key

if TYPE_CHECKING:
    from weightcache.kube.client import ApiClient

log = logging.getLogger(__name__)


def node_devices(node: Node, *, shared: Callable[[], bool] = lambda: False) -> Callable[[], list[dict[str, Any]]]:
    """The held models' devices: `slotsPerModel` slot devices each, or (`shared()`) one shared device with that
    many readers."""
    dra = node.settings.dra
    assert dra is not None
    reported: set[tuple[str, str]] = set()  # snapshots that make no device, warned about once

    def devices() -> list[dict[str, Any]]:
        resident = {r.id for r in node.tier.resident()} if node.tier is not None else set()
        infos = node.store.list()
        return devices_for([i.snapshot for i in infos], slots=dra.slots_per_model, shared=shared(),
                           resident=resident, states=node.device_states.snapshot(),
                           signatures={i.snapshot.id: i.signature for i in infos if i.signature},
                           latest=latest_ids(infos), reported=reported)
    return devices


@dataclass
class Served:
    """The 1.36 fields this node publishes, turned off for good when a write shows the API server drops them (a
    feature gate off): an exclusive device instead of a shared one would let one claim take the model; a fetchable
    device without its binding conditions would let the scheduler bind the pod before the model is fetched."""

    shared: bool
    fetchable: bool

    def dropped(self, fields: set[str]) -> None:
        if self.shared and fields & {"allowMultipleAllocations", "capacity", "capacity.requestPolicy"}:
            self.shared = False
            log.warning("the API server dropped %s from this node's ResourceSlice (DRAConsumableCapacity off?): "
                        "publishing slot devices instead of shared ones; set dra.shared: false to start that way",
                        ", ".join(sorted(fields)))
        if self.fetchable and fields & {"bindingConditions", "bindingFailureConditions", "consumesCounters",
                                        "sharedCounters"}:
            self.fetchable = False
            log.warning("the API server dropped %s from this node's ResourceSlice (DRADeviceBindingConditions or "
                        "DRAPartitionableDevices off?): no longer offering models this node could fetch",
                        ", ".join(sorted(fields)))


def change_token(node: Node, *, fetchable: bool = False) -> Callable[[], object]:
    """Cheap: the store's change token (every publish and eviction commits to its index); with fetchable devices,
    also the models the ModelCaches offer."""

    def token() -> object:
        resident = frozenset(r.id for r in node.tier.resident()) if node.tier is not None else frozenset()
        offered = tuple(sorted((k, m.size) for k, m in declared(node.model_caches()).items())) if fetchable else ()
        return node.store.changes.read()[0], resident, offered, node.device_states.version
    return token


def with_fetchable(node: Node, held: Callable[[], list[dict[str, Any]]]) -> Callable[[], list[dict[str, Any]]]:
    """The held models' devices plus a fetchable device for each model a ModelCache offers that is not held."""
    def devices() -> list[dict[str, Any]]:
        keys = {model_key(i.snapshot.uri) for i in node.store.list()}
        return held() + fetchable_devices(declared(node.model_caches()).values(), held=keys)
    return devices


def free_cache_bytes(node: Node) -> int:
    """What the store may still take: its budget less what it uses, bounded by the disk's free space."""
    free = shutil.disk_usage(node.store.layout.root).free
    if node.store.budget_bytes is not None:
        free = min(free, node.store.budget_bytes - node.store.used_bytes())
    return max(0, free)


def server_version(api_client: ApiClient) -> tuple[int, int] | None:
    """The API server's (major, minor), or None when it cannot be read (logged)."""
    from weightcache.kube.client import VersionApi

    try:
        info = VersionApi(api_client).get_code(_request_timeout=10)
        return int(info.major), int(re.sub(r"\D.*$", "", info.minor) or 0)
    except Exception as exc:  # unreachable, or a version we cannot read: the 1.34 behaviour
        log.warning("reading the API server's version failed (%s): offering held models only as DRA devices, "
                    "one device per slot", exc)
        return None


def sharing(setting: bool | None, api_version: str, version: tuple[int, int] | None) -> bool:
    """Shared devices with consumable capacity: as configured, or (auto) where the API server is 1.36+ with
    resource.k8s.io/v1 (DRAConsumableCapacity beta; an older server drops `allowMultipleAllocations` and
    `capacity.requestPolicy`, and one claim would take the model's only device)."""
    if setting is not None:
        return setting
    return api_version == "v1" and version is not None and version >= (1, 36)


async def serve_for_node(node: Node) -> DraPlugin:
    """The daemon's DRA plugin: needs the cluster (ResourceClaims are read from the API server), and uses the
    cluster bridge's ApiClient: one client (connection pool, token refresh) per daemon."""
    s = node.settings
    dra = s.dra
    assert dra is not None
    if node.cluster is None:
        raise ConfigError("dra is enabled but no Kubernetes config was found: the DRA plugin reads ResourceClaims "
                          "from the API server; run the daemon in the cluster or remove `dra` from the config")
    api_client = node.cluster.api_client
    node_name = node_name_of(s.cluster.node_name)

    version = await asyncio.to_thread(server_version, api_client)
    # fetchable devices need the 1.36 API (binding conditions, device status and counters on by default): an older
    # API server drops the fields, and the scheduler would bind a pod before its model is fetched
    fetchable = dra.api_version == "v1" and version is not None and version >= (1, 36)
    served = Served(sharing(dra.shared, dra.api_version, version), fetchable)
    log.info("DRA: %s per cached model%s", f"one shared device with {dra.slots_per_model} readers"
             if served.shared else f"{dra.slots_per_model} slot devices",
             ", and fetchable devices (binding conditions)" if fetchable else "")
    held = node_devices(node, shared=lambda: served.shared)
    offered = with_fetchable(node, held)
    token = change_token(node, fetchable=fetchable)
    publisher = SlicePublisher(api_client, node_name, lambda: offered() if served.fetchable else held(),
                               api_version=dra.api_version,
                               change_token=lambda: (token(), served.shared, served.fetchable),
                               counters=(lambda: cache_counters(free_cache_bytes(node)) if served.fetchable else [])
                               if fetchable else None, on_dropped=served.dropped)

    def resolve(key: str) -> Fetchable | None:
        return declared(node.model_caches()).get(key)

    binder = ClaimBinder(api_client, pool=node_name, store=node.store, authority=node.authority, resolve=resolve,
                         fetch=lambda grant: node.fetches.ensure(grant, keep=True)) if fetchable else None
    return await serve_dra(store=node.store, pool=node_name, kubelet_dir=s.csi.kubelet_dir, cdi_dir=dra.cdi_dir,
                           authority=node.authority, claims=claim_reader(api_client, dra.api_version),
                           publisher=publisher, publish_interval=dra.publish_seconds,
                           fetchable=resolve if fetchable else None, binder=binder,
                           evictor=ExtendedPodEvictor(api_client, book=ClaimBook(node.store.layout.tree),
                                                      states=node.device_states.snapshot, api_version=dra.api_version))
