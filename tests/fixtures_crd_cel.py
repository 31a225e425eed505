"""A CRD schema's `x-kubernetes-validations` rules evaluated with cel-python, as the API server evaluates them
beside the structural schema (which jsonschema checks): `self` is the value at the rule's place. `cel_eval` is
the one way tests evaluate CEL (policies, selectors, rules): each expression compiled once."""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any

import celpy
from celpy.adapter import json_to_cel

_LOCK = threading.Lock()


def cel_errors(schema: dict[str, Any], value: Any, path: str = "") -> list[tuple[str, str]]:
    """(field path, message) of every failed rule in `schema` for `value`; the message is the rule's own, never
    the value (the API server reports a CEL failure as `Invalid value: "string": <message>`)."""
    found: list[tuple[str, str]] = []
    for rule in schema.get("x-kubernetes-validations", []):
        with _LOCK:  # a compiled cel-python program is not safe to run from two threads (the fake's handlers)
            ok = bool(_program(rule["rule"]).evaluate({"self": json_to_cel(value)}))
        if not ok:
            found.append((path or "<root>", rule.get("message", f"failed rule: {rule['rule']}")))
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                found += cel_errors(sub, value[key], f"{path}.{key}" if path else key)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            found += cel_errors(schema["items"], item, f"{path}[{i}]")
    return found


def cel_eval(expression: str, activation: dict[str, Any]) -> Any:
    """`expression` evaluated on `activation` (CEL values: json_to_cel), compiled once per process: every test that
    plays the API server's or the scheduler's CEL side uses this one (a compile is tens of milliseconds)."""
    with _LOCK:
        return _program(expression).evaluate(activation)


@functools.cache
def _program(rule: str) -> Any:
    """Compiled once: cel-python's parser takes tens of milliseconds, and the fake API server checks every write."""
    env = celpy.Environment()
    return env.program(env.compile(rule))


def _rules(schema: Any) -> list[str]:
    if isinstance(schema, dict):
        return [r["rule"] for r in schema.get("x-kubernetes-validations", [])] + [
            rule for v in schema.values() for rule in _rules(v)]
    return [rule for v in schema for rule in _rules(v)] if isinstance(schema, list) else []


def _warm() -> None:
    """Compile our CRDs' rules at import, not inside the fake API server's first write: a first compile takes
    most of a second, long enough to reorder what tests that watch the fake's requests expect."""
    import yaml

    for path in (Path(__file__).resolve().parent.parent / "deploy" / "daemonset").glob("crd-*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            for rule in _rules(doc):
                _program(rule)


_warm()
