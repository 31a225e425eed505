"""Kubernetes layer: ModelCache watch, desired-state selection, node labels, per-node status, Events, cluster CLI.

Resources (`weightcache.io/v1alpha1`, both cluster-scoped; CRDs in deploy/daemonset/):

    ModelCache/<name>          desired state, written by people and `weightcache prefetch --cluster`
    ModelCacheNode/<node>      observed state of ONE node, written only by that node's daemon:
                               status.models[<ModelCache name>] = {phase, bytesDone, bytesTotal, snapshot, ...}

One writer per object means no write contention at 1,000 nodes; the node label `weightcache.io/m<hash>=ready`
is what the scheduler and the webhook's node affinity read.
"""

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
           "MODELCACHE_KIND", "VERSION"]

MESSAGE_MAX = 1024  # events.k8s.io caps a note at 1 kB; status messages keep to the same size
