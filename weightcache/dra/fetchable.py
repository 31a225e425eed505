"""Devices of models this node could fetch (Kubernetes 1.36+ binding conditions; pure: no I/O).

A ModelCache that grants a model to namespaces (non-empty `spec.allowedNamespaces`, written by an admin, not
placement demand) and carries the model's size in the annotation `weightcache.io/size-bytes` is offered on every
DRA node that does not hold it yet as one device `f-<model key>`. The device has `ready: false`, the binding
condition `weightcache.io/model-ready` and the binding failure condition `weightcache.io/model-failed`: the
scheduler allocates it, then waits in PreBind until the driver (weightcache/dra/binding.py) has fetched the
model and set model-ready True on the claim's `status.devices[]` entry, or fails the binding when model-failed is
True. It consumes the model's size from the pool's counter set `cache` (counter `bytes`: the node's free cache
bytes), so the scheduler picks only a node where the model fits.

A model without the size annotation is not offered: the scheduler could not count it, and a node that cannot hold
it would be picked. Its pods get held devices only (a node fetches it for its nodeSelector, or placement).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from weightcache.access import admin_written
from weightcache.dra.devices import MAX_INT, MAX_STRING
from weightcache.units import quantity
from weightcache.uri import MODEL_KEY_PATTERN, ModelRef, model_key, parse_ref
from weightcache.vocabulary import GROUP, SIZE_BYTES_ANNOTATION

MODEL_READY = f"{GROUP}/model-ready"
MODEL_FAILED = f"{GROUP}/model-failed"
SIZE_ANNOTATION = SIZE_BYTES_ANNOTATION
COUNTER_SET = "cache"
COUNTER = "bytes"
PREFIX = "f-"
_NAME = re.compile(f"{PREFIX}(?P<key>{MODEL_KEY_PATTERN})")  # fullmatch: `$` would pass a trailing newline


@dataclass(frozen=True)
class Fetchable:
    """A model a ModelCache grants, with the size the scheduler counts."""

    ref: ModelRef
    size: int
    cache: str  # the ModelCache that offers it

    @property
    def key(self) -> str:
        return model_key(self.ref.uri)


def device_name(key: str) -> str:
    name = PREFIX + key
    if not _NAME.fullmatch(name):
        raise ValueError(f"model key {key!r} does not make a device name (expected m + 20 hex digits)")
    return name


def key_of(name: str) -> str | None:
    """The model key a fetchable device's name carries, or None for any other name."""
    match = _NAME.fullmatch(name)
    return match["key"] if match else None


def declared(model_caches: Iterable[Mapping[str, Any]]) -> dict[str, Fetchable]:
    """Model key -> the model the first (by name) granting, admin-written, sized ModelCache declares."""
    out: dict[str, Fetchable] = {}
    for mc in sorted(model_caches, key=lambda m: str((m.get("metadata") or {}).get("name", ""))):
        meta, spec = mc.get("metadata") or {}, mc.get("spec") or {}
        if not admin_written(mc) or not spec.get("allowedNamespaces"):
            continue
        try:
            size = int(str((meta.get("annotations") or {}).get(SIZE_ANNOTATION, "")))
            ref = parse_ref(str(spec.get("source", "")), revision=spec.get("revision") or None,
                            include=list(spec.get("include") or ()), exclude=list(spec.get("exclude") or ()))
        except ValueError:
            continue
        if 0 < size <= MAX_INT:
            out.setdefault(model_key(ref.uri), Fetchable(ref, size, str(meta.get("name", ""))))
    return out


def fetchable_devices(models: Iterable[Fetchable], *, held: Iterable[str] = ()) -> list[dict[str, Any]]:
    """One device per model not `held` (model keys of the node's snapshots), sorted by name."""
    held_keys = set(held)
    devices = []
    for model in models:
        if model.key in held_keys:
            continue
        attrs: dict[str, dict[str, Any]] = {"model": {"string": model.key}, "size": {"int": model.size},
                                            "ready": {"bool": False}, "latest": {"bool": True}}
        if len(model.ref.uri) <= MAX_STRING:
            attrs["source"] = {"string": model.ref.uri}
        if model.ref.revision and len(model.ref.revision) <= MAX_STRING:
            attrs["revision"] = {"string": model.ref.revision}
        devices.append({
            "name": device_name(model.key),
            "attributes": attrs,
            "consumesCounters": [{"counterSet": COUNTER_SET, "counters": {COUNTER: {"value": quantity(model.size)}}}],
            "bindingConditions": [MODEL_READY],
            "bindingFailureConditions": [MODEL_FAILED],
        })
    return sorted(devices, key=lambda d: str(d["name"]))


def cache_counters(free_bytes: int) -> list[dict[str, Any]]:
    """The pool's counter set: the node's free cache bytes, which fetchable devices consume."""
    return [{"name": COUNTER_SET, "counters": {COUNTER: {"value": quantity(max(0, free_bytes))}}}]
