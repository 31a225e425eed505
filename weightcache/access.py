"""Who may have what: the one authorization decision below every door.

Every request that makes the node fetch, pin, mount, prepare or link anything comes through a door — the API (and
the CLI through it), the direct CLI, a CSI publish, a DRA prepare, the reconcile of a ModelCache, placement demand,
`verify --repair` — and every door asks the same question of the same function before any byte moves:

    Authority.authorize(ref, who) -> Grant          (or NotAllowedError, exit 8, with what to ask for instead)

`who` is a `Requester`: a namespace (a pod's, a claim's, the namespaces a placement demand was made for) or
`ADMIN`, the cluster or node admin (a ModelCache an admin wrote, the daemon's config file, root on the node's
socket, the direct CLI). `ref` names the exact files: the model's canonical URI with the request's own
include/exclude globs (or, for a DRA device, the snapshot's file list). The rules themselves live in
`weightcache/policy.py` (`decide` for a namespace, `file_source_problem` for host directories on every path).

A `Grant` cannot be built except by `authorize` (its constructor refuses), and the fetch engine
(`Fetcher.ensure`, the daemon's `FetchQueue.ensure` and `lookup`) takes nothing else: a new door that wants bytes
has to ask. The store resolves a grant's ref only to a snapshot of that model whose every file the ref selects
(`Store.lookup`), so no other name for a snapshot (a snapshot id as revision, a hub repo, a claim's device)
widens what was granted.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightcache.defaults import KUBELET_DIR
from weightcache.errors import NotAllowedError, PolicyNotListedError
from weightcache.policy import decide, file_source_problem
from weightcache.signatures import SignaturePolicy, policy_from_spec
from weightcache.uri import ModelRef, canonical_uri
from weightcache.vocabulary import CONTROLLER, MANAGED_BY

ModelCaches = Callable[[], Iterable[Mapping[str, Any]]]


@dataclass(frozen=True)
class Requester:
    """Who asks: a namespace, or None for the admin (`ADMIN`)."""

    namespace: str | None

    def __str__(self) -> str:
        return "the cluster admin" if self.namespace is None else f"namespace {self.namespace}"


ADMIN = Requester(None)


class Grant:
    """A decision that let `who` have the files `ref` selects, and why. Only `Authority.authorize` makes one.
    `signatures`: who must have signed those files (every policy holds; weightcache/signatures.py): the
    request's own and those of the ModelCaches that declare the model; the fetch engine checks them before it
    publishes or hands over a snapshot."""

    __slots__ = ("reason", "ref", "signatures", "who")
    ref: ModelRef
    who: Requester
    reason: str
    signatures: tuple[SignaturePolicy, ...]

    def __init__(self, *_: object, **__: object) -> None:
        raise TypeError("a Grant comes only from weightcache.access.Authority.authorize: every door asks first")

    @classmethod
    def _issue(cls, ref: ModelRef, who: Requester, reason: str,
               signatures: tuple[SignaturePolicy, ...] = ()) -> Grant:
        grant = object.__new__(cls)
        for name, value in (("ref", ref), ("who", who), ("reason", reason), ("signatures", signatures)):
            object.__setattr__(grant, name, value)
        return grant

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("a Grant is immutable: ask Authority.authorize for another")

    def __repr__(self) -> str:
        return f"Grant({self.ref!s} to {self.who}: {self.reason})"


def require_grant(grant: object) -> Grant:
    """`grant`, checked at the engine's entrance: a bare reference (a door that did not ask) is a TypeError."""
    if not isinstance(grant, Grant):
        raise TypeError(f"the fetch engine takes a Grant from Authority.authorize, not {type(grant).__name__}: "
                        "every door asks the one decision first (weightcache/access.py)")
    return grant


async def _already() -> None:
    """What an always-synced Authority waits for: nothing."""


