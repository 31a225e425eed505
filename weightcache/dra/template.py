"""The ResourceClaimTemplate a pod uses to get a model through DRA, and the CEL selector inside it.

    python -m weightcache.dra.template s3://models/llama-3-8b/ [--revision R] [--namespace ml] [--mount-path P]

prints the template. Its name is `weightcache-<model key>`, the name the admission webhook's
`weightcache.io/via: dra` branch puts in `pod.spec.resourceClaims`, so the two always agree.

    python -m weightcache.dra.template s3://models/llama-3-8b/ --device-class

prints instead the model's own DeviceClass for DRA extended resources (KEP-5004: beta in 1.36, stable in 1.37): a
class of the same name that selects exactly that model's devices, carries the mount path and env name as its
opaque config, and names the extended resource `models.weightcache.io/<model key>[-<digest>]` a pod asks for in
`resources.limits` (the webhook's `weightcache.io/via: dra-extended`); the scheduler then makes the claim itself.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from typing import Any

import yaml

from weightcache.dra import DRIVER_NAME
from weightcache.uri import model_key, parse_ref
from weightcache.vocabulary import MODEL_ANNOTATION

DEVICE_CLASS = DRIVER_NAME
REQUEST = "model"
_QUALIFIED_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")  # the name part, <= 63


def selector(uri: str, revision: str | None = None) -> str:
    """CEL on the published attributes: this model (by its key), and this revision when one is asked for. `has`
    first: a snapshot fetched without a known revision publishes no `revision` attribute, and reading a missing
    attribute is a CEL runtime error, which aborts the whole claim's allocation (k8s.io/dynamic-resource-allocation
    structured allocator), not a mismatch of that one device."""
    attrs = f'device.attributes["{DRIVER_NAME}"]'
    expression = f"{attrs}.model == {json.dumps(model_key(parse_ref(uri).uri))}"
    if revision:
        expression += f" && has({attrs}.revision) && {attrs}.revision == {json.dumps(revision)}"
    return expression


def model_selectors(uri: str, revision: str | None = None) -> list[dict[str, Any]]:
    """The model's selector and, where no revision is asked, the served one's: `latest` (after a rollout's switch
    the old revision stays a device until its pods end). Separate, so deploy/dra/claim-policy.yaml still reads the
    model's; `has`: a device published before the attribute existed matches as before, where a missing attribute
    would be an error that aborts the claim's allocation."""
    found = [{"cel": {"expression": selector(uri, revision)}}]
    if not revision:
        attrs = f'device.attributes["{DRIVER_NAME}"]'
        found.append({"cel": {"expression": f"!has({attrs}.latest) || {attrs}.latest"}})
    return found


def template_name(uri: str, *, revision: str | None = None, mount_path: str | None = None,
                  env: str | None = None) -> str:
    """`weightcache-<model key>`, plus a short digest of the revision, mount path and env name when any is not
    the default (a template fixes them for every pod that uses it)."""
    ref = parse_ref(uri, revision=revision)
    name = f"weightcache-{model_key(ref.uri)}"
    if ref.revision or mount_path or env:
        name += "-" + hashlib.sha256(f"{ref.revision or ''}\0{mount_path or ''}\0{env or ''}".encode()).hexdigest()[:8]
    return name


def extended_resource_name(uri: str, *, revision: str | None = None, mount_path: str | None = None,
                           env: str | None = None) -> str:
    """`models.weightcache.io/<model key>[-<digest>]`: an extended resource name as Kubernetes defines one (a
    domain outside kubernetes.io, a name part of at most 63 characters), unique per DeviceClass as the API asks."""
    part = template_name(uri, revision=revision, mount_path=mount_path, env=env).removeprefix("weightcache-")
    name = f"{DRIVER_NAME}/{part}"
    if not _QUALIFIED_NAME.match(part):
        raise ValueError(f"{name!r} is not an extended resource name")
    return name


