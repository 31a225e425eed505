"""A small Kubernetes API server on 127.0.0.1 for tests, speaking the REST and watch protocol of the real one.

The official `kubernetes` client talks to it unchanged (`Configuration().host = server.url`), so a wrong path,
verb, query parameter or patch content type fails here as it would against a cluster:

    GET    /api/v1/nodes[?limit=&continue=&labelSelector=&fieldSelector=]       list (paginated, resourceVersion)
    GET    /api/v1/nodes?watch=true&resourceVersion=N&allowWatchBookmarks=true  chunked JSON lines:
                                                                                {"type": "ADDED", "object": {...}}
    GET|PUT|PATCH|DELETE /api/v1/nodes/{name}[/status]
    POST   /api/v1/namespaces/{ns}/events, PATCH .../events/{name}
    .../apis/weightcache.io/v1alpha1/{modelcaches,modelcachenodes}[/{name}[/status]]
    /api/v1/namespaces/{ns}/pods[/{name}], /apis/coordination.k8s.io/v1/namespaces/{ns}/leases[/{name}]

Semantics kept: resourceVersion is one counter across all objects; a watch from a version older than the
retained history gets one ERROR event carrying a 410 "Expired" Status; BOOKMARK events carry only
metadata.resourceVersion; `timeoutSeconds` ends the stream cleanly; the status subresource separates spec and
status writes; custom resources refuse strategic merge patch (415) and need resourceVersion on PUT; errors are
`Status` objects with the real reasons (NotFound, AlreadyExists, Conflict, Invalid, Expired). Pod updates follow
the API server's rules for the fields placement changes (scheduling gates, nodeSelector, node affinity); Node taints
are validated (effect, unique key and effect) and an empty list is dropped; a JSON patch whose `test` fails is 422
Invalid (apiserver handlers/patch.go `applyJSPatch`), applied to the object as stored now. Not modelled:
consistent snapshots across `continue` pages (pages read current data), server-side apply, field managers.

Test controls: `expire_before(rv)`, `drop_watches()`, `hang_watches`, `send_bookmark()`, `requests`,
`before_request` (another client's write between two of ours), and
direct object access (`create`, `get`, `update`, `delete`) that emits watch events like an API write.
"""

from __future__ import annotations

import base64
import copy
import datetime
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import jsonpatch
import jsonschema
import kubernetes
import pytest
import yaml

from tests.fake_rules import (
    AdmissionPolicies,
    Attributes,
    QuantityError,
    Rbac,
    User,
    admission_request,
    canonicalize_claim,
    canonicalize_slice,
    claim_status_errors,
    drop_deallocated_devices,
)
from tests.fixtures_crd_cel import cel_errors

Obj = dict[str, Any]

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_TRUE = {"1", "t", "T", "TRUE", "true", "True"}  # Go's strconv.ParseBool, as the real server parses it


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    status_subresource: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def custom(self) -> bool:
        return bool(self.group)

    @property
    def qualified(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural


RESOURCES = {
    r.plural: r
    for r in (
        Resource("", "v1", "nodes", "Node", False, True),
        Resource("", "v1", "events", "Event", True, False),
        Resource("", "v1", "pods", "Pod", True, True),
        Resource("coordination.k8s.io", "v1", "leases", "Lease", True, False),
        Resource("resource.k8s.io", "v1", "resourceslices", "ResourceSlice", False, False),
        Resource("resource.k8s.io", "v1", "resourceclaims", "ResourceClaim", True, True),
        Resource("resource.k8s.io", "v1", "resourceclaimtemplates", "ResourceClaimTemplate", True, False),
        Resource("weightcache.io", "v1alpha1", "modelcaches", "ModelCache", False, True),
        Resource("weightcache.io", "v1alpha1", "modelcachenodes", "ModelCacheNode", False, True),
    )
}

_CORE = re.compile(r"^/api/v1(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?$")
_GROUP = re.compile(
    r"^/apis/(?P<group>[^/]+)/(?P<version>[^/]+)(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)"
    r"(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?$"
)


@dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str
    query: dict[str, str]
    content_type: str | None
    body: Any


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: Obj | None = None) -> None:
        super().__init__(message)
        self.status: Obj = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "details": details or {},
            "code": code,
        }


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge recursively, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _without_rv(obj: Obj) -> Obj:
    return {**obj, "metadata": {k: v for k, v in obj["metadata"].items() if k != "resourceVersion"}}


def _selector_matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif re.match(r"^[A-Za-z0-9./_-]+$", term):
            if term not in labels:
                return False
        else:
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {term!r} (this fake supports =, ==, != and exists)")
    return True


