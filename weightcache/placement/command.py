"""Wiring for the webhook process: the node view its placement decision reads, and the leader-elected
controller (`weightcache webhook --controller`). Every replica serves admissions; one, the Lease holder, acts."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from weightcache.kube import listers
from weightcache.kube.watch import ModelCacheWatcher
from weightcache.placement.controller import Controller
from weightcache.placement.lease import LeaderElector
from weightcache.placement.nodes import NodeFacts, node_facts
from weightcache.pods.annotations import MAX_MODELS

if TYPE_CHECKING:
    from weightcache.kube.client import ApiClient

LEASE_NAME = "weightcache-placement"


def node_view(api_client: ApiClient) -> tuple[Callable[[], Sequence[NodeFacts] | None], Callable[[], None]]:
    """(nodes, stop): the cluster's nodes as NodeFacts, rebuilt on each change, not on each admission;
    None until the first list arrived (the webhook then keeps the preference, it does not gate blindly)."""
    facts: list[Sequence[NodeFacts] | None] = [None]
    lock = threading.Lock()

    def changed(items: list[dict[str, Any]]) -> None:
        built = [node_facts(n) for n in items]
        with lock:
            facts[0] = built

    watcher = ModelCacheWatcher(api_client, lister=listers.nodes(api_client), on_change=changed)
    watcher.start()

    def nodes() -> Sequence[NodeFacts] | None:
        with lock:
            return facts[0]

    return nodes, watcher.stop


def start_controller(api_client: ApiClient, *, max_models: int = MAX_MODELS) -> Callable[[], None]:
    """Start the controller under a Lease in the pod's namespace (POD_NAMESPACE, POD_NAME from the downward
    API; the host name when unset); returns its stop. `max_models`: the webhook's --max-models, so a pod the
    webhook admits is not refused by the controller, nor the other way round."""
    namespace = os.environ.get("POD_NAMESPACE") or "weightcache"
    identity = os.environ.get("POD_NAME") or socket.gethostname()
    elector = LeaderElector(api_client, namespace=namespace, name=LEASE_NAME, identity=identity)
    controller = Controller(api_client, elector=elector, max_models=max_models)
    controller.start()
    return controller.stop