def device_class(uri: str, *, revision: str | None = None, mount_path: str | None = None,
                 env: str | None = None) -> dict[str, Any]:
    """The model's DeviceClass (resource.k8s.io/v1) with `extendedResourceName`: a pod's `resources.limits` of that
    name gets a device of exactly this model (held, or on 1.36+ fetchable: the class does not ask `ready`)."""
    ref = parse_ref(uri, revision=revision)
    spec: dict[str, Any] = {
        "selectors": [{"cel": {"expression": f'device.driver == "{DRIVER_NAME}"'}},
                      *model_selectors(ref.uri, ref.revision)],
        "extendedResourceName": extended_resource_name(ref.uri, revision=ref.revision, mount_path=mount_path,
                                                       env=env)}
    parameters = {k: v for k, v in (("mountPath", mount_path), ("env", env)) if v}
    if parameters:
        spec["config"] = [{"opaque": {"driver": DRIVER_NAME, "parameters": parameters}}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": template_name(ref.uri, revision=ref.revision, mount_path=mount_path, env=env),
                         "annotations": {MODEL_ANNOTATION: ref.uri}},
            "spec": spec}


def ready_selector(ready: bool) -> str:
    return f'device.attributes["{DRIVER_NAME}"].ready == {"true" if ready else "false"}'


def claim_template(uri: str, *, revision: str | None = None, namespace: str | None = None,
                   mount_path: str | None = None, env: str | None = None,
                   fetchable: bool = False) -> dict[str, Any]:
    """A resource.k8s.io/v1 ResourceClaimTemplate asking for one device of the model `uri`. `fetchable`
    (Kubernetes 1.36+): a prioritized list, a held device first (`model/held`, ready == true), else one the node
    fetches before the pod binds (`model/fetch`, ready == false, binding conditions; docs/dra.md)."""
    ref = parse_ref(uri, revision=revision)
    metadata: dict[str, Any] = {"name": template_name(ref.uri, revision=ref.revision, mount_path=mount_path,
                                                      env=env),
                                "annotations": {MODEL_ANNOTATION: ref.uri}}
    if namespace:
        metadata["namespace"] = namespace
    model = model_selectors(ref.uri, ref.revision)
    request: dict[str, Any] = {"name": REQUEST, "exactly": {"deviceClassName": DEVICE_CLASS, "selectors": [
        *model, {"cel": {"expression": ready_selector(True)}}]}}
    if fetchable:
        request = {"name": REQUEST, "firstAvailable": [
            {"name": name, "deviceClassName": DEVICE_CLASS,
             "selectors": [*model, {"cel": {"expression": ready_selector(ready)}}]}
            for name, ready in (("held", True), ("fetch", False))]}
    devices: dict[str, Any] = {"requests": [request]}
    parameters = {k: v for k, v in (("mountPath", mount_path), ("env", env)) if v}
    if parameters:
        devices["config"] = [{"requests": [REQUEST], "opaque": {"driver": DRIVER_NAME, "parameters": parameters}}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": metadata,
            "spec": {"spec": {"devices": devices}}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print the ResourceClaimTemplate for a model (docs/dra.md).")
    parser.add_argument("model", help="model reference, e.g. s3://models/llama-3-8b/")
    parser.add_argument("--revision")
    parser.add_argument("--namespace")
    parser.add_argument("--mount-path", help="where the model appears in the container (default /models/model)")
    parser.add_argument("--env", help="the env var that holds the path (default WEIGHTCACHE_MODEL_PATH)")
    parser.add_argument("--fetchable", action="store_true",
                        help="Kubernetes 1.36+: a held device first, else one the node fetches before binding")
    parser.add_argument("--device-class", action="store_true",
                        help="print the model's DeviceClass for DRA extended resources (1.36 beta, 1.37+) instead")
    args = parser.parse_args(argv)
    if args.device_class:
        if args.fetchable or args.namespace:
            parser.error("--device-class is cluster-scoped and takes neither --namespace nor --fetchable")
        yaml.safe_dump(device_class(args.model, revision=args.revision, mount_path=args.mount_path, env=args.env),
                       sys.stdout, sort_keys=False)
        return 0
    yaml.safe_dump(claim_template(args.model, revision=args.revision, namespace=args.namespace,
                                  mount_path=args.mount_path, env=args.env, fetchable=args.fetchable),
                   sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