class FakeApiServer:
    """In-memory API server. Use as a context manager; `api_client()` gives an official client pointed at it."""

    def __init__(self, *, schemas: dict[str, Obj] | None = None, bookmark_interval: float | None = None,
                 rbac: Rbac | None = None, policies: AdmissionPolicies | None = None) -> None:
        self.schemas = schemas or {}  # plural -> openAPIV3Schema, validated on create/update like a CRD
        # with `rbac`, every HTTP request needs a token from `token_for` and is authorized by these roles (the
        # test's own direct calls act as cluster admin, as the scheduler and kubelet would)
        self.rbac = rbac
        self.forbidden: list[str] = []  # the 403 messages answered, for a test that asserts none
        self.policies = policies  # ValidatingAdmissionPolicies checked on every update a token's user sends
        self._tokens: dict[str, User] = {}
        self.bookmark_interval = bookmark_interval
        self.requests: list[RequestRecord] = []
        self.hang_watches = False
        self.fail_requests = 0  # answer the next N requests with 500, as an overloaded apiserver does
        # called with each request before it is served: a test writes here what another client wrote meanwhile
        self.before_request: Callable[[RequestRecord], None] | None = None
        self.version = ("1", "34")  # what GET /version says (major, minor): the DRA driver reads it
        # plural -> edits an object before it is stored: a server whose feature gate is off drops its fields
        self.on_store: dict[str, Callable[[Obj], None]] = {}
        self._objects: dict[tuple[str, str, str], Obj] = {}
        self._history: list[tuple[int, str, str, str, Obj]] = []  # (rv, plural, ns, type, object)
        self._rv = 100
        self._oldest = 0
        self._drop_gen = 0
        self._bookmark_gen = 0
        self._closed = False
        self._cond = threading.Condition()
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.api = self
        self._thread = threading.Thread(target=lambda: self._httpd.serve_forever(0.05), name="fake-apiserver", daemon=True)

    # lifecycle ------------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def start(self) -> FakeApiServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> FakeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def api_client(self, token: str | None = None) -> kubernetes.client.ApiClient:
        config = kubernetes.client.Configuration()
        config.host = self.url
        if token is not None:
            config.api_key = {"BearerToken": token}  # the client's own key since v36 (its prefix is read by it)
            config.api_key_prefix = {"BearerToken": "Bearer"}
        return kubernetes.client.ApiClient(config)

    def token_for(self, user: User, token: str | None = None) -> str:
        """A bearer token that authenticates as `user` (a ServiceAccount's pod-bound token names its node);
        `token`: that one (`use_as_kubeconfig` writes `test-token`)."""
        token = token or uuid.uuid4().hex
        self._tokens[token] = user
        return token

    def authenticate(self, header: str | None) -> User | None:
        """The caller of an HTTP request: None (everything allowed) without `rbac`, else the token's user."""
        if self.rbac is None:
            return None
        scheme, _, token = (header or "").partition(" ")
        user = self._tokens.get(token.strip()) if scheme.lower() == "bearer" else None  # bearertoken.go's rule
        if user is None:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        return user

    def authorize(self, user: User | None, attrs: Attributes) -> None:
        if self.rbac is not None and not self.rbac.allows(user, attrs):
            assert user is not None
            res = RESOURCES.get(attrs.resource)
            self.forbidden.append(attrs.forbidden(user))
            raise ApiError(403, "Forbidden", attrs.forbidden(user),
                           {"name": attrs.name, "group": attrs.group, "kind": res.plural if res else attrs.resource})

    # test controls --------------------------------------------------------------------------------------------
    @property
    def resource_version(self) -> int:
        with self._cond:
            return self._rv

    def expire_before(self, rv: int) -> None:
        """Forget history older than rv: watches from an older version get 410 Expired, as after compaction."""
        with self._cond:
            self._oldest = rv
            self._history = [h for h in self._history if h[0] >= rv]

    def drop_watches(self) -> None:
        """Cut every open watch connection without the closing chunk, as a crashed apiserver or LB would."""
        with self._cond:
            self._drop_gen += 1
            self._cond.notify_all()

    def send_bookmark(self) -> None:
        """Send a BOOKMARK with the current resourceVersion on every watch that allowed bookmarks."""
        with self._cond:
            self._bookmark_gen += 1
            self._cond.notify_all()

    def requests_matching(self, method: str, path_part: str = "", **query: str) -> list[RequestRecord]:
        return [r for r in list(self.requests) if r.method == method and path_part in r.path
                and all(r.query.get(k) == v for k, v in query.items())]

    def wait_requests(self, method: str, path_part: str = "", count: int = 1, timeout: float = 10.0, **query: str) -> list[RequestRecord]:
        """Block until `count` matching requests have arrived (a readiness check that is not a sleep)."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.requests_matching(method, path_part, **query)) >= count, timeout):
                raise TimeoutError(f"expected {count} {method} {path_part} {query}; got {self.requests_matching(method, path_part)}")
        return self.requests_matching(method, path_part, **query)

    # object access (also used by the HTTP handler) ------------------------------------------------------------
    def use_as_kubeconfig(self, directory: Path, monkeypatch: pytest.MonkeyPatch, token: str = "test-token") -> Path:
        """Write a kubeconfig naming this server into `directory` and point KUBECONFIG at it for the test: the
        official client (and everything of ours that loads a config) then talks to this server (as the user of
        `token`, from `token_for`, where the server enforces `rbac`)."""
        config = directory / "kubeconfig"
        config.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "t",
            "clusters": [{"name": "c", "cluster": {"server": self.url}}],
            "users": [{"name": "u", "user": {"token": token}}],
            "contexts": [{"name": "t", "context": {"cluster": "c", "user": "u"}}]}))
        monkeypatch.setenv("KUBECONFIG", str(config))
        return config

    def get(self, plural: str, name: str, namespace: str = "") -> Obj:
        with self._cond:
            obj = self._objects.get((plural, namespace, name))
            if obj is None:
                raise self._not_found(RESOURCES[plural], name)
            return copy.deepcopy(obj)

    def list(self, plural: str, namespace: str = "") -> list[Obj]:
        with self._cond:
            return [copy.deepcopy(o) for (p, ns, _), o in sorted(self._objects.items()) if p == plural and (not namespace or ns == namespace)]

    def create(self, plural: str, obj: Obj, namespace: str = "", *, user: User | None = None) -> Obj:
        res = RESOURCES[plural]
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if meta.get("namespace", namespace) != namespace:
            raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the namespace sent on the request")
        if res.namespaced:
            meta["namespace"] = namespace
        self._decode(res, obj)
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        self._validate(res, obj)
        name = meta["name"]
        obj["apiVersion"], obj["kind"] = res.api_version, res.kind
        if self.policies is not None and user is not None:  # validating admission runs on creates too
            request = admission_request(user, "CREATE", res.group, res.version, res.plural, "", obj, None)
            if (denied := self.policies.denial(request)) is not None:
                self.forbidden.append(denied)
                raise ApiError(403, "Forbidden", denied)
        if res.status_subresource and res.custom:
            obj.pop("status", None)  # create ignores status when the status subresource is on
        with self._cond:
            if (plural, namespace, name) in self._objects:
                raise ApiError(409, "AlreadyExists", f'{res.qualified} "{name}" already exists',
                               {"name": name, "group": res.group, "kind": res.plural})
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now())
            meta.pop("resourceVersion", None)
            if res.custom:
                meta["generation"] = 1
            return self._commit(res, namespace, name, obj, "ADDED")

    def update(self, plural: str, name: str, obj: Obj, *, namespace: str = "", subresource: str = "",
               user: User | None = None) -> Obj:
        """Replace an object (PUT) with the real server's precondition and subresource rules."""
        res = RESOURCES[plural]
        with self._cond:
            old = self._current(res, namespace, name)
            meta = obj.get("metadata") or {}
            if meta.get("name", name) != name:
                raise ApiError(400, "BadRequest", "the name of the object does not match the name on the URL")
            if res.custom and not meta.get("resourceVersion"):
                raise self._invalid(res, name, "metadata.resourceVersion", "must be specified for an update")
            return self._write(res, namespace, name, old, copy.deepcopy(obj), subresource, "update", user)

    def patch(self, plural: str, name: str, body: Any, content_type: str, *, namespace: str = "", subresource: str = "",
              user: User | None = None) -> Obj:
        res = RESOURCES[plural]
        kind = content_type.split(";")[0].strip().lower()
        allowed = ["application/json-patch+json", "application/merge-patch+json"]
        if not res.custom:
            allowed.append("application/strategic-merge-patch+json")
        if kind not in allowed:
            raise ApiError(415, "UnsupportedMediaType",
                           f"the body of the request was in an unknown format - accepted media types include: {', '.join(allowed)}")
        with self._cond:
            old = self._current(res, namespace, name)
            if kind == "application/json-patch+json":
                if not isinstance(body, list):
                    raise ApiError(400, "BadRequest", "json: cannot unmarshal object into Go value of type jsonpatch.Patch")
                try:
                    new = jsonpatch.apply_patch(old, body)
                except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                    raise ApiError(422, "Invalid",
                                   f"the server rejected our request due to an error in our request: {exc}") from None
            else:  # merge patch; strategic merge behaves the same for the maps (labels) core objects use here and
                # for Node spec.taints, a list without a patch merge key (k8s.io/api core/v1 NodeSpec): replaced whole
                if not isinstance(body, dict):
                    raise ApiError(400, "BadRequest", "json: cannot unmarshal array into Go value of type map[string]interface {}")
                new = merge_patch(old, body)
            return self._write(res, namespace, name, old, new, subresource, "patch", user)

    def delete(self, plural: str, name: str, namespace: str = "") -> Obj:
        res = RESOURCES[plural]
        with self._cond:
            old = self._current(res, namespace, name)
            del self._objects[(plural, namespace, name)]
            self._rv += 1
            old = copy.deepcopy(old)
            old["metadata"]["resourceVersion"] = str(self._rv)
            self._history.append((self._rv, plural, namespace, "DELETED", old))
            self._cond.notify_all()
            return copy.deepcopy(old)

    # internals ------------------------------------------------------------------------------------------------
    def _current(self, res: Resource, namespace: str, name: str) -> Obj:
        obj = self._objects.get((res.plural, namespace, name))
        if obj is None:
            raise self._not_found(res, name)
        return copy.deepcopy(obj)

    def _write(self, res: Resource, namespace: str, name: str, old: Obj, new: Obj, subresource: str,
               verb: str = "update", user: User | None = None) -> Obj:
        if subresource not in ("", "status") or (subresource and not res.status_subresource):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        want_rv = (new.get("metadata") or {}).get("resourceVersion")
        if want_rv and want_rv != old["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict",
                           f'Operation cannot be fulfilled on {res.qualified} "{name}": the object has been modified; '
                           "please apply your changes to the latest version and try again",
                           {"name": name, "group": res.group, "kind": res.plural})
        if subresource == "status":
            result = copy.deepcopy(old)
            result["status"] = new.get("status")
            if result["status"] is None:
                result.pop("status")
        else:
            result = new
            if res.status_subresource:  # the main resource ignores status changes
                result.pop("status", None)
                if "status" in old:
                    result["status"] = old["status"]
        meta = result.setdefault("metadata", {})
        for key in ("uid", "creationTimestamp", "namespace", "name", "generation"):  # immutable / server-owned
            if key in old["metadata"]:
                meta[key] = old["metadata"][key]
        result["apiVersion"], result["kind"] = res.api_version, res.kind
        self._decode(res, result)
        self._validate(res, result)
        if res.plural == "pods" and not subresource:
            _check_pod_update(name, old.get("spec") or {}, result.get("spec") or {})
        if res.plural == "pods" and subresource:
            _check_pod_status(name, result)
        if res.plural == "resourceclaims" and subresource:
            self._check_claim_status(name, namespace, result, old, verb, user)
        if res.plural == "resourceclaimtemplates" and result.get("spec") != old.get("spec"):
            raise self._invalid(res, name, "spec", f"Invalid value: {json.dumps(result.get('spec'))}: field is immutable")
        if res.plural == "nodes":
            _check_node_taints(name, result)
        if self.policies is not None and user is not None:
            request = admission_request(user, "UPDATE", res.group, res.version, res.plural, subresource, result, old)
            if (denied := self.policies.denial(request)) is not None:
                self.forbidden.append(denied)
                raise ApiError(403, "Forbidden", denied)
        if res.custom and result.get("spec") != old.get("spec"):
            meta["generation"] = old["metadata"].get("generation", 1) + 1
        if _without_rv(result) == _without_rv(old):
            return copy.deepcopy(old)  # a no-op write does not bump resourceVersion, like the real server
        return self._commit(res, namespace, name, result, "MODIFIED")

    def _check_claim_status(self, name: str, namespace: str, new: Obj, old: Obj, verb: str, user: User | None) -> None:
        """resourceclaimStatusStrategy: device entries of deallocated devices go; with RBAC on, who may change
        `status.devices` and `status.allocation` (tests/fake_rules.py)."""
        status, before = new.setdefault("status", {}), old.get("status") or {}
        drop_deallocated_devices(status, before)
        if self.rbac is None:
            return
        errors = claim_status_errors(self.rbac, user, verb, namespace, status, before)
        if errors:
            parts = [f"{f}: Forbidden: {d}" for f, d in errors]  # field.ErrorList.ToAggregate()'s text
            text = parts[0] if len(parts) == 1 else f"[{', '.join(parts)}]"
            raise ApiError(422, "Invalid", f'ResourceClaim.resource.k8s.io "{name}" is invalid: {text}',
                           {"name": name, "group": "resource.k8s.io", "kind": "ResourceClaim",
                            "causes": [{"reason": "FieldValueForbidden", "message": f"Forbidden: {d}", "field": f}
                                       for f, d in errors]})

    def _decode(self, res: Resource, obj: Obj) -> None:
        """What decoding does to a body before anything compares or stores it: quantities become canonical."""
        try:
            if res.plural == "resourceslices":
                canonicalize_slice(obj)
            elif res.plural == "resourceclaims":
                canonicalize_claim(obj)
            elif res.plural == "resourceclaimtemplates":
                canonicalize_claim(obj.get("spec") or {})
        except QuantityError as exc:
            raise ApiError(400, "BadRequest", f"{res.kind} in version \"{res.version}\" cannot be handled as a "
                           f"{res.kind}: {exc}") from None

    def _commit(self, res: Resource, namespace: str, name: str, obj: Obj, kind: str) -> Obj:
        if (edit := self.on_store.get(res.plural)) is not None:
            edit(obj)
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        self._objects[(res.plural, namespace, name)] = obj
        self._history.append((self._rv, res.plural, namespace, kind, copy.deepcopy(obj)))
        self._cond.notify_all()
        return copy.deepcopy(obj)

    def _validate(self, res: Resource, obj: Obj) -> None:
        name = (obj.get("metadata") or {}).get("name") or ""
        if not name:
            raise self._invalid(res, name, "metadata.name", "Required value: name or generateName is required")
        if len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
            raise self._invalid(res, name, "metadata.name",
                                f"Invalid value: {name!r}: a lowercase RFC 1123 subdomain must consist of lower case "
                                "alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character")
        if res.plural == "events":
            self._validate_event(res, obj)
        schema = self.schemas.get(res.plural)
        if schema:
            body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
            errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(body), key=lambda e: list(e.path))
            if errors:
                err = errors[0]
                raise self._invalid(res, name, ".".join(str(p) for p in err.path) or "<root>", err.message)
            for field, message in cel_errors(schema, body)[:1]:  # x-kubernetes-validations, as the server runs them
                raise self._invalid(res, name, field, message)

    def _validate_event(self, res: Resource, obj: Obj) -> None:
        # apiserver's legacy event validation: a cluster-scoped involvedObject needs the event in "default"
        involved = obj.get("involvedObject") or {}
        event_ns = obj["metadata"].get("namespace") or ""
        if not involved.get("namespace"):
            if event_ns not in ("", "default"):
                raise self._invalid(res, obj["metadata"]["name"], "involvedObject.namespace",
                                    "Invalid value: \"\": does not match event.namespace")
        elif involved["namespace"] != event_ns:
            raise self._invalid(res, obj["metadata"]["name"], "involvedObject.namespace",
                                f"Invalid value: {involved['namespace']!r}: does not match event.namespace")

    def _not_found(self, res: Resource, name: str) -> ApiError:
        return ApiError(404, "NotFound", f'{res.qualified} "{name}" not found',
                        {"name": name, "group": res.group, "kind": res.plural})

    def _invalid(self, res: Resource, name: str, field: str, message: str) -> ApiError:
        group = f".{res.group}" if res.group else ""
        return ApiError(422, "Invalid", f'{res.kind}{group} "{name}" is invalid: {field}: {message}',
                        {"name": name, "group": res.group, "kind": res.kind,
                         "causes": [{"reason": "FieldValueInvalid", "message": message, "field": field}]})

    def list_page(self, res: Resource, namespace: str, query: dict[str, str]) -> Obj:
        label_sel, field_sel = query.get("labelSelector", ""), query.get("fieldSelector", "")
        limit = int(query.get("limit") or 0)
        start, list_rv = "", None
        if query.get("continue"):
            try:
                token = json.loads(base64.urlsafe_b64decode(query["continue"]))
                start, list_rv = token["start"], int(token["rv"])
            except (ValueError, KeyError, TypeError):
                raise ApiError(400, "BadRequest", "continue key is not valid: incorrect encoded start resourceVersion "
                                                  "(version meta.k8s.io/v1)") from None
        with self._cond:
            if list_rv is not None and list_rv < self._oldest:
                raise ApiError(410, "Expired", "The provided continue parameter is too old to display a consistent list result. "
                                               "You can start a new list without the continue parameter.")
            list_rv = list_rv if list_rv is not None else self._rv
            items = [
                copy.deepcopy(o)
                for (p, ns, name), o in sorted(self._objects.items())
                if p == res.plural and (not namespace or ns == namespace) and f"{ns}/{name}" > start
                and self._selected(o, label_sel, field_sel)
            ]
        meta: Obj = {"resourceVersion": str(list_rv)}
        if limit and len(items) > limit:
            last = items[limit - 1]["metadata"]
            key = f"{last.get('namespace', '')}/{last['name']}"
            meta["continue"] = base64.urlsafe_b64encode(json.dumps({"rv": list_rv, "start": key}).encode()).decode()
            meta["remainingItemCount"] = len(items) - limit
            items = items[:limit]
        return {"kind": f"{res.kind}List", "apiVersion": res.api_version, "metadata": meta, "items": items}

    def _selected(self, obj: Obj, label_sel: str, field_sel: str) -> bool:
        meta = obj.get("metadata") or {}
        for term in filter(None, field_sel.split(",")):
            key, _, value = term.replace("==", "=").partition("=")
            if key == "metadata.name" and meta.get("name") != value:
                return False
            if key == "metadata.namespace" and meta.get("namespace", "") != value:
                return False
            if key in _SPEC_FIELDS.get(obj.get("kind", ""), ()):  # e.g. ResourceSlice spec.nodeName
                if str((obj.get("spec") or {}).get(key.partition(".")[2], "")) != value:
                    return False
                continue
            if key not in ("metadata.name", "metadata.namespace"):
                raise ApiError(400, "BadRequest", f'field label not supported: {key}')
        return _selector_matches(label_sel, meta.get("labels") or {}) if label_sel else True


