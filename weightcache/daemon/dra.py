"""The daemon's DRA plugin: weightcache.dra.server's `serve_dra` wired to the node's store, policy and memory tier,
and to the cluster's ResourceClaims and ResourceSlices through the official client.

The daemon composes the node services (docs/architecture.md): this wiring lives here, so the DRA driver never
imports the daemon's Node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from weightcache.daemon.node import Node
from weightcache.dra.devices import devices_for
from weightcache.dra.server import DraPlugin, claim_reader, serve_dra
from weightcache.dra.slices import SlicePublisher
from weightcache.errors import ConfigError
from weightcache.settings import node_name as node_name_of


def node_devices(node: Node) -> Callable[[], list[dict[str, Any]]]:
    dra = node.settings.dra
    assert dra is not None

    def devices() -> list[dict[str, Any]]:
        resident = {r.id for r in node.tier.resident()} if node.tier is not None else set()
        return devices_for([i.snapshot for i in node.store.list()], slots=dra.slots_per_model, shared=dra.shared,
                           resident=resident)
    return devices


def change_token(node: Node) -> Callable[[], object]:
    """Cheap: the store's snapshot and manifest directories change on every publish and eviction."""
    layout = node.store.layout

    def token() -> object:
        resident = frozenset(r.id for r in node.tier.resident()) if node.tier is not None else frozenset()
        return layout.snapshots.stat().st_mtime_ns, layout.manifests.stat().st_mtime_ns, resident
    return token


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
    node_name = node_name_of(s.node_name)

    publisher = SlicePublisher(api_client, node_name, node_devices(node), api_version=dra.api_version,
                               change_token=change_token(node))
    return await serve_dra(store=node.store, pool=node_name, kubelet_dir=s.kubelet_dir, cdi_dir=dra.cdi_dir,
                           authority=node.authority, claims=claim_reader(api_client, dra.api_version),
                           publisher=publisher, publish_interval=dra.publish_seconds)
