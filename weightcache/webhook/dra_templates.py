"""`weightcache.io/via: dra` admits a pod only when the ResourceClaimTemplates its claims name exist.

Without the template the pod is admitted, then kubelet's and the scheduler's ResourceClaim controller cannot
create its claim and the pod hangs Pending with an event few read. The webhook refuses instead, naming the
command that prints the missing template:

    python -m weightcache.dra.template s3://models/llama-3-8b/ --namespace ml | kubectl apply -f -

The webhook process installs a lookup (`install(watcher)`: a ModelCacheWatcher over resource.k8s.io/v1
ResourceClaimTemplates of all namespaces); until one is installed and has listed once, nothing is refused here
(an unknown answer never blocks a pod).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from weightcache.dra.template import template_name
from weightcache.errors import AnnotationError
from weightcache.pods.annotations import ENV_SINGLE, Injection

Lookup = Callable[[str, str], bool | None]  # (namespace, name) -> exists; None: unknown
_lookup: Lookup | None = None
DEFAULT_PATH = "/models/model"


def install(lookup: Lookup | None) -> None:
    global _lookup
    _lookup = lookup


def from_watcher(watcher: Any) -> Lookup:
    """A Lookup over a watcher's items (`items()`, `wait_synced(0)`), e.g. ModelCacheWatcher."""
    def exists(namespace: str, name: str) -> bool | None:
        if not watcher.wait_synced(0):
            return None
        return any((t.get("metadata") or {}).get("namespace") == namespace
                   and (t.get("metadata") or {}).get("name") == name for t in watcher.items())
    return exists


def watch(api_client: Any) -> Any:
    """A started ModelCacheWatcher over every namespace's ResourceClaimTemplates; `install(from_watcher(w))`.
    The webhook's ServiceAccount needs `list` and `watch` on resource.k8s.io resourceclaimtemplates."""
    import kubernetes

    from weightcache.kube.watch import ModelCacheWatcher

    custom = kubernetes.client.CustomObjectsApi(api_client)

    def lister(**kw: Any) -> Any:
        return custom.list_cluster_custom_object("resource.k8s.io", "v1", "resourceclaimtemplates", **kw)
    watcher = ModelCacheWatcher(api_client, lister=lister)
    watcher.start()
    return watcher


def command(uri: str, namespace: str, *, revision: str | None, mount_path: str | None, env: str | None) -> str:
    parts = ["python -m weightcache.dra.template", uri]
    for flag, value in (("--revision", revision), ("--namespace", namespace), ("--mount-path", mount_path),
                        ("--env", env)):
        if value:
            parts += [flag, value]
    return " ".join(parts) + " | kubectl apply -f -"


def require(namespace: str, injection: Injection, lookup: Lookup | None = None) -> None:
    """Raise AnnotationError naming the command for the first model whose template is known to be missing."""
    lookup = lookup or _lookup
    if lookup is None or not namespace:
        return
    for m in injection.models:
        mount_path = None if m.mount_path == DEFAULT_PATH else m.mount_path
        env = None if m.env == ENV_SINGLE else m.env
        name = template_name(m.ref.uri, revision=m.ref.revision, mount_path=mount_path, env=env)
        if lookup(namespace, name) is False:
            how = command(m.ref.uri, namespace, revision=m.ref.revision, mount_path=mount_path, env=env)
            raise AnnotationError(f"model {m.name!r}: ResourceClaimTemplate {namespace}/{name} does not exist, so "
                                  f"the pod's claim could not be created; create it with `{how}`, or use "
                                  "weightcache.io/via: csi")
