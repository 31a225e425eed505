"""JSON Patch (RFC 6902) against a pod, as pure functions: the webhook's CSI and DRA injections and the placement
controller's release write their ops with these, so "already there exactly as we would add it" (re-invocation
adds nothing twice) and "a pod of another shape is a 400, not a crash" are decided once. Below placement and the
webhook, which both import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

from weightcache.errors import AnnotationError, BadAdmissionReviewError, InjectionConflictError
from weightcache.vocabulary import ANNOTATION_PREFIX, READY

REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"


class PatchOp(TypedDict):
    op: str
    path: str
    value: Any


def chosen(spec: Mapping[str, Any], names: tuple[str, ...] | None) -> list[tuple[str, dict[str, Any]]]:
    """(JSON pointer, container) for each chosen container; by default every app container."""
    app = [(f"/spec/containers/{i}", c) for i, c in enumerate(containers(spec, "containers"))]
    if names is None:
        return app
    init = [(f"/spec/initContainers/{i}", c) for i, c in enumerate(containers(spec, "initContainers"))]
    by_name = {c["name"]: (path, c) for path, c in init + app}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise AnnotationError(
            f"{ANNOTATION_PREFIX}containers names {', '.join(missing)}, which this pod does not have; "
            f"write one or more of: {', '.join(by_name)}"
        )
    return [by_name[n] for n in names]


def check_names(what: str, existing: list[Any] | None, wanted: list[dict[str, Any]]) -> None:
    """An entry already there under an injected name must be exactly ours (re-invocation), else it is a conflict."""
    ours = {w["name"]: w for w in wanted}
    for entry in existing or []:
        w = ours.get(entry.get("name"))
        if w is not None and entry != w:
            raise InjectionConflictError(
                f"the pod already has {what} {w['name']!r}, a name weightcache injects for "
                f"{w.get('value') or w.get('csi', {}).get('volumeAttributes', {}).get('model')!r}; "
                f"rename or remove yours (names starting with 'wc-' and WEIGHTCACHE_MODEL_PATH* are reserved)"
            )


def required_affinity(spec: Mapping[str, Any], labels: list[str]) -> list[PatchOp]:
    """Node selector terms are ORed, so our expressions join every existing term (an empty term matches nothing).
    Only adds expressions: allowed on a gated pod too (the placement controller uses it to release one)."""
    wanted = [ready(lb) for lb in labels]
    keys = ["affinity", "nodeAffinity", REQUIRED, "nodeSelectorTerms"]
    terms = list_at(mapping_at(mapping_at(mapping_at(spec, "affinity"), "nodeAffinity"), REQUIRED), "nodeSelectorTerms")
    if not terms:
        return extend(spec, "/spec", keys, [{"matchExpressions": wanted}])
    ops: list[PatchOp] = []
    for i, term in enumerate(terms):
        if list_at(term, "matchExpressions") or list_at(term, "matchFields"):
            ops += extend(term, f"/spec/{'/'.join(keys)}/{i}", ["matchExpressions"], wanted)
    return ops


def ready(label: str) -> dict[str, Any]:
    return {"key": label, "operator": "In", "values": [READY]}


def extend(root: Mapping[str, Any], path: str, keys: list[str], items: list[Any]) -> list[PatchOp]:
    """Ops adding the `items` not yet there to the list at root[keys[0]][keys[1]]..., adding missing parents whole."""
    node: Mapping[str, Any] = root
    for depth, key in enumerate(keys):
        if node.get(key) is None:
            value: Any = items
            for parent in reversed(keys[depth + 1 :]):
                value = {parent: value}
            return [{"op": "add", "path": "/".join([path, *keys[: depth + 1]]), "value": value}]
        if depth < len(keys) - 1:
            node = mapping_at(node, key)
    existing = list_at(node, keys[-1]) or []
    where = "/".join([path, *keys, "-"])
    return [{"op": "add", "path": where, "value": item} for item in items if item not in existing]


def containers(spec: Mapping[str, Any], key: str) -> list[dict[str, Any]]:
    containers = list_at(spec, key) or []
    for c in containers:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            raise BadAdmissionReviewError(f"pod spec.{key} holds an entry without a string name")
    return containers


def mapping_at(obj: Mapping[str, Any], key: str) -> dict[str, Any]:
    """obj[key] as a dict ({} when absent or null); a pod of another shape is a bad request, not a crash."""
    value = obj.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadAdmissionReviewError(f"pod field {key!r} must be an object, got {type(value).__name__}")
    return value


def list_at(obj: Mapping[str, Any], key: str) -> list[Any] | None:
    """obj[key] as a list of objects, None when absent or null."""
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise BadAdmissionReviewError(f"pod field {key!r} must be a list of objects")
    return value
