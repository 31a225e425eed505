"""`weightcache prefetch REF --cluster …` and `weightcache status [NAME]`: ModelCaches and per-node progress.

prefetch creates the ModelCache (or updates it: read, change the CLI's fields, replace with the read
resourceVersion, so a concurrent edit is never overwritten), then with --wait polls the selected Nodes and
their ModelCacheNode status until every node is Ready (exit 0), one is Failed (exit 1) or time runs out (exit 2).
API failures raise ClusterError with what to do next; the CLI prints it and exits non-zero.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, TextIO, TypeVar

import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException

from weightcache.errors import ClusterError
from weightcache.kube import API_VERSION, GROUP, MODELCACHE_KIND, MODELCACHENODES, MODELCACHES, VERSION
from weightcache.kube.client import status_message
from weightcache.kube.report import ModelState, from_wire
from weightcache.units import fmt_bytes
from weightcache.uri import ModelRef, model_key
from weightcache.vocabulary import CONTROLLER, MANAGED_BY, MODEL_KEY_LABEL, SIZE_BYTES_ANNOTATION

T = TypeVar("T")
EXIT_READY, EXIT_FAILED, EXIT_TIMEOUT = 0, 1, 2
_RBAC_HINT = "bind your user to the weightcache-cli ClusterRole (deploy/daemonset/rbac.yaml)"


def model_cache_name(ref: ModelRef) -> str:
    """A DNS-1123 label from the model's last path segment plus 8 hex digits of its key: stable and unique."""
    tail = [p for p in ref.prefix.split("/") if p][-1:] or [ref.bucket or "model"]
    slug = re.sub(r"[^a-z0-9-]+", "-", tail[0].lower()).strip("-")[:50].strip("-") or "model"
    return f"{slug}-{ref.key[1:9]}"


def model_cache_body(ref: ModelRef, *, name: str, node_selector: dict[str, str], tier: str,
                     allowed_namespaces: list[str], size_bytes: int | None = None,
                     signature: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"source": ref.uri, "tier": tier, "nodeSelector": dict(node_selector)}
    if signature is not None:  # prefetch --cluster --signed-by: every node checks model.sig (docs/signing.md)
        spec["signature"] = signature
    if ref.revision:
        spec["revision"] = ref.revision
    if ref.include:
        spec["include"] = list(ref.include)
    if ref.exclude:
        spec["exclude"] = list(ref.exclude)
    if allowed_namespaces:
        spec["allowedNamespaces"] = list(allowed_namespaces)
    labels = {MODEL_KEY_LABEL: model_key(ref.uri)}  # what the DRA claim admission policy matches (docs/dra.md)
    metadata: dict[str, Any] = {"name": name, "labels": labels}
    if size_bytes is not None:  # the selected files' total, listed by the CLI: what a DRA node needs free to offer it
        metadata["annotations"] = {SIZE_BYTES_ANNOTATION: str(size_bytes)}
    return {"apiVersion": API_VERSION, "kind": MODELCACHE_KIND, "metadata": metadata, "spec": spec}


def prefetch_cluster(
    api_client: kubernetes.client.ApiClient,
    ref: ModelRef,
    *,
    name: str | None,
    node_selector: dict[str, str],
    tier: str,
    allowed_namespaces: list[str],
    wait: bool,
    timeout: float,
    out: TextIO,
    json_lines: bool,
    poll_interval: float = 2.0,
    size_bytes: int | None = None,
    signature: dict[str, Any] | None = None,
) -> int:
    """Create or update the ModelCache for `ref`; with `wait`, follow every selected node to Ready or Failed.
    `size_bytes` (the selection's total as the source lists it) becomes the annotation `weightcache.io/size-bytes`."""
    custom = kubernetes.client.CustomObjectsApi(api_client)
    body = model_cache_body(ref, name=name or model_cache_name(ref), node_selector=node_selector, tier=tier,
                            allowed_namespaces=allowed_namespaces, size_bytes=size_bytes, signature=signature)
    mc, verb = _apply(custom, body)
    mc_name = mc["metadata"]["name"]
    _emit(out, json_lines, {"event": verb, "modelCache": mc_name, "source": str(ref), "nodeSelector": node_selector},
          f"modelcache/{mc_name} {verb} ({ref}, tier {tier}, nodeSelector {_selector(node_selector) or '<none>'})")
    if not wait:
        return EXIT_READY
    if not node_selector:
        _emit(out, json_lines, {"event": "done", "result": "nothing-to-wait-for"},
              "no --node-selector: the ModelCache declares the model but prefetches on no node; nothing to wait for")
        return EXIT_READY
    return _wait(api_client, mc, node_selector, timeout=timeout, out=out, json_lines=json_lines,
                 poll_interval=poll_interval)


