"""The admission decision as a pure function: AdmissionReview v1 dict in, AdmissionReview v1 dict out.

For each model the `weightcache.io/*` annotations name, the patch adds (JSON Patch, RFC 6902, against the pod the
API server sent):

    /spec/volumes/-                         {name: wc-<name>, csi: {driver: csi.weightcache.io, readOnly: true,
                                             volumeAttributes: {model, revision, tier}}}
                                            with weightcache.io/stream: "true" also volumeAttributes.stream:
                                            "true" (docs/streaming-pods.md; not on the engine cache's volume)
    /spec/containers/<i>/volumeMounts/-     {name: wc-<name>, mountPath: /models/<name>, readOnly: true}
    /spec/containers/<i>/env/-              {name: WEIGHTCACHE_MODEL_PATH[_<NAME>], value: <mountPath>}
                                            with weightcache.io/hf-repo also HF_HUB_CACHE=<mountPath>,
                                            HF_HUB_OFFLINE=1 (and volumeAttributes.hfRepo)
    with weightcache.io/telemetry: "true"  volume wc-report {csi: {readOnly: false, volumeAttributes: {model, revision,
    (and no engine cache) also              report: "true"}}}, its mount /var/run/weightcache-report and
                                            WEIGHTCACHE_REPORT_DIR (docs/telemetry.md)
    with weightcache.io/engine-cache also   volume wc-engine-cache {csi: {readOnly: false, volumeAttributes:
                                            {model, revision, include, exclude, engineCache}}}, its mount and
                                            WEIGHTCACHE_ENGINE_CACHE (VLLM_CACHE_ROOT) (docs/engine-caches.md)
    /spec/affinity/nodeAffinity/...         weightcache.io/<model-key> In [ready]: required (ANDed into every
                                            existing required term) or preferred, per weightcache.io/placement
                                            (preferred for a streaming pod)
    /spec/schedulingGates/-                 {name: weightcache.io/model}: placement require with no node the pod
                                            could run on holding its models, or placement gate
                                            (docs/placement.md: weightcache.placement releases it)

A missing list is added whole; an existing one is appended to. Whatever is already there exactly as we would
add it is skipped, so re-invocation (`reinvocationPolicy: IfNeeded`) adds nothing twice; anything else already
using an injected name or path is a conflict and the pod is denied.
Not an AdmissionReview v1 Pod CREATE, or a pod of the wrong shape: BadAdmissionReviewError (HTTP 400).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping, Sequence
from http import HTTPStatus
from typing import Any, NotRequired, TypedDict

from weightcache.errors import (
    AnnotationError,
    BadAdmissionReviewError,
    InjectionConflictError,
    NotAllowedError,
    WeightcacheError,
)
from weightcache.placement.choice import ready_nodes
from weightcache.placement.nodes import NodeFacts
from weightcache.pods import unknown_keys
from weightcache.pods.annotations import (
    MAX_MODELS,
    EngineCacheMount,
    Injection,
    ModelMount,
    parse_annotations,
    wants_injection,
)
from weightcache.pods.patch import PatchOp, check_names, chosen, extend, list_at, mapping_at, ready, required_affinity
from weightcache.policy import CacheIndex, decide
from weightcache.vocabulary import (
    ADAPTERS_ATTRIBUTE,
    ENGINE_CACHE_ATTRIBUTE,
    GATE,
    REPORT_ATTRIBUTE,
    STREAM_ATTRIBUTE,
)
from weightcache.webhook import dra_claim, dra_templates

API_VERSION = "admission.k8s.io/v1"
DRIVER = "csi.weightcache.io"
PREFERRED_WEIGHT = 50  # of 1..100: wins over weak user preferences, leaves room for stronger ones
_PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"


class Status(TypedDict):
    code: int
    reason: str
    message: str


class AdmissionResponse(TypedDict):
    uid: str
    allowed: bool
    patchType: NotRequired[str]
    patch: NotRequired[str]
    status: NotRequired[Status]
    warnings: NotRequired[list[str]]


class AdmissionReview(TypedDict):
    apiVersion: str
    kind: str
    response: AdmissionResponse


def review(
    body: object,
    *,
    model_caches: Iterable[Mapping[str, Any]] | CacheIndex,
    allow_undeclared: bool,
    nodes: Sequence[NodeFacts] | None = None,
    max_models: int = MAX_MODELS,
    unknown_annotations: unknown_keys.Mode = "warn",
) -> AdmissionReview:
    """Answer one AdmissionReview: allow unchanged, allow with a patch, or deny with a message.
    `model_caches`: a CacheIndex (built once per change of the list), or the objects themselves (indexed here,
    once for every model of the pod). `nodes`: the cluster's nodes (labels, taints) for placement; None when
    unknown (off-cluster). `max_models`: more models in one pod is a denial (annotations.MAX_MODELS).
    `unknown_annotations`: an unknown `weightcache.io/` key is a warning naming the nearest known one, or a denial."""
    request = _request(body)
    uid, pod = request["uid"], request["object"]
    annotations = _annotations(pod)
    try:
        warned = unknown_keys.check(annotations, unknown_annotations)
    except AnnotationError as exc:
        return _deny(uid, exc)
    if not wants_injection(annotations):
        return _answer({"uid": uid, "allowed": True, "warnings": warned} if warned else {"uid": uid, "allowed": True})
    namespace = request.get("namespace") or mapping_at(pod, "metadata").get("namespace") or ""
    try:
        injection = parse_annotations(annotations, max_models=max_models)
        via = dra_claim.via(annotations)
    except AnnotationError as exc:
        return _deny(uid, exc)
    caches = model_caches if isinstance(model_caches, CacheIndex) else CacheIndex(model_caches)
    for m in injection.models:
        decision = decide(m.ref, namespace, caches, allow_undeclared=allow_undeclared)
        if not decision.allowed:
            return _deny(uid, NotAllowedError(f"model {m.name!r}: {decision.reason}"))
    try:
        extended = via == dra_claim.EXTENDED
        ops = dra_claim.plan(pod, injection, extended=extended) + _engine_cache_ops(pod, injection) \
            if via != "csi" else plan(pod, injection, nodes)
        if via != "csi":  # a template (extended: the model's DeviceClass) that does not exist is refused
            dra_templates.require(namespace, injection, extended=extended)
    except (AnnotationError, InjectionConflictError) as exc:
        return _deny(uid, exc)
    response: AdmissionResponse = {"uid": uid, "allowed": True}
    if warned:
        response["warnings"] = warned
    if ops:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(ops, separators=(",", ":")).encode()).decode()
    return _answer(response)


def plan(pod: Mapping[str, Any], injection: Injection, nodes: Sequence[NodeFacts] | None = None) -> list[PatchOp]:
    """The JSON Patch that injects `injection` into `pod`; empty when everything is already there."""
    return _inject(pod, injection, [_volume(m, injection.tier, stream=injection.stream) for m in injection.models],
                   [{"name": m.volume, "mountPath": m.mount_path, "readOnly": True} for m in injection.models],
                   [{"name": m.env, "value": m.mount_path} for m in injection.models]
                   + [e for m in injection.models if m.hf_repo for e in _hub_env(m)]) \
        + _placement(pod, injection, nodes)


def _engine_cache_ops(pod: Mapping[str, Any], injection: Injection) -> list[PatchOp]:
    """The engine cache and the adapter directory alone, beside DRA's claims (which add no volume, mount or env of
    their own)."""
    return _inject(pod, injection, [], [], [])


def _inject(pod: Mapping[str, Any], injection: Injection, volumes: list[dict[str, Any]],
            mounts: list[dict[str, Any]], env: list[dict[str, Any]]) -> list[PatchOp]:
    """Volumes, and in each chosen container their mounts and env, with the engine cache's after the models'."""
    spec = mapping_at(pod, "spec")
    if (ec := injection.engine_cache) is not None:
        volumes = [*volumes, _engine_volume(ec)]
        mounts = [*mounts, {"name": ec.volume, "mountPath": ec.mount_path}]
        env = [*env, *({"name": k, "value": v} for k, v in ec.env)]
    if (ad := injection.adapters) is not None:  # the base model's adapter directory (docs/adapters.md)
        volumes = [*volumes, {"name": ad.volume, "csi": {"driver": DRIVER, "readOnly": True, "volumeAttributes": {
            "model": ad.model.ref.uri, ADAPTERS_ATTRIBUTE: "true"}}}]
        mounts = [*mounts, {"name": ad.volume, "mountPath": ad.mount_path, "readOnly": True}]
        env = [*env, *({"name": k, "value": v} for k, v in ad.env)]
    if (rp := injection.report) is not None:  # the pod's report volume (docs/telemetry.md)
        volumes = [*volumes, {"name": rp.volume, "csi": {"driver": DRIVER, "readOnly": False, "volumeAttributes": {
            "model": rp.model.ref.uri, "revision": rp.model.ref.revision or "", REPORT_ATTRIBUTE: "true"}}}]
        mounts = [*mounts, {"name": rp.volume, "mountPath": rp.mount_path}]
        env = [*env, *({"name": k, "value": v} for k, v in rp.env)]
    check_names("volume", list_at(spec, "volumes"), volumes)
    ops = extend(spec, "/spec", ["volumes"], volumes)
    for path, container in chosen(spec, injection.containers):
        _check_mounts(container, mounts)
        check_names(f"container {container['name']!r} env", list_at(container, "env"), env)
        ops += extend(container, path, ["volumeMounts"], mounts)
        ops += extend(container, path, ["env"], env)
    return ops


def _placement(pod: Mapping[str, Any], injection: Injection, nodes: Sequence[NodeFacts] | None) -> list[PatchOp]:
    """docs/placement.md. `require` (the default when the webhook sees the nodes): required affinity to the
    nodes holding every model, or the scheduling gate while no node the pod may run on holds them all (a
    gated pod waits outside the scheduler and the autoscaler); `prefer`: a preference only; `gate`: always
    gated, the controller releases it to a ready node with room. A streaming pod's is always `prefer` (the parser
    sets it and refuses `gate` and `require` with `stream`): it starts while its model downloads."""
    spec = mapping_at(pod, "spec")
    labels = [m.label for m in injection.models]
    mode = injection.placement or ("require" if nodes is not None else "prefer")
    if mode == "prefer":
        return _preferred(spec, labels)
    if mode == "require" and (nodes is None or ready_nodes(pod, [m.ref for m in injection.models], nodes)):
        return required_affinity(spec, labels)
    return extend(spec, "/spec", ["schedulingGates"], [{"name": GATE}])


def _request(body: object) -> dict[str, Any]:
    if not isinstance(body, dict) or body.get("kind") != "AdmissionReview":
        raise BadAdmissionReviewError("body is not an AdmissionReview; send kind: AdmissionReview")
    if body.get("apiVersion") != API_VERSION:
        raise BadAdmissionReviewError(
            f"apiVersion {body.get('apiVersion')!r} is not supported; set admissionReviewVersions: [v1] "
            f"in the MutatingWebhookConfiguration"
        )
    request = body.get("request")
    if not isinstance(request, dict) or not isinstance(request.get("uid"), str) or not request["uid"]:
        raise BadAdmissionReviewError("AdmissionReview has no request.uid")
    kind = request.get("kind")
    is_pod = isinstance(kind, dict) and (kind.get("group"), kind.get("version"), kind.get("kind")) == ("", "v1", "Pod")
    if not is_pod or request.get("subResource") or request.get("operation") != "CREATE":
        raise BadAdmissionReviewError(
            "this webhook only handles Pod CREATE (rules: operations [CREATE], resources [pods]); "
            f"got {request.get('operation')!r} of {kind!r}"
        )
    if not isinstance(request.get("object"), dict):
        raise BadAdmissionReviewError("AdmissionReview request.object is missing or not a Pod object")
    return request


def _answer(response: AdmissionResponse) -> AdmissionReview:
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}


def _deny(uid: str, exc: WeightcacheError) -> AdmissionReview:
    """Refuse the pod with the HTTP status the error declares (weightcache/errors.py) and its reason, `BadRequest`."""
    code = exc.answer.http_status
    status: Status = {"code": code, "reason": HTTPStatus(code).phrase.replace(" ", ""), "message": str(exc)}
    return _answer({"uid": uid, "allowed": False, "status": status})


def _annotations(pod: Mapping[str, Any]) -> dict[str, Any]:
    return mapping_at(mapping_at(pod, "metadata"), "annotations")


def _hub_env(m: ModelMount) -> list[dict[str, str]]:
    """A hub cache volume: huggingface_hub, transformers and vLLM resolve `org/name` from it, never online."""
    return [{"name": "HF_HUB_CACHE", "value": m.mount_path}, {"name": "HF_HUB_OFFLINE", "value": "1"}]


def _volume(m: ModelMount, tier: str, *, stream: bool = False) -> dict[str, Any]:
    attributes = {"model": m.ref.uri, "revision": m.ref.revision or "", "tier": tier}
    if m.hf_repo:
        attributes["hfRepo"] = m.hf_repo
    if stream:  # the plugin publishes a growing read-only view at once instead of waiting for the fetch
        attributes[STREAM_ATTRIBUTE] = "true"
    for field, globs in (("include", m.ref.include), ("exclude", m.ref.exclude)):
        if globs:  # a JSON list: globs may hold commas (docs/csi.md)
            attributes[field] = json.dumps(list(globs))
    return {"name": m.volume, "csi": {"driver": DRIVER, "readOnly": True, "volumeAttributes": attributes}}


def _engine_volume(ec: EngineCacheMount) -> dict[str, Any]:
    """The model's own attributes (the plugin authorizes it and keys the cache by its snapshot), no tier, hub
    layout or stream, and writable: the engine writes into its cache root (the plugin gives it a private scratch)."""
    volume = _volume(ec.model, "disk")
    attributes = {k: v for k, v in volume["csi"]["volumeAttributes"].items() if k not in ("tier", "hfRepo")}
    attributes[ENGINE_CACHE_ATTRIBUTE] = str(ec.name)
    return {"name": ec.volume, "csi": {"driver": DRIVER, "readOnly": False, "volumeAttributes": attributes}}


def _check_mounts(container: Mapping[str, Any], wanted: list[dict[str, Any]]) -> None:
    for mount in list_at(container, "volumeMounts") or []:
        for w in wanted:
            if mount != w and (mount.get("name") == w["name"] or mount.get("mountPath") == w["mountPath"]):
                raise InjectionConflictError(
                    f"container {container['name']!r} already mounts {mount.get('name')!r} at "
                    f"{mount.get('mountPath')!r}, where weightcache injects {w['name']!r} at {w['mountPath']!r}; "
                    f"rename or move that mount, or set weightcache.io/mount-path to another directory"
                )


def _preferred(spec: Mapping[str, Any], labels: list[str]) -> list[PatchOp]:
    terms = [{"weight": PREFERRED_WEIGHT, "preference": {"matchExpressions": [ready(lb)]}} for lb in labels]
    return extend(spec, "/spec", ["affinity", "nodeAffinity", _PREFERRED], terms)
