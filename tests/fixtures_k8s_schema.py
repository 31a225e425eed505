"""Validate Kubernetes objects against the official OpenAPI-derived JSON schemas that kubernetes-validate bundles.

`validate_strict` uses the `-strict` schema set, where every object has `additionalProperties: false`: the API
server silently drops unknown fields, so only a strict check catches a typo such as `readonly` for `readOnly`.
`validate_manifest` uses the lenient set (unknown fields pass), like `kubectl apply` without server-side checks.
Validators are built once per (schema set, kind, apiVersion) and cached: loading the definitions is the slow part.

    validate_strict(pod)                       # raises SchemaError naming the path and the offending value
    crs = validate_file("deploy/daemonset/webhook.yaml")   # every built-in kind; returns the custom resources
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from importlib.resources import files
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry, Resource

DEFAULT_VERSION = "1.30"
_SCHEMAS = files("kubernetes_validate").joinpath("kubernetes-json-schema")


class SchemaError(AssertionError):
    """An object does not match its Kubernetes schema; the message names kind, name, path and reason."""


class NoSchemaError(LookupError):
    """No bundled schema for this kind/apiVersion (a CRD such as cert-manager's Certificate)."""


def validate_strict(doc: Mapping[str, Any], version: str = DEFAULT_VERSION) -> None:
    """Fail on any schema violation, unknown fields included."""
    _validate(doc, version, strict=True)


def validate_manifest(doc: Mapping[str, Any], version: str = DEFAULT_VERSION) -> None:
    """Fail on schema violations; unknown fields pass (use validate_strict to catch those too)."""
    _validate(doc, version, strict=False)


def has_schema(doc: Mapping[str, Any], version: str = DEFAULT_VERSION) -> bool:
    """True for built-in kinds; False for custom resources, which these schemas do not cover."""
    return _schema_path(str(doc.get("kind", "")), str(doc.get("apiVersion", "")), version, True).is_file()


def load_docs(path: str | Path) -> list[dict[str, Any]]:
    """Every non-empty document of a YAML file."""
    return [d for d in yaml.safe_load_all(Path(path).read_text()) if d]


def validate_file(path: str | Path, *, strict: bool = True, version: str = DEFAULT_VERSION) -> list[dict[str, Any]]:
    """Validate every built-in object in a YAML file; return the custom resources, which the caller checks itself."""
    custom = []
    for doc in load_docs(path):
        if not has_schema(doc, version):
            custom.append(doc)
        elif strict:
            validate_strict(doc, version)
        else:
            validate_manifest(doc, version)
    return custom


def _validate(doc: Mapping[str, Any], version: str, *, strict: bool) -> None:
    kind, api_version = str(doc.get("kind", "")), str(doc.get("apiVersion", ""))
    validator = _validator(kind, api_version, version, strict)
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        name = (doc.get("metadata") or {}).get("name") or (doc.get("metadata") or {}).get("generateName")
        lines = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {_short(e)}" for e in errors[:10]]
        raise SchemaError(
            f"{kind}/{name} does not match the {'strict ' if strict else ''}v{version} schema:\n  " + "\n  ".join(lines)
        )


def _short(error: jsonschema.ValidationError) -> str:
    # "Additional properties are not allowed ('readonly' was unexpected)" is already short; others can be huge
    message = error.message
    return message if len(message) < 300 else message[:300] + "..."


def _schema_path(kind: str, api_version: str, version: str, strict: bool) -> Path:
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)  # apps/v1 -> apps-v1
    folder = f"v{version.lstrip('v')}.0-local" + ("-strict" if strict else "")
    return Path(str(_SCHEMAS.joinpath(folder, f"{kind.lower()}-{group_version}.json")))


@functools.cache
def _validator(kind: str, api_version: str, version: str, strict: bool) -> jsonschema.Validator:
    path = _schema_path(kind, api_version, version, strict)
    if not path.is_file():
        raise NoSchemaError(f"no v{version} schema for kind {kind!r} apiVersion {api_version!r} (custom resource?)")
    schema = json.loads(path.read_text())
    registry: Registry = Resource.from_contents(schema) @ Registry()
    registry = _definitions(path.parent) @ registry
    return jsonschema.Draft202012Validator(schema, registry=registry)


@functools.cache
def _definitions(folder: Path) -> Resource[Any]:
    return Resource.from_contents(json.loads((folder / "_definitions.json").read_text()))
