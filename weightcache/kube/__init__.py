"""Kubernetes layer: ModelCache watch, desired-state selection, node labels, per-node status, Events, cluster CLI.

Resources (`weightcache.io/v1alpha1`, both cluster-scoped; CRDs in deploy/daemonset/):

    ModelCache/<name>          desired state, written by people and `weightcache prefetch --cluster`
    ModelCacheNode/<node>      observed state of ONE node, written only by that node's daemon:
                               status.models[<ModelCache name>] = {phase, bytesDone, bytesTotal, snapshot, ...}

One writer per object means no write contention at 1,000 nodes; the node label `weightcache.io/m<hash>=ready`
is what the scheduler and the webhook's node affinity read.
"""

import os
from pathlib import Path

from weightcache.vocabulary import (
    API_VERSION,
    GROUP,
    MODELCACHE_KIND,
    MODELCACHENODE_KIND,
    MODELCACHENODES,
    MODELCACHES,
    VERSION,
)

__all__ = ["API_VERSION", "GROUP", "MESSAGE_MAX", "MODELCACHENODES", "MODELCACHENODE_KIND", "MODELCACHES",
           "MODELCACHE_KIND", "VERSION", "kubeconfig_paths", "may_be_in_a_cluster"]

MESSAGE_MAX = 1024  # events.k8s.io caps a note at 1 kB; status messages keep to the same size


def kubeconfig_paths() -> list[Path]:
    env = os.environ.get("KUBECONFIG")
    if env:
        return [Path(p).expanduser() for p in env.split(os.pathsep) if p]
    return [Path("~/.kube/config").expanduser()]


def may_be_in_a_cluster() -> bool:
    """A Kubernetes config may exist (the service's environment, or a kubeconfig file): only then is the
    official client imported. Importing it off-cluster cost a daemon's start 2-10 CPU s (its jsonschema builds
    grammars at import), 16 daemons on 2 cores more than a minute (scripts/bench_fleet_netns.py)."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) or any(p.is_file() for p in kubeconfig_paths())
