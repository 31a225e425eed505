"""The `weightcache.io/via: dra` branch of the webhook: inject ResourceClaims instead of CSI volumes.

    weightcache.io/model: s3://models/llama-3-8b/
    weightcache.io/via: dra          # csi (default) | dra

For each model the patch adds a pod-level claim from the model's ResourceClaimTemplate and a reference to it in
each chosen container (docs/dra.md):

    /spec/resourceClaims/-                       {name: wc-<name>, resourceClaimTemplateName: weightcache-<key>[-<h>]}
    /spec/containers/<i>/resources/claims/-      {name: wc-<name>}

The template name comes from weightcache.dra.template.template_name, the function that also renders the template,
so the two agree; the CDI spec the DRA plugin writes mounts the model and sets its env var. No node affinity is
added: the scheduler only allocates a device on a node that holds the model. `placement: gate` still gates the
pod, for the placement controller to have the model fetched before the scheduler sees the pod.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weightcache.dra.template import template_name
from weightcache.errors import AnnotationError
from weightcache.pods.annotations import ENV_SINGLE, PREFIX, Injection
from weightcache.pods.patch import check_names, chosen, extend, list_at, mapping_at
from weightcache.vocabulary import GATE

VIA = PREFIX + "via"
VIAS = ("csi", "dra")
DEFAULT_PATH = "/models/model"


def via(annotations: Mapping[str, object]) -> str:
    value = annotations.get(VIA, "csi")
    if not isinstance(value, str) or value.strip() not in VIAS:
        raise AnnotationError(f"annotation {VIA} is {value!r}; write {VIA}: dra (a ResourceClaim per model) or "
                              f"{VIA}: csi (a CSI volume, the default)")
    return value.strip()


def plan(pod: Mapping[str, Any], injection: Injection) -> list[Any]:
    """The JSON Patch adding the models' ResourceClaims; empty when everything is already there."""
    if injection.tier != "disk":
        raise AnnotationError(f"{PREFIX}tier: {injection.tier} needs the CSI volume; with {VIA}: dra a model is "
                              f"served from disk (remove {PREFIX}tier or use {VIA}: csi)")
    spec = mapping_at(pod, "spec")
    claims = [{"name": m.volume, "resourceClaimTemplateName": template_name(
        m.ref.uri, revision=m.ref.revision, mount_path=None if m.mount_path == DEFAULT_PATH else m.mount_path,
        env=None if m.env == ENV_SINGLE else m.env)} for m in injection.models]
    check_names("resource claim", list_at(spec, "resourceClaims"), claims)
    ops = extend(spec, "/spec", ["resourceClaims"], claims)
    for path, container in chosen(spec, injection.containers):
        refs = [{"name": m.volume} for m in injection.models]
        check_names(f"container {container['name']!r} resource claim", list_at(mapping_at(container, "resources"),
                                                                               "claims"), refs)
        ops += extend(container, path, ["resources", "claims"], refs)
    if injection.placement == "gate":
        ops += extend(spec, "/spec", ["schedulingGates"], [{"name": GATE}])
    return ops