def status(api_client: kubernetes.client.ApiClient, name: str | None, *, out: TextIO,
           output: Literal["table", "json"] = "table") -> int:
    """Print each ModelCache's per-node state (all ModelCaches, or the one named)."""
    custom = kubernetes.client.CustomObjectsApi(api_client)
    mcs = _model_caches(custom, name)
    if mcs is None:
        out.write(f"ModelCache {name!r} not found; list them with `weightcache status`\n")
        return 1
    reports = _node_reports(custom)
    core = kubernetes.client.CoreV1Api(api_client)
    result = []
    for mc in mcs:
        selector = (mc.get("spec") or {}).get("nodeSelector") or {}
        selected = _selected_nodes(core, selector) if selector else []
        named = (mc.get("spec") or {}).get("nodeNames") or []  # the placement controller's demand
        selected = sorted(set(selected) | {n for n in named if isinstance(n, str)})
        result.append((mc, _states_for(mc["metadata"]["name"], reports, selected)))
    (_status_json if output == "json" else _status_table)(out, result)
    return 0


def _model_caches(custom: kubernetes.client.CustomObjectsApi, name: str | None) -> list[dict[str, Any]] | None:
    """Every ModelCache, or the one named (None: no such ModelCache)."""
    if not name:
        listing = functools.partial(_paged, custom.list_cluster_custom_object, GROUP, VERSION, MODELCACHES)
        return list(_call("listing ModelCaches", lambda: list(listing())))
    try:
        read = functools.partial(custom.get_cluster_custom_object, GROUP, VERSION, MODELCACHES, name)
        return [_call(f"reading ModelCache {name}", read)]
    except ClusterError as exc:
        if exc.status == 404 and f'"{name}" not found' in str(exc):  # not "the server could not find the resource"
            return None
        raise


def _status_json(out: TextIO, result: list[tuple[dict[str, Any], dict[str, ModelState | None]]]) -> None:
    payload = [{"name": mc["metadata"]["name"], "spec": mc.get("spec") or {},
                "nodes": [{"node": n, **_state_json(s)} for n, s in sorted(states.items())],
                **{k: v for k, v in (mc.get("status") or {}).items() if k in ("revision", "rollout")}}
               for mc, states in result]
    out.write(json.dumps({"modelCaches": payload}, indent=2) + "\n")


def _status_table(out: TextIO, result: list[tuple[dict[str, Any], dict[str, ModelState | None]]]) -> None:
    rows = [("MODELCACHE", "NODE", "PHASE", "PROGRESS", "SNAPSHOT", "UPDATED", "MESSAGE")]
    for mc, states in result:
        shown = _shown_name(mc)
        if not states:
            rows.append((shown, "<no node selected>", "-", "-", "-", "-", ""))
        for node, state in sorted(states.items()):
            rows.append((shown, node, *_cells(state)))
        if (line := _rollout_row(mc)) is not None:
            rows.append((shown, *line))
    _table(out, rows)


# create / update --------------------------------------------------------------------------------------------------
def _apply(custom: kubernetes.client.CustomObjectsApi, body: dict[str, Any],
           attempts: int = 3) -> tuple[dict[str, Any], str]:
    name = body["metadata"]["name"]
    try:
        create = functools.partial(custom.create_cluster_custom_object, GROUP, VERSION, MODELCACHES, body)
        return _call(f"creating ModelCache {name}", create), "created"
    except ClusterError as exc:
        if exc.status != 409:
            raise
    for _ in range(attempts):  # exists: read-modify-replace with resourceVersion (optimistic concurrency)
        read = functools.partial(custom.get_cluster_custom_object, GROUP, VERSION, MODELCACHES, name)
        current = _call(f"reading ModelCache {name}", read)
        old_spec = current.get("spec") or {}
        _merge_size(current, body, same=all(old_spec.get(k) == body["spec"].get(k) for k in _SELECTION))
        spec = {k: v for k, v in old_spec.items() if k not in ("revision", "include", "exclude")}
        spec.update(body["spec"])  # the reference decides revision and globs: absent in it means none
        current["spec"] = spec
        try:
            replace = functools.partial(custom.replace_cluster_custom_object, GROUP, VERSION, MODELCACHES, name,
                                        current)
            return _call(f"updating ModelCache {name}", replace), "updated"
        except ClusterError as exc:
            if exc.status != 409:
                raise
    raise ClusterError(f"ModelCache {name} kept changing while we updated it; run the command again", status=409)


