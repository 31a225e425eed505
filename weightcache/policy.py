"""Which namespace may mount which model: one decision for the daemon, the CSI plugin and the webhook.

A grant is a ModelCache: its source (canonical URI), its `include`/`exclude` globs and its `allowedNamespaces`
(`"*"` means every namespace). A ModelCache without `allowedNamespaces` prefetches but grants nothing.
A request (a pod's volumeAttributes or annotation, an API call naming a namespace) is a reference with its own
globs, and is allowed when a grant for the same source and namespace covers every file the request selects:

    grant include ⊇ request include (a grant without include covers any)   grant exclude ⊆ request exclude

Globs are compared as written, not by what they match: a request that asks for less in other words
(`model-*.safetensors` under a grant of `*.safetensors`) is refused with the globs to send instead. A request
naming exact files (a cached snapshot's list, as DRA checks it) is allowed when the grant selects each file.
The revision is not part of a grant.

Off-cluster, `allow_undeclared` (the config's `allowUndeclaredModels`) lets every model through that no
ModelCache declares, except `file://` models: a host directory is served to pods only when a ModelCache
declares it, and never one under (or above) /proc, /sys, /dev, the kubelet directory or the store root; its
symlinks resolve only inside its own tree (`confine_file`, called by the file source's listing).
The node's credentials and disks must never become a way to read what a namespace was not given.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightcache.errors import HostileKeyError, InvalidReferenceError
from weightcache.uri import ModelRef, parse_ref
from weightcache.vocabulary import ANNOTATION_PREFIX

SYSTEM_PATHS = ("/proc", "/sys", "/dev")


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str


@dataclass(frozen=True)
class _Grant:
    name: str  # the ModelCache's
    ref: ModelRef
    namespaces: object  # spec.allowedNamespaces as written: checked per decision, a malformed one grants nothing


class CacheIndex:
    """ModelCaches parsed once and grouped by canonical source URI: a decision looks only at the grants of the
    source it is asked about. Build one per change of the ModelCache list (the webhook does, on its watcher's
    change), not per request: parsing every ModelCache per model is what made a review O(models x ModelCaches)."""

    def __init__(self, model_caches: Iterable[Mapping[str, Any]]) -> None:
        self._by_uri: dict[str, list[_Grant]] = {}
        for mc in model_caches:
            grant = _grant(mc)
            if grant is not None:
                name = str((mc.get("metadata") or {}).get("name", "?"))
                namespaces = (mc.get("spec") or {}).get("allowedNamespaces") or []
                self._by_uri.setdefault(grant.uri, []).append(_Grant(name, grant, namespaces))

    def grants(self, uri: str) -> Sequence[_Grant]:
        return self._by_uri.get(uri, ())


def decide(
    model: str | ModelRef,
    namespace: str,
    model_caches: Iterable[Mapping[str, Any]] | CacheIndex,
    *,
    allow_undeclared: bool,
    forbidden_paths: Sequence[str | Path] = (),
) -> Decision:
    """Decide whether pods in `namespace` may mount `model` (a reference string, or a parsed one with globs).

    `model_caches`: the ModelCache objects, or a CacheIndex of them (the same answer, without parsing them all).
    `forbidden_paths` are the node's own directories (kubelet dir, store root) no `file://` model may touch."""
    try:
        wanted = model if isinstance(model, ModelRef) else parse_ref(model)
    except InvalidReferenceError as exc:
        return Decision(False, str(exc))
    if wanted.scheme == "file" and (problem := file_source_problem(wanted, forbidden_paths)):
        return Decision(False, problem)
    declaring: list[str] = []
    narrower: list[tuple[str, ModelRef]] = []
    index = model_caches if isinstance(model_caches, CacheIndex) else CacheIndex(model_caches)
    for g in index.grants(wanted.uri):
        allowed = g.namespaces
        if not isinstance(allowed, list) or not ("*" in allowed or namespace in allowed):
            declaring.append(g.name)
        elif covers(g.ref, wanted):
            return Decision(True, f"ModelCache {g.name} allows namespace {namespace}")
        else:
            narrower.append((g.name, g.ref))
    if narrower:
        name, grant = narrower[0]
        return Decision(False, f"ModelCache {name} grants namespace {namespace!r} only {_globs_text(grant)} of "
                               f"{wanted.uri}, and this request asks for {_globs_text(wanted)}; ask for at most "
                               f"what is granted (volumeAttributes {_attributes_text(grant)}, or the same "
                               f"{ANNOTATION_PREFIX}include and {ANNOTATION_PREFIX}exclude annotations)")
    if declaring:
        return Decision(
            False,
            f"model {wanted.uri} is declared by ModelCache {', '.join(declaring)} but namespace {namespace!r} is not "
            f"in its spec.allowedNamespaces; ask a cluster admin to add it",
        )
    if wanted.scheme == "file":
        return Decision(False, f"file:// models are served to pods only when a ModelCache declares them "
                               f"(allowUndeclaredModels does not apply to host directories); create one with "
                               f"spec.source: {wanted.uri} and spec.allowedNamespaces: [{namespace}]")
    if allow_undeclared:
        return Decision(True, "undeclared models are allowed (allowUndeclaredModels: true)")
    return Decision(
        False,
        f"no ModelCache declares model {wanted.uri}; create one with spec.source: {wanted.uri} and "
        f"spec.allowedNamespaces: [{namespace}] (or run: weightcache prefetch {wanted.uri} --cluster "
        f"--allow-namespace {namespace})",
    )


