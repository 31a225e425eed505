"""Which namespace may mount which model: one decision for the daemon, the CSI plugin and the webhook.

In cluster mode a model is readable from a namespace only when some ModelCache declares that model (same
canonical source URI) and lists the namespace in `spec.allowedNamespaces` (`"*"` means every namespace).
A ModelCache without `allowedNamespaces` prefetches but grants nothing. Off-cluster, `allow_undeclared`
(the config's `allowUndeclaredModels`) lets every model through when no ModelCache declares it.
The node's credentials must never become a way to read any bucket the node can reach.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from weightcache.errors import InvalidReferenceError, NotAllowedError
from weightcache.uri import canonical_uri


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str


def decide(
    model_uri: str,
    namespace: str,
    model_caches: Iterable[Mapping[str, Any]],
    *,
    allow_undeclared: bool,
) -> Decision:
    """Decide whether pods in `namespace` may mount `model_uri`, given the cluster's ModelCache objects."""
    try:
        wanted = canonical_uri(model_uri)
    except InvalidReferenceError as exc:
        return Decision(False, str(exc))
    declaring = []
    for mc in model_caches:
        spec = mc.get("spec") or {}
        try:
            if canonical_uri(str(spec.get("source", ""))) != wanted:
                continue
        except InvalidReferenceError:
            continue
        declaring.append((mc.get("metadata") or {}).get("name", "?"))
        allowed = spec.get("allowedNamespaces") or []
        if "*" in allowed or namespace in allowed:
            return Decision(True, f"ModelCache {declaring[-1]} allows namespace {namespace}")
    if declaring:
        return Decision(
            False,
            f"model {wanted} is declared by ModelCache {', '.join(declaring)} but namespace {namespace!r} is not in "
            f"its spec.allowedNamespaces; ask a cluster admin to add it",
        )
    if allow_undeclared:
        return Decision(True, "undeclared models are allowed (allowUndeclaredModels: true)")
    return Decision(
        False,
        f"no ModelCache declares model {wanted}; create one with spec.source: {wanted} and "
        f"spec.allowedNamespaces: [{namespace}] (or run: weightcache prefetch {wanted} --cluster)",
    )


def require(
    model_uri: str,
    namespace: str,
    model_caches: Iterable[Mapping[str, Any]],
    *,
    allow_undeclared: bool,
) -> None:
    """Raise NotAllowedError with the decision's reason when the namespace may not read the model."""
    decision = decide(model_uri, namespace, model_caches, allow_undeclared=allow_undeclared)
    if not decision.allowed:
        raise NotAllowedError(decision.reason)