_SELECTION = ("source", "revision", "include", "exclude")


def _merge_size(current: dict[str, Any], body: dict[str, Any], *, same: bool) -> None:
    """The size annotation on update: the new one when listed; else kept only for the same selection (a size of
    other files would let a node offer a model that does not fit); other annotations are never touched."""
    size = (body["metadata"].get("annotations") or {}).get(SIZE_BYTES_ANNOTATION)
    meta = current.setdefault("metadata", {})
    annotations = dict(meta.get("annotations") or {})
    if size is not None:
        annotations[SIZE_BYTES_ANNOTATION] = size
    elif not same:
        annotations.pop(SIZE_BYTES_ANNOTATION, None)
    meta["annotations"] = annotations


# wait -------------------------------------------------------------------------------------------------------------
def _wait(api_client: kubernetes.client.ApiClient, mc: dict[str, Any], node_selector: dict[str, str], *,
          timeout: float, out: TextIO, json_lines: bool, poll_interval: float) -> int:
    custom = kubernetes.client.CustomObjectsApi(api_client)
    core = kubernetes.client.CoreV1Api(api_client)
    name, generation = mc["metadata"]["name"], mc["metadata"].get("generation")
    deadline = time.monotonic() + timeout
    shown: dict[str, tuple[Any, ...]] = {}
    while True:
        nodes = _selected_nodes(core, node_selector)
        if not nodes:
            _emit(out, json_lines, {"event": "done", "result": "no-nodes"},
                  f"no node matches {_selector(node_selector)}; label the nodes (kubectl label node NODE "
                  f"{_selector(node_selector)}) or fix --node-selector")
            return EXIT_FAILED
        reported = _states_for(name, _node_reports(custom), nodes)
        states = {n: (s if (s := reported.get(n)) and _current(s, generation) else None) for n in nodes}
        for node, state in sorted(states.items()):
            cells = _cells(state)
            if shown.get(node) != cells:
                shown[node] = cells
                _emit(out, json_lines, {"event": "progress", "node": node, **_state_json(state)},
                      f"{node:<32} {cells[0]:<9} {cells[1]:<24} {cells[4]}".rstrip())
        failed = sorted(n for n, s in states.items() if s and s.phase == "Failed")
        ready = sum(1 for s in states.values() if s and s.phase == "Ready")
        if failed:
            _emit(out, json_lines, {"event": "done", "result": "failed", "failed": failed},
                  f"failed on {', '.join(failed)}; see `weightcache status {name}` and `kubectl get events -n default`")
            return EXIT_FAILED
        if ready == len(states):
            _emit(out, json_lines, {"event": "done", "result": "ready", "nodes": len(states)},
                  f"ready on all {len(states)} node(s)")
            return EXIT_READY
        if time.monotonic() >= deadline:
            _emit(out, json_lines, {"event": "done", "result": "timeout", "ready": ready, "nodes": len(states)},
                  f"timed out after {timeout:g} s: ready on {ready} of {len(states)} node(s); "
                  f"the nodes keep fetching, follow with `weightcache status {name}`")
            return EXIT_TIMEOUT
        time.sleep(min(poll_interval, max(0.0, deadline - time.monotonic())))


def _current(state: ModelState, generation: int | None) -> bool:
    """A state answers this ModelCache version unless it names an older generation."""
    return state.observed_generation is None or generation is None or state.observed_generation >= generation


# reading ----------------------------------------------------------------------------------------------------------
def _paged(fn: Callable[..., Any], *args: Any, page: int = 500, **kwargs: Any) -> Iterator[Any]:
    """Every item of a list call, `page` at a time: dicts from CustomObjectsApi, models from CoreV1Api."""
    token = None
    while True:
        result = fn(*args, limit=page, **({"_continue": token} if token else {}), **kwargs)
        if isinstance(result, dict):
            yield from result.get("items") or []
            token = (result.get("metadata") or {}).get("continue")
        else:
            yield from result.items
            token = result.metadata._continue
        if not token:
            return


def _selected_nodes(core: kubernetes.client.CoreV1Api, selector: dict[str, str]) -> list[str]:
    nodes = _call("listing Nodes", lambda: list(_paged(core.list_node, label_selector=_selector(selector))))
    return sorted(n.metadata.name for n in nodes)


