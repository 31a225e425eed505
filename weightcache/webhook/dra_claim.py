"""The `weightcache.io/via: dra` branch of the webhook: inject ResourceClaims instead of CSI volumes.

    weightcache.io/model: s3://models/llama-3-8b/
    weightcache.io/via: dra          # csi (default) | dra | dra-extended

For each model the patch adds a pod-level claim from the model's ResourceClaimTemplate and a reference to it in
each chosen container (docs/dra.md):

    /spec/resourceClaims/-                       {name: wc-<name>, resourceClaimTemplateName: weightcache-<key>[-<h>]}
    /spec/containers/<i>/resources/claims/-      {name: wc-<name>}

The template name comes from weightcache.dra.template.template_name, the function that also renders the template,
so the two agree; the CDI spec the DRA plugin writes mounts the model and sets its env var. No node affinity is
added: the scheduler only allocates a device on a node that holds the model. `placement: gate` still gates the
pod, for the placement controller to have the model fetched before the scheduler sees the pod.

`weightcache.io/via: dra-extended` (DRA extended resources, KEP-5004: beta in Kubernetes 1.36, stable in 1.37)
adds no claim: each chosen container asks for one unit of the model's extended resource, and the scheduler makes
the claim from the model's DeviceClass (`python -m weightcache.dra.template URI --device-class`):

    /spec/containers/<i>/resources/limits/models.weightcache.io~1<key>[-<h>]    "1"

(requests follow limits for an extended resource; a different value already there is a conflict).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weightcache.dra.template import extended_resource_name, template_name
from weightcache.errors import AnnotationError, InjectionConflictError
from weightcache.pods.annotations import ENV_SINGLE, PREFIX, STREAM, Injection, ModelMount
from weightcache.pods.patch import check_names, chosen, extend, list_at, mapping_at
from weightcache.vocabulary import GATE
from weightcache.vocabulary import VIA_ANNOTATION as VIA

VIAS = ("csi", "dra", "dra-extended")
EXTENDED = "dra-extended"
DEFAULT_PATH = "/models/model"


def via(annotations: Mapping[str, object]) -> str:
    value = annotations.get(VIA, "csi")
    if not isinstance(value, str) or value.strip() not in VIAS:
        raise AnnotationError(f"annotation {VIA} is {value!r}; write {VIA}: dra (a ResourceClaim per model), "
                              f"{VIA}: dra-extended (an extended resource per model, Kubernetes 1.36+) or "
                              f"{VIA}: csi (a CSI volume, the default)")
    return value.strip()


def options(m: ModelMount) -> dict[str, str | None]:
    """The template's (or class's) options for a model: the mount path and env name when not the defaults."""
    return {"revision": m.ref.revision, "mount_path": None if m.mount_path == DEFAULT_PATH else m.mount_path,
            "env": None if m.env == ENV_SINGLE else m.env}


def plan(pod: Mapping[str, Any], injection: Injection, *, extended: bool = False) -> list[Any]:
    """The JSON Patch adding the models' ResourceClaims (or, `extended`, their extended resources); empty when
    everything is already there."""
    if injection.tier != "disk":
        raise AnnotationError(f"{PREFIX}tier: {injection.tier} needs the CSI volume; with {VIA}: dra a model is "
                              f"served from disk (remove {PREFIX}tier or use {VIA}: csi)")
    if injection.stream:  # the CDI mount of a growing view is a later step (docs/streaming-pods.md)
        raise AnnotationError(f'{STREAM}: "true" needs the CSI volume: streaming is CSI-only for now (a DRA device '
                              f'is prepared from a whole snapshot); write {VIA}: csi, or {STREAM}: "false" to '
                              f"keep {VIA}: dra")
    spec = mapping_at(pod, "spec")
    if extended:
        return _extended(spec, injection)
    claims = [{"name": m.volume, "resourceClaimTemplateName": template_name(m.ref.uri, **options(m))}
              for m in injection.models]
    check_names("resource claim", list_at(spec, "resourceClaims"), claims)
    ops = extend(spec, "/spec", ["resourceClaims"], claims)
    for path, container in chosen(spec, injection.containers):
        refs = [{"name": m.volume} for m in injection.models]
        check_names(f"container {container['name']!r} resource claim", list_at(mapping_at(container, "resources"),
                                                                               "claims"), refs)
        ops += extend(container, path, ["resources", "claims"], refs)
    return ops + _gate(spec, injection)


def _gate(spec: Mapping[str, Any], injection: Injection) -> list[Any]:
    return extend(spec, "/spec", ["schedulingGates"], [{"name": GATE}]) if injection.placement == "gate" else []


def _extended(spec: Mapping[str, Any], injection: Injection) -> list[Any]:
    """`resources.limits[<model's extended resource>]: "1"` in each chosen container."""
    names = [extended_resource_name(m.ref.uri, **options(m)) for m in injection.models]
    ops: list[Any] = []
    for path, container in chosen(spec, injection.containers):
        resources = mapping_at(container, "resources")
        limits, requests = mapping_at(resources, "limits"), mapping_at(resources, "requests")
        for name in names:
            for field, values in (("limits", limits), ("requests", requests)):
                if name in values and str(values[name]) != "1":
                    raise InjectionConflictError(
                        f"container {container['name']!r} already asks {field}[{name}]: {values[name]!r}; a model "
                        f"is one unit of its extended resource: remove it, or use {VIA}: dra")
        missing = {n: "1" for n in names if n not in limits}
        if not missing:
            continue
        if container.get("resources") is None:
            ops.append({"op": "add", "path": f"{path}/resources", "value": {"limits": missing}})
        elif resources.get("limits") is None:
            ops.append({"op": "add", "path": f"{path}/resources/limits", "value": missing})
        else:
            ops += [{"op": "add", "path": f"{path}/resources/limits/{n.replace('~', '~0').replace('/', '~1')}",
                     "value": v} for n, v in missing.items()]
    return ops + _gate(spec, injection)