# spec fields the real server accepts in fieldSelector, per kind (k8s.io/api resource/v1 ResourceSlice)
_SPEC_FIELDS = {"ResourceSlice": ("spec.nodeName", "spec.driver")}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    api: FakeApiServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients that hang up mid-stream are part of the tests


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in separate writes: no 40 ms delayed-ACK stall
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        api = self.server.api
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        content_type = self.headers.get("Content-Type")
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        record = RequestRecord(method, parts.path, query, content_type, body)
        with api._cond:
            api.requests.append(record)
            api._cond.notify_all()
        if api.before_request is not None:
            api.before_request(record)
        try:
            with api._cond:
                failing, api.fail_requests = api.fail_requests > 0, max(0, api.fail_requests - 1)
            if failing:
                raise ApiError(500, "InternalError", "Internal error occurred: injected by the test")
            if parts.path in ("/version", "/version/") and method == "GET":
                major, minor = api.version
                self._reply(200, {"major": major, "minor": minor, "gitVersion": f"v{major}.{minor}.0",
                                  "gitCommit": "0" * 40, "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z",
                                  "goVersion": "go1.25", "compiler": "gc", "platform": "linux/amd64"})
                return
            res, ns, name, sub = self._route(parts.path)
            user = api.authenticate(self.headers.get("Authorization"))
            watch = method == "GET" and not name and query.get("watch") in _TRUE
            verb = {"GET": "watch" if watch else "get" if name else "list", "POST": "create", "PUT": "update",
                    "PATCH": "patch", "DELETE": "delete" if name else "deletecollection"}[method]
            api.authorize(user, Attributes(verb, res.group, res.plural, sub, ns, name))
            if body is not None and "json" not in (content_type or "") and method in ("POST", "PUT"):
                raise ApiError(415, "UnsupportedMediaType", "the body of the request was in an unknown format - accepted media types include: application/json")
            if isinstance(body, str) and "json" in (content_type or ""):
                raise ApiError(400, "BadRequest", "the request body is not valid JSON")
            if watch:
                self._watch(api, res, ns, query)
                return
            self._reply(*self._handle(api, method, res, ns, name, sub, query, body, content_type or "", user))
        except ApiError as exc:
            self._reply(exc.status["code"], exc.status)

    def _route(self, path: str) -> tuple[Resource, str, str, str]:
        match = _CORE.match(path) or _GROUP.match(path)
        gone = ApiError(404, "NotFound", "the server could not find the requested resource")
        if not match:
            raise gone
        groups = match.groupdict()
        res = RESOURCES.get(groups["plural"])
        if res is None or (groups.get("group") or "") != res.group or (groups.get("version") or "v1") != res.version:
            raise gone
        if bool(groups["ns"]) and not res.namespaced:
            raise gone
        return res, groups["ns"] or "", groups["name"] or "", groups["sub"] or ""

    def _handle(self, api: FakeApiServer, method: str, res: Resource, ns: str, name: str, sub: str,
                query: dict[str, str], body: Any, content_type: str, user: User | None) -> tuple[int, Obj]:
        not_allowed = ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")
        if not name:
            if method == "GET":
                return 200, api.list_page(res, ns, query)
            if method == "POST":
                if res.namespaced and not ns:
                    raise not_allowed
                if not isinstance(body, dict):
                    raise ApiError(400, "BadRequest", "the request body must be a JSON object")
                return 201, api.create(res.plural, body, ns, user=user)
            raise not_allowed
        if method == "GET":
            obj = api.get(res.plural, name, ns)
            if sub and sub != "status":
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            return 200, obj
        if method == "PUT":
            if not isinstance(body, dict):
                raise ApiError(400, "BadRequest", "the request body must be a JSON object")
            return 200, api.update(res.plural, name, body, namespace=ns, subresource=sub, user=user)
        if method == "PATCH":
            return 200, api.patch(res.plural, name, body, content_type, namespace=ns, subresource=sub, user=user)
        if method == "DELETE" and not sub:
            return 200, api.delete(res.plural, name, ns)
        raise not_allowed

    def _reply(self, code: int, payload: Obj) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    # watch ----------------------------------------------------------------------------------------------------
    def _watch(self, api: FakeApiServer, res: Resource, ns: str, query: dict[str, str]) -> None:
        bookmarks = query.get("allowWatchBookmarks") in _TRUE
        deadline = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
        label_sel, field_sel = query.get("labelSelector", ""), query.get("fieldSelector", "")
        rv = query.get("resourceVersion") or ""
        pending: list[Obj] = []
        with api._cond:
            drop_gen, bookmark_gen = api._drop_gen, api._bookmark_gen
            if rv in ("", "0"):  # "send initial events": the current state as ADDED, then changes
                cursor = api._rv
                pending = [{"type": "ADDED", "object": copy.deepcopy(o)} for (p, n, _), o in sorted(api._objects.items())
                           if p == res.plural and (not ns or n == ns) and api._selected(o, label_sel, field_sel)]
            elif not rv.isdigit() or int(rv) < api._oldest:
                cursor = -1
                pending = [{"type": "ERROR", "object": ApiError(410, "Expired", f"too old resource version: {rv} ({api._oldest})").status}]
            else:
                cursor = int(rv)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for event in pending:
                self._chunk(event)
            if cursor < 0:
                self._end()
                return
            last_bookmark = time.monotonic()
            while True:
                with api._cond:
                    api._cond.wait_for(
                        lambda seen=bookmark_gen, after=cursor: api._closed or api._drop_gen != drop_gen
                        or api._bookmark_gen != seen or (not api.hang_watches and (api._rv > after or time.monotonic() >= deadline)),
                        timeout=0.05,
                    )
                    if api._closed or api._drop_gen != drop_gen:
                        self.close_connection = True
                        self.connection.shutdown(2)  # cut mid-stream: no closing chunk
                        return
                    if api.hang_watches:
                        continue
                    events = [{"type": t, "object": copy.deepcopy(o)} for (r, p, n, t, o) in api._history
                              if r > cursor and p == res.plural and (not ns or n == ns) and api._selected(o, label_sel, field_sel)]
                    cursor = api._rv
                    want_bookmark = bookmarks and (api._bookmark_gen != bookmark_gen or (
                        api.bookmark_interval is not None and time.monotonic() - last_bookmark >= api.bookmark_interval))
                    bookmark_gen = api._bookmark_gen
                for event in events:
                    self._chunk(event)
                if want_bookmark:
                    last_bookmark = time.monotonic()
                    self._chunk({"type": "BOOKMARK", "object": {"kind": res.kind, "apiVersion": res.api_version,
                                                                 "metadata": {"resourceVersion": str(cursor)}}})
                if time.monotonic() >= deadline:
                    self._end()
                    return
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.close_connection = True

    def _chunk(self, event: Obj) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _end(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


_POD_FORBIDDEN = ("Forbidden: pod updates may not change fields other than `spec.containers[*].image`, "
                  "`spec.initContainers[*].image`, `spec.activeDeadlineSeconds`, `spec.tolerations` (only additions "
                  "to existing tolerations), `spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was "
                  "previously negative)")


_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _check_pod_status(name: str, pod: Obj) -> None:
    """validatePodExtendedResourceClaimStatus (pkg/apis/core/validation): the scheduler's record of the claim it made
    for a pod's DRA extended resources names the pod's containers, their requested resources and the claim."""
    status = (pod.get("status") or {}).get("extendedResourceClaimStatus")
    if status is None:
        return
    path = "status.extendedResourceClaimStatus"
    spec = pod.get("spec") or {}
    containers = {c.get("name"): c for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]}
    errors: list[str] = []
    mappings = status.get("requestMappings") or []
    if not mappings:
        errors.append(f"{path}.requestMappings: Required value: at least one request mapping is required")
    for i, m in enumerate(mappings):
        container = containers.get(m.get("containerName"))
        if container is None:
            errors.append(f"{path}.requestMappings[{i}].containerName: Invalid value: {m.get('containerName')!r}: must "
                          "match the name of an entry in spec.initContainers.name or spec.containers.name")
        elif m.get("resourceName") not in ((container.get("resources") or {}).get("requests") or {}):
            errors.append(f"{path}.requestMappings[{i}].resourceName: Invalid value: {m.get('resourceName')!r}: must "
                          "match the extended resource name of an entry in spec.initContainers.resources.requests or "
                          "spec.containers.resources.requests")
        if not _DNS_LABEL.match(str(m.get("requestName") or "")):
            errors.append(f"{path}.requestName: Invalid value: {m.get('requestName')!r}: a lowercase RFC 1123 label")
    claim = str(status.get("resourceClaimName") or "")
    if not claim or not _DNS_SUBDOMAIN.match(claim):
        errors.append(f"{path}.resourceClaimName: Required value")
    if errors:
        text = errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]"
        raise ApiError(422, "Invalid", f'Pod "{name}" is invalid: {text}', {"name": name, "kind": "Pod"})


