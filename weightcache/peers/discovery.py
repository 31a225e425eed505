"""Peers in a cluster: each daemon writes its peer address in its ModelCacheNode status (`status.peerAddress`,
NodeReporter) and reads the others' from the ModelCacheNodes; no home-made membership protocol.

A status is data from the API server, written by other nodes' daemons: an address that is not http(s)://HOST:PORT
is skipped and logged, and at most MAX_PEERS are used.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Mapping
from typing import Any

import urllib3

from weightcache.errors import ConfigError
from weightcache.peers.client import peer_base_url
from weightcache.peers.source import PeerSet
from weightcache.vocabulary import GROUP, MODELCACHENODES, VERSION

log = logging.getLogger(__name__)

MAX_PEERS = 512  # HEADs per blob grow with peers: a fleet larger than this needs the Lease-based scheduler
DISCOVER_EVERY_S = 30.0


def advertised_url(host: str, port: int, env: Mapping[str, str]) -> str | None:
    """The URL other nodes reach this node's peer listener at: the listen host when it is a real address, else
    POD_IP (the DaemonSet's downward API: with hostNetwork it is the node's IP); None when neither is known."""
    if host not in ("0.0.0.0", "::", ""):
        candidate = host
    else:
        candidate = env.get("POD_IP", "")
        if not candidate:
            return None
    try:
        ip = ipaddress.ip_address(candidate)
        candidate = f"[{ip}]" if ip.version == 6 else str(ip)
    except ValueError:
        pass  # a host name
    return f"http://{candidate}:{port}"


def discover(api_client: Any, node_name: str) -> list[str] | None:
    """Peer URLs of the other nodes' daemons, from the ModelCacheNodes; None when the API could not be read
    (keep the peers known so far). Blocking."""
    # here, not at the top: `advertised_url` serves every daemon, and off-cluster the client is never imported
    from weightcache.kube.client import ApiException, CustomObjectsApi

    custom = CustomObjectsApi(api_client)
    try:
        listing = custom.list_cluster_custom_object(GROUP, VERSION, MODELCACHENODES)
    except (ApiException, urllib3.exceptions.HTTPError) as exc:
        log.warning("listing ModelCacheNodes for peers failed (%s); keeping the peers known so far; the daemon "
                    "needs list on modelcachenodes (deploy/daemonset/rbac.yaml)", type(exc).__name__)
        return None
    return peer_urls(listing.get("items") or [], node_name)


def peer_urls(items: list[Any], node_name: str) -> list[str]:
    """The valid peerAddress of every ModelCacheNode but this node's own."""
    out: list[str] = []
    for item in items:
        if not isinstance(item, dict):
            continue
        name = (item.get("metadata") or {}).get("name")
        address = (item.get("status") or {}).get("peerAddress")
        if name == node_name or not isinstance(address, str) or not address:
            continue
        try:
            out.append(peer_base_url(address))
        except ConfigError as exc:
            log.warning("ModelCacheNode %s: peerAddress skipped: %s", name, exc)
        if len(out) >= MAX_PEERS:
            log.warning("more than %d peers published; using the first %d", MAX_PEERS, MAX_PEERS)
            break
    return out


async def keep_discovering(api_client: Any, node_name: str, peers: PeerSet, every: float = DISCOVER_EVERY_S) -> None:
    """Refresh `peers` from the ModelCacheNodes every `every` seconds until cancelled (the API is read in a
    thread: the event loop never waits on it)."""
    while True:
        urls = await asyncio.to_thread(discover, api_client, node_name)
        if urls is not None:
            peers.update(urls)
        await asyncio.sleep(every)