def covers(grant: ModelRef, request: ModelRef) -> bool:
    """True when every file `request` selects is selected by `grant` (same source assumed). A request that
    names its files exactly (includes without glob characters, as for a cached snapshot's own file list) is
    covered when the grant selects each of them."""
    if request.include and not any(_is_glob(g) for g in request.include):
        return all(grant.matches(path) for path in request.include)
    if not set(grant.exclude) <= set(request.exclude):
        return False
    return not grant.include or (bool(request.include) and set(request.include) <= set(grant.include))


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def file_source_problem(ref: ModelRef, forbidden_paths: Sequence[str | Path] = ()) -> str | None:
    """Why a `file://` model may not be served (None when it may): it lies under or above a system or node
    directory, as written or once its symlinks are resolved."""
    written, real = os.path.normpath(ref.prefix), os.path.realpath(ref.prefix)
    for root in (*SYSTEM_PATHS, *(str(p) for p in forbidden_paths)):
        for bad in {os.path.normpath(root), os.path.realpath(root)}:
            for path in {written, real}:
                if _within(path, bad) or _within(bad, path):
                    how = f" (it resolves to {real})" if real != written else ""
                    return (f"file:// model {ref.uri} is not servable: it overlaps {bad}{how}, and the node's system, "
                            f"kubelet and store directories are never models; copy the model to its own directory")
    return None


def confine_file(path: str, prefix: str, relpath: str) -> None:
    """Refuse a listed file of a `file://` model whose symlinks lead outside the model's own tree: its directory,
    or for a Hugging Face cache snapshot (`<repo>/snapshots/<rev>/`) the repo, whose `blobs/` the links point to."""
    real = os.path.realpath(path)
    if not any(_within(real, root) for root in _file_roots(prefix)):
        raise HostileKeyError(relpath, "it is a symlink that leads outside the model's directory; copy the file in "
                                       "instead of linking to it")


def _file_roots(prefix: str) -> set[str]:
    root = os.path.realpath(prefix)
    roots = {root}
    parent, rev_dir = os.path.split(os.path.normpath(prefix))
    if os.path.basename(parent) == "snapshots" and rev_dir:
        roots.add(os.path.realpath(os.path.dirname(parent)))
    return roots


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _grant(mc: Mapping[str, Any]) -> ModelRef | None:
    spec = mc.get("spec") or {}
    if not isinstance(spec, Mapping):
        return None
    include, exclude = spec.get("include") or [], spec.get("exclude") or []
    if not all(isinstance(g, list) and all(isinstance(x, str) for x in g) for g in (include, exclude)):
        return None  # a malformed grant grants nothing (desired.py reports it on the ModelCache)
    try:
        return parse_ref(str(spec.get("source", "")), include=include, exclude=exclude)
    except InvalidReferenceError:
        return None


def _globs_text(ref: ModelRef) -> str:
    if not ref.include and not ref.exclude:
        return "every file"
    parts = [f"include {list(ref.include)}"] if ref.include else []
    return " ".join(parts + ([f"exclude {list(ref.exclude)}"] if ref.exclude else []))


def _attributes_text(ref: ModelRef) -> str:
    parts = [f"include: {','.join(ref.include)!r}"] if ref.include else []
    return ", ".join(parts + ([f"exclude: {','.join(ref.exclude)!r}"] if ref.exclude else [])) or "without globs"