def _check_pod_update(name: str, old: Obj, new: Obj) -> None:
    """The API server's pod update rules for the fields placement touches (ValidatePodUpdate, and
    KEP-3838 mutable scheduling directives for gated pods): gates may only be removed; while the OLD pod is
    gated, nodeSelector may only gain keys, a required node affinity may be set when absent or its terms may
    only gain matchExpressions, preferred terms may change; every other spec field stays as it was."""
    def invalid(field: str, message: str) -> ApiError:
        return ApiError(422, "Invalid", f'Pod "{name}" is invalid: {field}: {message}',
                        {"name": name, "kind": "Pod", "causes": [{"reason": "FieldValueForbidden", "field": field}]})

    old_gates, new_gates = old.get("schedulingGates") or [], new.get("schedulingGates") or []
    if any(g not in old_gates for g in new_gates):
        raise invalid("spec.schedulingGates", "Forbidden: only deletion is allowed, but found new scheduling gate")
    gated = bool(old_gates)
    old_sel, new_sel = old.get("nodeSelector") or {}, new.get("nodeSelector") or {}
    if old_sel != new_sel and not (gated and all(new_sel.get(k) == v for k, v in old_sel.items())):
        raise invalid("spec.nodeSelector", "Invalid value: only additions to spec.nodeSelector are allowed "
                      "(no mutations or deletions), and only while the pod has scheduling gates")
    old_aff, new_aff = old.get("affinity") or {}, new.get("affinity") or {}
    old_na, new_na = old_aff.get("nodeAffinity") or {}, new_aff.get("nodeAffinity") or {}
    req = "requiredDuringSchedulingIgnoredDuringExecution"
    if {k: v for k, v in old_aff.items() if k != "nodeAffinity"} != {k: v for k, v in new_aff.items() if k != "nodeAffinity"} or (not gated and old_na != new_na):
        raise invalid("spec.affinity", _POD_FORBIDDEN)
    if old_na.get(req) and old_na.get(req) != new_na.get(req):
        old_terms = old_na[req].get("nodeSelectorTerms") or []
        new_terms = (new_na.get(req) or {}).get("nodeSelectorTerms") or []
        ok = len(old_terms) == len(new_terms) and all(
            o.get("matchFields") == n.get("matchFields")
            and (n.get("matchExpressions") or [])[: len(o.get("matchExpressions") or [])] == (o.get("matchExpressions") or [])
            for o, n in zip(old_terms, new_terms, strict=True))
        if not ok:
            raise invalid(f"spec.affinity.nodeAffinity.{req}",
                          "Invalid value: only additions to matchExpressions of existing nodeSelectorTerms are allowed")
    skip = ("schedulingGates", "nodeSelector", "affinity")
    if {k: v for k, v in old.items() if k not in skip} != {k: v for k, v in new.items() if k not in skip}:
        raise invalid("spec", _POD_FORBIDDEN)


_TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def _check_node_taints(name: str, node: Obj) -> None:
    """pkg/apis/core/validation validateNodeTaints: an effect of the three, at most one taint per key and
    effect; and an empty list is dropped, as the server's `omitempty` encoding of NodeSpec.Taints does."""
    spec = node.get("spec") or {}
    taints = spec.get("taints")
    if taints == []:
        del spec["taints"]
        return
    seen: set[tuple[str, str]] = set()
    for i, taint in enumerate(taints or []):
        field = f"spec.taints[{i}]"
        if not isinstance(taint, dict) or not taint.get("key"):
            raise ApiError(422, "Invalid", f'Node "{name}" is invalid: {field}.key: Required value', {"name": name, "kind": "Node"})
        if taint.get("effect") not in _TAINT_EFFECTS:
            raise ApiError(422, "Invalid", f'Node "{name}" is invalid: {field}.effect: Unsupported value: '
                           f'{taint.get("effect")!r}', {"name": name, "kind": "Node"})
        if (taint["key"], taint["effect"]) in seen:
            raise ApiError(422, "Invalid", f'Node "{name}" is invalid: {field}: Duplicate value: taints must be unique '
                           "by key and effect pair", {"name": name, "kind": "Node"})
        seen.add((taint["key"], taint["effect"]))


# pytest helpers ---------------------------------------------------------------------------------------------------
DEPLOY = __import__("pathlib").Path(__file__).resolve().parent.parent / "deploy" / "daemonset"


def crd_schemas() -> dict[str, Obj]:
    """plural -> openAPIV3Schema of our CRDs, so the fake validates custom objects as the real server would."""
    import yaml

    schemas: dict[str, Obj] = {}
    for path in sorted(DEPLOY.glob("crd-*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                schemas[doc["spec"]["names"]["plural"]] = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schemas


def node(name: str, labels: dict[str, str] | None = None) -> Obj:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": dict(labels or {})}}


def model_cache(name: str, source: str, *, node_selector: dict[str, str] | None = None, **spec: Any) -> Obj:
    body: Obj = {"source": source, **spec}
    if node_selector is not None:
        body["nodeSelector"] = node_selector
    return {"apiVersion": "weightcache.io/v1alpha1", "kind": "ModelCache", "metadata": {"name": name}, "spec": body}
