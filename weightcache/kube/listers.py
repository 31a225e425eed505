"""List functions for `ModelCacheWatcher(lister=...)`: each answers a list page as a plain dict.

The typed core API would build a model object for every pod and node of the cluster on each list and watch
event; the watcher only needs dicts, so list pages are read raw and watch events are left undecoded (these
functions carry no `:return:` docstring, which is how the client's Watch decides to decode).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import kubernetes

from weightcache.kube import GROUP, MODELCACHENODES, VERSION

Lister = Callable[..., Any]


def _raw(fn: Callable[..., Any]) -> Lister:
    def call(**kwargs: Any) -> Any:
        if kwargs.get("watch"):
            return fn(**kwargs)  # the Watch reads the stream itself (_preload_content=False)
        return json.loads(fn(_preload_content=False, **kwargs).data)

    return call


def nodes(api_client: kubernetes.client.ApiClient) -> Lister:
    return _raw(kubernetes.client.CoreV1Api(api_client).list_node)


def pods(api_client: kubernetes.client.ApiClient) -> Lister:
    """Pods of every namespace (placement needs all of them: GPUs requested per node)."""
    return _raw(kubernetes.client.CoreV1Api(api_client).list_pod_for_all_namespaces)


def model_cache_nodes(api_client: kubernetes.client.ApiClient) -> Lister:
    custom = kubernetes.client.CustomObjectsApi(api_client)
    return _raw(lambda **kw: custom.list_cluster_custom_object(GROUP, VERSION, MODELCACHENODES, **kw))


def resource_slices(api_client: kubernetes.client.ApiClient, version: str = "v1") -> Lister:
    """resource.k8s.io ResourceSlices (the placement controller checks that a node lists a model's devices)."""
    custom = kubernetes.client.CustomObjectsApi(api_client)
    return _raw(lambda **kw: custom.list_cluster_custom_object("resource.k8s.io", version, "resourceslices", **kw))