@dataclass(frozen=True)
class Authority:
    """The node's policy inputs, read at each decision (ModelCaches and settings change live).

    `model_caches`: the ModelCaches this node watches (none off-cluster). `allow_undeclared`: the config's
    `allowUndeclaredModels` as it applies here. `forbidden_paths`: the node's own directories (kubelet dir, store
    root) that no `file://` model may overlap. `declared`: the config file's models, which the node's admin wrote
    as a cluster admin writes a ModelCache. `synced`: whether `model_caches` holds the cluster's list yet (its
    watch's first list done; always off-cluster): a namespace refused before then is told to retry, not refused.
    `until_synced`: returns once `synced` says yes (the daemon's: woken by its watch's list, Node.until_listed);
    the two go together, as the defaults do (always synced)."""

    model_caches: ModelCaches = tuple
    allow_undeclared: Callable[[], bool] = lambda: True
    forbidden_paths: Sequence[str | Path] = ()
    declared: Callable[[], Iterable[ModelRef]] = tuple
    synced: Callable[[], bool] = lambda: True
    until_synced: Callable[[], Awaitable[object]] = _already

    def authorize(self, ref: ModelRef, who: Requester, *, signed_by: SignaturePolicy | None = None) -> Grant:
        """The one decision: a Grant for `ref`'s files to `who`, or NotAllowedError saying what to ask for.
        `signed_by`: the request's own signature requirement (`prefetch --signed-by`), beside the ModelCaches'."""
        if ref.scheme == "file" and (problem := file_source_problem(ref, self.forbidden_paths)):
            raise NotAllowedError(problem)
        signatures = (*((signed_by,) if signed_by is not None else ()), *self._signatures(ref))
        if who.namespace is None:
            return Grant._issue(ref, who, self._admin_reason(ref), signatures)
        decision = decide(ref, who.namespace, self._grants(), allow_undeclared=self.allow_undeclared(),
                          forbidden_paths=self.forbidden_paths)
        if not decision.allowed and not self.synced():  # the grant may be in the list not read yet
            raise PolicyNotListedError(
                f"this node has not listed the cluster's ModelCaches yet (it just started, or cannot reach the API "
                f"server), so it cannot yet decide whether namespace {who.namespace!r} may read {ref.uri}; retry in "
                f"a few seconds (kubelet does), and see the daemon's /readyz check modelcaches_synced")
        if not decision.allowed:
            raise NotAllowedError(decision.reason)
        return Grant._issue(ref, who, decision.reason, signatures)

    def _signatures(self, ref: ModelRef) -> tuple[SignaturePolicy, ...]:
        """The signature requirements of every admin-written ModelCache that declares `ref`'s source: a model one
        of them says must be signed is checked whoever asks for it (a pod, demand, another ModelCache)."""
        found = []
        for mc in self.model_caches():
            spec = mc.get("spec") or {}
            if isinstance(spec, Mapping) and spec.get("signature") is not None and admin_written(mc) \
                    and _source(mc) == ref.uri:
                name = (mc.get("metadata") or {}).get("name", "?")
                found.append(policy_from_spec(spec["signature"], source=f"ModelCache {name}"))
        return tuple(found)

    def authorize_any(self, ref: ModelRef, namespaces: Iterable[str]) -> Grant:
        """Demand made for pods of several namespaces (placement): granted when one of them may have it."""
        refusals: list[str] = []
        for namespace in sorted(set(namespaces)):
            try:
                return self.authorize(ref, Requester(namespace))
            except NotAllowedError as exc:
                refusals.append(str(exc))
        if not refusals:
            raise NotAllowedError(f"demand for {ref.uri} names no namespace that asked for it; only the placement "
                                  "controller writes demand, with the namespaces of the pods it holds")
        raise NotAllowedError(refusals[0] if len(refusals) == 1 else "; ".join(refusals))

    def _grants(self) -> list[Mapping[str, Any]]:
        caches = [mc for mc in self.model_caches() if admin_written(mc)]  # demand grants nothing
        if self.allow_undeclared():  # off-cluster, the config's file:// models are declared for every namespace
            caches += [{"metadata": {"name": f"config models[{i}]"},
                        "spec": {"source": r.uri, "include": list(r.include), "exclude": list(r.exclude),
                                 "allowedNamespaces": ["*"]}}
                       for i, r in enumerate(self.declared()) if r.scheme == "file"]
        return caches

    def _admin_reason(self, ref: ModelRef) -> str:
        if self.allow_undeclared():
            return "an admin asked (allowUndeclaredModels: true)"
        if ref.uri in {r.uri for r in self.declared()}:
            return "declared in the daemon's config"
        for mc in self.model_caches():
            if admin_written(mc) and _source(mc) == ref.uri:
                return f"declared by ModelCache {(mc.get('metadata') or {}).get('name', '?')}"
        raise NotAllowedError(
            f"no ModelCache or config entry declares {ref.uri} and allowUndeclaredModels is false on this node; "
            f"declare it (weightcache prefetch {ref.uri} --cluster) or add it to the config's models")


def admin_written(model_cache: Mapping[str, Any]) -> bool:
    """A ModelCache an admin wrote, not demand the placement controller made for its pods (which declares
    nothing: it carries the namespaces that asked, and is decided for them)."""
    labels = (model_cache.get("metadata") or {}).get("labels") or {}
    return not (isinstance(labels, Mapping) and labels.get(MANAGED_BY) == CONTROLLER)


def _source(model_cache: Mapping[str, Any]) -> str | None:
    try:
        return canonical_uri(str((model_cache.get("spec") or {}).get("source", "")))
    except ValueError:
        return None


def node_admin(root: str | Path, kubelet_dir: str | Path = KUBELET_DIR) -> Authority:
    """The authority of root on a node with no daemon (the direct CLI, `verify --repair`): any model it names,
    but never a `file://` one overlapping the node's own directories (its kubelet dir and the store root)."""
    return Authority(forbidden_paths=(kubelet_dir, root))