def _node_reports(custom: kubernetes.client.CustomObjectsApi) -> dict[str, dict[str, Any]]:
    listing = functools.partial(_paged, custom.list_cluster_custom_object, GROUP, VERSION, MODELCACHENODES)
    objs = _call("listing ModelCacheNodes", lambda: list(listing()))
    return {o["metadata"]["name"]: ((o.get("status") or {}).get("models") or {}) for o in objs}


def _states_for(name: str, reports: dict[str, dict[str, Any]], selected: list[str]) -> dict[str, ModelState | None]:
    """Selected nodes (None until they report) plus any other node that reports this ModelCache."""
    states: dict[str, ModelState | None] = dict.fromkeys(selected)
    for node, models in reports.items():
        if isinstance(models.get(name), dict):
            states[node] = from_wire(models[name])
    return states


# output -----------------------------------------------------------------------------------------------------------
def _shown_name(mc: dict[str, Any]) -> str:
    """The placement controller's demand names a hash: show which model pods are waiting for."""
    labels = (mc.get("metadata") or {}).get("labels") or {}
    if labels.get(MANAGED_BY) == CONTROLLER:
        return f"{mc['metadata']['name']} (pods wait: {(mc.get('spec') or {}).get('source', '')})"
    return str(mc["metadata"]["name"])


def _rollout_row(mc: dict[str, Any]) -> tuple[str, str, str, str, str, str] | None:
    """A ModelCache's revision rollout as one more row: nodes on the old revision, fetching, on the new, failed."""
    r = (mc.get("status") or {}).get("rollout")
    if not isinstance(r, dict):
        return None
    def names(key: str) -> str:
        value = r.get(key)
        return ",".join(str(n) for n in value) if isinstance(value, list) and value else "-"
    moving = f"{r.get('from') or '(latest)'} -> {r.get('to') or '(latest)'}"
    nodes = f"old {names('old')}; fetching {names('fetching')}; new {names('new')}; failed {names('failed')}"
    message = str(r.get("message") or "")
    return (f"<rollout {moving}>", str(r.get("phase") or "-"), f"{r.get('progress') or '-'} nodes", "-", "-",
            nodes + (f"; {message}" if message else ""))


def _state_json(state: ModelState | None) -> dict[str, Any]:
    if state is None:
        return {"phase": "Pending", "bytesDone": 0, "bytesTotal": 0, "message": "not reported yet"}
    return {"phase": state.phase, "bytesDone": state.bytes_done, "bytesTotal": state.bytes_total,
            "snapshot": state.snapshot, "message": state.message, "time": state.time}


def _cells(state: ModelState | None) -> tuple[str, str, str, str, str]:
    if state is None:
        return ("Pending", "-", "-", "-", "not reported yet")
    progress = "-"
    if state.bytes_total:
        pct = 100.0 * state.bytes_done / state.bytes_total
        progress = f"{fmt_bytes(state.bytes_done)}/{fmt_bytes(state.bytes_total)} {pct:.0f}%"
    return (state.phase, progress, state.snapshot[:12] or "-", state.time or "-", state.message)


def _table(out: TextIO, rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out.writelines("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n" for row in rows)


def _emit(out: TextIO, json_lines: bool, payload: dict[str, Any], text: str) -> None:
    out.write((json.dumps(payload) if json_lines else text) + "\n")
    out.flush()


def _selector(selector: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


# errors -----------------------------------------------------------------------------------------------------------
def _call(what: str, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except ApiException as exc:
        raise _translate(exc, what) from exc
    except urllib3.exceptions.HTTPError as exc:
        raise ClusterError(f"{what}: cannot reach the Kubernetes API server ({type(exc).__name__}); "
                           "check `kubectl cluster-info` and KUBECONFIG") from exc


def _translate(exc: ApiException, what: str) -> ClusterError:
    """One table from HTTP status to a message that says what to do (never the raw response: it has headers)."""
    msg = status_message(exc)
    hints = {
        401: "the kubeconfig credentials were refused; log in again (kubectl get nodes should work)",
        403: f"forbidden: {msg}; {_RBAC_HINT}",
        404: f"{msg}; if the resource type is unknown, install the CRDs: kubectl apply -f deploy/daemonset/",
        409: f"{msg}; run the command again",
        422: f"the API server rejected it: {msg}",
    }
    hint = hints.get(exc.status or 0, f"HTTP {exc.status}: {msg}")
    return ClusterError(f"{what} failed: {hint}", status=exc.status or 0)
