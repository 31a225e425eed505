"""LoRA adapters declared for a base model: ModelCaches with `spec.baseModel` (docs/adapters.md). Pure.

An adapter is a model like any other (fetched, verified, deduplicated, evicted by the store; mounted only where its
own `allowedNamespaces` allow) that names the base model it was trained for. Its name in a pod's adapter directory,
and so the name a request gives to the engine, is its ModelCache's name (a DNS subdomain: a safe path component).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from weightcache.errors import InvalidReferenceError
from weightcache.kube import rollout
from weightcache.uri import ModelRef, canonical_uri, parse_ref

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


@dataclass(frozen=True)
class Adapter:
    name: str  # its directory in the pod's adapter directory: its ModelCache's name
    ref: ModelRef  # its files: source, the revision its ModelCache serves, globs
    base: str  # the canonical uri of the base model it adapts


def base_of(mc: Mapping[str, Any]) -> str | None:
    """The canonical base model of an adapter's ModelCache; None for a model (or a base that does not parse)."""
    spec = mc.get("spec")
    base = spec.get("baseModel") if isinstance(spec, Mapping) else None
    if not isinstance(base, str) or not base:
        return None
    try:
        return canonical_uri(base)
    except InvalidReferenceError:
        return None


def declared(model_caches: Iterable[Mapping[str, Any]]) -> list[Adapter]:
    """Every adapter the ModelCaches declare, by name; a ModelCache that does not parse declares none (the daemon
    reports it as an InvalidSpec Event)."""
    found: list[Adapter] = []
    for mc in model_caches:
        name = str((mc.get("metadata") or {}).get("name", ""))
        base = base_of(mc)
        spec = mc.get("spec")
        if base is None or not _NAME.fullmatch(name) or name.count("..") or not isinstance(spec, Mapping):
            continue
        try:
            ref = parse_ref(str(spec.get("source") or ""), revision=rollout.revisions(mc, None)[0] or None,
                            include=_globs(spec.get("include")), exclude=_globs(spec.get("exclude")))
        except (InvalidReferenceError, TypeError):
            continue
        found.append(Adapter(name, ref, base))
    return sorted(found, key=lambda a: a.name)


def _globs(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(g, str) for g in value):
        raise TypeError("globs must be a list of strings")
    return tuple(value)
