"""`weightcache.io/via: dra` admits a pod only when the ResourceClaimTemplates its claims name exist.

Without the template the pod is admitted, then kubelet's and the scheduler's ResourceClaim controller cannot
create its claim and the pod hangs Pending with an event few read. The webhook refuses instead, naming the
command that prints the missing template:

    python -m weightcache.dra.template s3://models/llama-3-8b/ --namespace ml | kubectl apply -f -

`weightcache.io/via: dra-extended` needs the model's DeviceClass instead (cluster-scoped; the scheduler makes
the claim from it), and a pod is refused while it is missing, naming the command that prints it:

    python -m weightcache.dra.template s3://models/llama-3-8b/ --device-class | kubectl apply -f -

The webhook process installs lookups (`install(templates, classes)`: ModelCacheWatchers over resource.k8s.io/v1
ResourceClaimTemplates of all namespaces and DeviceClasses); until one is installed and has listed once, nothing
is refused here (an unknown answer never blocks a pod).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from weightcache.dra.template import template_name
from weightcache.errors import AnnotationError
from weightcache.pods.annotations import Injection
from weightcache.webhook.dra_claim import options

if TYPE_CHECKING:
    from weightcache.kube.client import ApiClient

Lookup = Callable[[str, str], bool | None]  # (namespace, name) -> exists; None: unknown ('' namespace: cluster)
_lookup: Lookup | None = None
_classes: Lookup | None = None


def install(lookup: Lookup | None, classes: Lookup | None = None) -> None:
    global _lookup, _classes
    _lookup, _classes = lookup, classes


def from_watcher(watcher: Any) -> Lookup:
    """A Lookup over a watcher's items (`items()`, `wait_synced(0)`), e.g. ModelCacheWatcher."""
    def exists(namespace: str, name: str) -> bool | None:
        if not watcher.wait_synced(0):
            return None
        return any(((t.get("metadata") or {}).get("namespace") or "") == namespace
                   and (t.get("metadata") or {}).get("name") == name for t in watcher.items())
    return exists


def watch(api_client: ApiClient, plural: str = "resourceclaimtemplates") -> Any:
    """A started ModelCacheWatcher over every namespace's ResourceClaimTemplates (or, `plural="deviceclasses"`,
    the DeviceClasses); `install(from_watcher(w), ...)`. The webhook's ServiceAccount needs `list` and `watch` on
    them (resource.k8s.io)."""
    from weightcache.kube.client import CustomObjectsApi
    from weightcache.kube.watch import ModelCacheWatcher

    custom = CustomObjectsApi(api_client)

    def lister(**kw: Any) -> Any:
        return custom.list_cluster_custom_object("resource.k8s.io", "v1", plural, **kw)
    watcher = ModelCacheWatcher(api_client, lister=lister)
    watcher.start()
    return watcher


def command(uri: str, namespace: str, *, revision: str | None, mount_path: str | None, env: str | None,
            device_class: bool = False) -> str:
    parts = ["python -m weightcache.dra.template", uri]
    for flag, value in (("--revision", revision), ("--namespace", None if device_class else namespace),
                        ("--mount-path", mount_path), ("--env", env)):
        if value:
            parts += [flag, value]
    return " ".join(parts + (["--device-class"] if device_class else [])) + " | kubectl apply -f -"


def require(namespace: str, injection: Injection, lookup: Lookup | None = None, *, extended: bool = False,
            classes: Lookup | None = None) -> None:
    """Raise AnnotationError naming the command for the first model whose template (`extended`: DeviceClass) is
    known to be missing."""
    lookup = (classes or _classes) if extended else (lookup or _lookup)
    if lookup is None or not namespace:
        return
    for m in injection.models:
        name = template_name(m.ref.uri, **options(m))
        if lookup("" if extended else namespace, name) is False:
            how = command(m.ref.uri, namespace, **options(m), device_class=extended)
            what = f"DeviceClass {name}" if extended else f"ResourceClaimTemplate {namespace}/{name}"
            raise AnnotationError(f"model {m.name!r}: {what} does not exist, so the pod's claim could not be "
                                  f"created; {'ask a cluster admin to ' if extended else ''}create it with `{how}`, "
                                  "or use weightcache.io/via: csi")
