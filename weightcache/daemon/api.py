"""The daemon's HTTP API (aiohttp). Handlers parse, delegate to the Node, serialize; nothing else.

    PUT    /v1/models            ensure {uri, revision, include, exclude, tier, pin, namespace?}
                                 ?wait=1 -> 200 NDJSON: {"progress": {...}}* then {"snapshot": {...}} | {"error",..}
                                 else    -> 200 {"snapshot": ...} when cached, 202 {"fetching": uri, ...} otherwise
    GET    /v1/models            [SnapshotInfo...]
    GET    /v1/models/{id}       SnapshotInfo
    DELETE /v1/models/{id}       evict; 409 naming the holders (and who they are) while leased or pinned
    PUT    /v1/models/{id}/pin   pin (by "user"); DELETE: unpin
    POST   /v1/models/{id}/verify  {repair?} -> {id, damaged: [path], repaired: [{ref, snapshot}]}
    POST   /v1/evict             {to_size} -> {evicted: [id], used_bytes}: LRU eviction down to a size
    POST   /v1/gc                -> {freed, ...}: unreferenced blobs, abandoned partial downloads, and snapshots
                                     evicted for the store's floor, each counted apart (store.GcReport)
    GET    /v1/leases            {holder: snapshot id}
    POST   /v1/leases            {holder, uri | snapshot} -> {holder, snapshot, path}
    DELETE /v1/leases/{holder}   release (idempotent)
    POST   /v1/engine-caches/{name}?uri=&namespace=  body: an uncompressed tar of an engine's compile cache
                                 ({name}: vllm-0.32.0-cpu) for the cached snapshot of uri -> 201 {key, snapshot}
    GET    /v1/engine-caches/{name}?uri=&namespace=  -> {key, snapshot, path} (docs/engine-caches.md)
    POST   /v1/engine-caches/{name}/fill?uri=&snapshot=<id>  the admin's cache for that key from a peer holding
                                 snapshot <id> (the content digest put printed on that node) -> 201 like POST
    GET    /v1/engine-caches?namespace=  -> [{key, model_snapshot, domain, snapshot, last_used, leases}]: the
                                 caches that namespace is served (its own and the admin's); without it, all
    GET    /v1/status            {bandwidth: {origin, peers, sources: {key: bytes/s}, waited_seconds, live}}: the
                                 bytesPerSecond in force (0: none); `weightcache status` shows it
    GET    /healthz /readyz /metrics

Errors are `{"error": code, "message": text}`; the status is the one each error declares (weightcache/errors.py).
Over TCP every route except the probes needs `Authorization: Bearer <token>`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypedDict

from aiohttp import web

from weightcache import engine_cache, errors
from weightcache.access import Grant
from weightcache.daemon.client import error_code
from weightcache.daemon.listing import Listing, info_body, snapshot_body
from weightcache.daemon.node import Node
from weightcache.dra.states import DAMAGED, EVICTING, VERIFYING
from weightcache.fetch_queue import FetchQueue
from weightcache.jsonbody import parse_json
from weightcache.listener import install_log_rate_limits
from weightcache.progress import Progress
from weightcache.redact import redact
from weightcache.signatures import SignaturePolicy, parse_policy, recorded_policy
from weightcache.store import Snapshot, SnapshotInfo, collect, drop_damaged, verify_snapshot
from weightcache.store.holders import describe_holder
from weightcache.unixsock import SocketAccess, peer_of
from weightcache.uri import ModelRef, parse_ref
from weightcache.vocabulary import CSI_HOLDER_PREFIX

log = logging.getLogger(__name__)

NODE = web.AppKey("node", Node)
TOKEN = web.AppKey("token", bytes)  # absent: no TCP listener, nothing to check
LISTING = web.AppKey("listing", Listing)
ACCESS = web.AppKey("access", SocketAccess)

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,127}$")
HEARTBEAT_S = 10.0  # a streaming ensure sends a line at least this often (clients time out on silence)
HANGUP_CHECK_S = 1.0  # how soon a streaming ensure notices its client left (and may let the fetch go)
_PROBES = frozenset({"/healthz", "/readyz"})


class ErrorBody(TypedDict):
    error: str
    message: str


@dataclass(frozen=True)
class EnsureRequest:
    ref: ModelRef
    tier: str
    pin: bool
    namespace: str | None
    signature: SignaturePolicy | None = None  # the request's own requirement, beside the ModelCaches' (signatures.py)


def error_body(exc: BaseException) -> ErrorBody:
    if not isinstance(exc, errors.WeightcacheError):
        return {"error": "internal", "message": "internal error; the daemon log has the details"}
    return {"error": error_code(type(exc)), "message": redact(str(exc))}


def parse_ensure(body: Any) -> EnsureRequest:
    """Validate an ensure body; raises InvalidReferenceError naming the field."""
    if not isinstance(body, dict) or not isinstance(body.get("uri"), str):
        raise errors.InvalidReferenceError('body must be JSON like {"uri": "s3://models/llama-3-8b/"}')
    unknown = set(body) - {"uri", "revision", "include", "exclude", "tier", "pin", "namespace", "signature"}
    if unknown:
        raise errors.InvalidReferenceError(f"unknown fields {sorted(unknown)}; known: uri, revision, include, "
                                           "exclude, tier, pin, namespace, signature")
    globs = [body.get("include") or [], body.get("exclude") or []]
    if not all(isinstance(g, list) and all(isinstance(x, str) for x in g) for g in globs):
        raise errors.InvalidReferenceError('include and exclude are lists of globs, like ["*.safetensors"]')
    ref = parse_ref(body["uri"], revision=_opt_str(body, "revision"), include=globs[0], exclude=globs[1])
    tier = body.get("tier") or "disk"
    if tier not in ("disk", "memory"):
        raise errors.InvalidReferenceError(f"tier must be disk or memory, not {tier!r}")
    if not isinstance(body.get("pin", False), bool):
        raise errors.InvalidReferenceError("pin must be true or false")
    signature = None if body.get("signature") is None else \
        parse_policy(body["signature"], source="the request's signature")  # ConfigError: 400
    return EnsureRequest(ref, tier, body.get("pin", False), _opt_str(body, "namespace"), signature)


def _opt_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise errors.InvalidReferenceError(f"{key} must be a string")
    return value or None


def _snapshot_id(request: web.Request) -> str:
    sid = request.match_info["id"]
    if not _ID.match(sid):
        raise errors.InvalidReferenceError(f"{sid!r} is not a snapshot id; list them with GET /v1/models")
    return sid


async def _json(request: web.Request) -> Any:
    return parse_json(await request.read())


def _error(exc: BaseException) -> web.Response:
    return web.json_response(error_body(exc), status=errors.answer_for(exc).http_status)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        hint = {404: "; the routes are listed in `weightcache/daemon/api.py` (GET /v1/models, PUT /v1/models, ...)",
                405: f"; this path takes {exc.headers.get('Allow', 'other methods')}",
                413: "; a request body is at most 1 MiB"}.get(exc.status, "")
        return web.json_response({"error": exc.reason.lower().replace(" ", "_"),
                                  "message": redact(f"{request.method} {request.path[:200]}: {exc.reason}{hint}")},
                                 status=exc.status)
    except ConnectionResetError:  # the client went away (or the TCP guard cut a body that never came)
        log.debug("%s %s: the client closed the connection", request.method, request.path)
        return web.Response(status=499)
    except errors.WeightcacheError as exc:
        if exc.answer.http_status == 500:
            log.error("%s %s failed: %s", request.method, request.path, exc)
        return _error(exc)
    except Exception as exc:
        log.exception("%s %s failed", request.method, request.path)
        return _error(exc)


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Requests that came over TCP need the bearer token; those over the Unix socket a peer the socket's access
    admits (its kernel credentials: weightcache/unixsock.py), beyond the file mode that let it connect."""
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    if isinstance(sockname, (str, bytes)) and request.path not in _PROBES:
        refusal = request.app[ACCESS].refusal(peer_of(request.transport.get_extra_info("socket")))  # type: ignore[union-attr]
        if refusal is not None:
            log.warning("refused a request on the API socket: %s", refusal)
            return web.json_response({"error": error_code(errors.NotAllowedError), "message": refusal}, status=403)
    if isinstance(sockname, tuple) and request.path not in _PROBES:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip().encode()
        token = request.app.get(TOKEN)
        if token is None or not hmac.compare_digest(given, token):
            return web.json_response({"error": "unauthorized", "message": "send Authorization: Bearer <token> "
                                      "with the token from the daemon's tcp.tokenFile"}, status=401,
                                     headers={"WWW-Authenticate": "Bearer"})
    return await handler(request)


async def ensure(request: web.Request) -> web.StreamResponse:
    node = request.app[NODE]
    req = parse_ensure(await _json(request))
    grant = node.authorize(req.ref, req.namespace, signed_by=req.signature)  # the one decision (access.py)
    node.check_tier(req.tier)
    if request.query.get("wait") in ("1", "true"):
        return await _ensure_stream(request, node, req, grant)
    cached = await node.fetches.lookup(grant)
    if cached is not None:
        await node.settle(cached, tier=req.tier, pin=req.pin)
        return web.json_response({"snapshot": snapshot_body(cached)})
    node.fetches.start(grant)  # in the queue before the answer: requests keep their order, the answer its place
    _start(node, req, grant, keep=True)
    progress = node.fetches.progress(req.ref)
    return web.json_response({"fetching": str(req.ref), "progress": progress and progress.to_wire()},
                             status=202)


def _start(node: Node, req: EnsureRequest, grant: Grant, on_progress: Callable[[Progress], None] | None = None, *,
           keep: bool) -> asyncio.Task[Snapshot]:
    """The request's wait for the model's one fetch (node.fetches), as its own task. `keep`: the fetch goes on
    when this request goes away; else it stops unless another caller (CSI, reconcile, a client) wants it."""
    async def run() -> Snapshot:
        snapshot = await node.fetches.ensure(grant, progress=on_progress, keep=keep)
        await node.settle(snapshot, tier=req.tier, pin=req.pin)
        return snapshot
    return node.tasks.spawn(f"ensure {req.ref}", run())


async def _ensure_stream(request: web.Request, node: Node, req: EnsureRequest, grant: Grant) -> web.StreamResponse:
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue[Progress] = asyncio.Queue()

    def on_progress(p: Progress) -> None:  # called on the fetch's thread
        loop.call_soon_threadsafe(updates.put_nowait, p)

    task = _start(node, req, grant, on_progress, keep=False)
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    try:
        await _follow(request, response, req, task, updates)
    except ConnectionResetError:  # the client hung up (Ctrl-C): stop waiting; the queue decides the fetch's fate
        task.cancel()
        log.info("client stopped following %s; its fetch stops unless another caller wants it", req.ref)
    return response


async def _follow(request: web.Request, response: web.StreamResponse, req: EnsureRequest,
                  task: asyncio.Task[Snapshot], updates: asyncio.Queue[Progress]) -> None:
    fetches = request.app[NODE].fetches
    latest = fetches.progress(req.ref) or Progress.waiting(req.ref.uri)
    await _line(response, _progress_line(fetches, req, latest))  # says at once whether it is queued, and behind what
    last_line = time.monotonic()
    while not task.done():
        getter = asyncio.ensure_future(updates.get())
        await asyncio.wait({getter, task}, timeout=HANGUP_CHECK_S, return_when=asyncio.FIRST_COMPLETED)
        if not getter.done():
            getter.cancel()
            if task.done():
                break
            if request.transport is None or request.transport.is_closing():
                raise ConnectionResetError("the client hung up")
            queued = fetches.progress(req.ref)
            if time.monotonic() - last_line < HEARTBEAT_S and (queued is None or queued == latest):
                continue
            latest = queued or latest
        else:
            latest = getter.result()
        while not updates.empty():  # coalesce: a slow reader gets the newest state, not a backlog
            latest = updates.get_nowait()
        await _line(response, _progress_line(fetches, req, latest))  # also the heartbeat while nothing moves
        last_line = time.monotonic()
    if task.cancelled():  # the daemon is stopping
        await _line(response, {"error": "unavailable", "message": "the daemon stopped before the fetch finished; "
                               "run the command again: the download resumes where it stopped"})
    elif task.exception() is not None:
        await _line(response, dict(error_body(task.exception())))  # type: ignore[arg-type]
    else:
        await _line(response, {"snapshot": snapshot_body(task.result())})
    await response.write_eof()


def _progress_line(fetches: FetchQueue, req: EnsureRequest, progress: Progress) -> dict[str, Any]:
    """A progress line in the one wire form (Progress.to_wire); `kept`: the fetch goes on if this client leaves
    (another caller wants it)."""
    return {"progress": replace(progress, kept=fetches.kept(req.ref)).to_wire()}


async def _line(response: web.StreamResponse, value: Any) -> None:
    await response.write(json.dumps(value).encode() + b"\n")


async def list_models(request: web.Request) -> web.Response:
    body = await asyncio.to_thread(request.app[LISTING].get)
    tier = request.app[NODE].tier
    resident = {r.id: r for r in tier.resident()} if tier is not None else {}
    if resident:  # the memory tier changes without touching the store: annotate the cached listing
        models = json.loads(body)
        for m in models:
            if m["id"] in resident:
                m["memory_bytes"], m["memory_mode"] = resident[m["id"]].bytes, resident[m["id"]].mode
        body = json.dumps(models).encode()
    return web.Response(body=body, content_type="application/json")


def _render(infos: list[SnapshotInfo]) -> bytes:
    return json.dumps([info_body(i) for i in infos]).encode()


async def get_model(request: web.Request) -> web.Response:
    info = await asyncio.to_thread(_info, request.app[NODE], _snapshot_id(request))
    return web.json_response(info_body(info))


def _info(node: Node, snapshot_id: str) -> SnapshotInfo:
    node.store.get(snapshot_id)  # raises NotCachedError with the store's message
    found = next((i for i in node.store.list() if i.snapshot.id == snapshot_id), None)
    if found is None:  # evicted between the two calls
        raise errors.NotCachedError(f"snapshot {snapshot_id} is not cached; list them with GET /v1/models")
    return found


async def delete_model(request: web.Request) -> web.Response:
    node, sid = request.app[NODE], _snapshot_id(request)
    try:
        await asyncio.to_thread(_evict, node, sid)
    except errors.InUseError as exc:
        holders = sorted(h for h, s in (await asyncio.to_thread(node.store.leases)).items() if s == sid)
        held_by = [await asyncio.to_thread(describe_holder, node.store.root, h) for h in holders]
        return web.json_response({**error_body(exc), "holders": holders, "held_by": held_by}, status=409)
    node.metrics.evictions.labels("api").inc()
    return web.json_response({"evicted": sid})


async def pin_model(request: web.Request) -> web.Response:
    node, sid = request.app[NODE], _snapshot_id(request)
    await asyncio.to_thread(node.store.get, sid)  # NotCachedError naming the id
    if request.method == "PUT":
        await asyncio.to_thread(node.store.pin, sid)
        return web.json_response({"pinned": sid})
    await asyncio.to_thread(node.store.unpin, sid, by="user")
    return web.json_response({"unpinned": sid})


async def verify_model(request: web.Request) -> web.Response:
    """Re-hash a snapshot (blocking reads on a thread); `repair` drops damaged files and fetches them again
    through the node's fetch queue."""
    node, sid = request.app[NODE], _snapshot_id(request)
    body = parse_json(await request.read() or b"{}", example='{"repair": true}')
    repair = body.get("repair", False) if isinstance(body, dict) else None
    if not isinstance(repair, bool):
        raise errors.InvalidReferenceError('send {"repair": true} or {"repair": false}')
    snapshot = await asyncio.to_thread(node.store.get, sid)
    with node.device_states.marking(sid, VERIFYING):  # its DRA devices are tainted while the bytes are re-read
        damaged = await asyncio.to_thread(verify_snapshot, node.store, sid)
        if damaged:
            node.device_states.mark(sid, DAMAGED)  # stays until repaired or evicted (docs/dra.md, "Device taints")
    repaired = []
    if damaged and repair:
        # the requirement it was published under, read before the drop removes its manifest (docs/signing.md)
        signed_by = recorded_policy(await asyncio.to_thread(node.store.signature, sid), sid)
        refs = await asyncio.to_thread(drop_damaged, node.store, sid, damaged) or [snapshot.uri]
        # the damaged copy is gone (its devices leave the slice): a refetch, now or later, is whole, and must not
        # come back under the DAMAGED taint (NoExecute) even where this refetch fails
        node.device_states.clear(sid)
        for text in refs:
            try:
                fresh = await node.fetches.ensure(node.authorize(parse_ref(text), None, signed_by=signed_by),
                                                  keep=True)
            except errors.WeightcacheError as exc:  # the snapshot is gone: say so (same class: same status)
                exc.args = (f"snapshot {sid[:12]} of {text} was damaged and has been removed, and refetching it "
                            f"failed: {exc}. The model is no longer cached; run `weightcache prefetch {text}` once "
                            "the source answers",)
                raise
            repaired.append({"ref": text, "snapshot": fresh.id})
    checks = await asyncio.to_thread(node.store.source_checks, sid)
    signature = await asyncio.to_thread(node.store.signature, sid)
    return web.json_response({"id": sid, "uri": snapshot.uri, "files": len(snapshot.files), "damaged": damaged,
                              "repaired": repaired, "source_checks": checks, "signature": signature})


async def evict_to(request: web.Request) -> web.Response:
    node, body = request.app[NODE], parse_json(await request.read(), example='{"to_size": 200000000000}')
    size = body.get("to_size") if isinstance(body, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise errors.InvalidReferenceError('to_size is a number of bytes, as in {"to_size": 200000000000}')
    evicted = await asyncio.to_thread(node.store.evict_to, size)
    node.metrics.evictions.labels("api").inc(len(evicted))
    return web.json_response({"evicted": list(evicted), "used_bytes": await asyncio.to_thread(node.store.used_bytes)})


async def gc(request: web.Request) -> web.Response:
    node = request.app[NODE]
    report = await asyncio.to_thread(collect, node.store)
    node.metrics.evictions.labels("budget").inc(len(report.evicted))
    return web.json_response({**report.body(), "freed": report.freed_bytes})


def _evict(node: Node, snapshot_id: str) -> None:
    with node.device_states.marking(snapshot_id, EVICTING):  # its DRA devices are tainted until they leave the slice
        _evict_now(node, snapshot_id)


def _evict_now(node: Node, snapshot_id: str) -> None:
    if node.tier is not None and node.tier.path_for(snapshot_id) is not None:
        if snapshot_id in node.store.leases().values():
            node.store.evict(snapshot_id)  # raises InUseError naming the holders before anything is demoted
        node.tier.demote(snapshot_id)
    node.store.evict(snapshot_id)


async def list_leases(request: web.Request) -> web.Response:
    return web.json_response(await asyncio.to_thread(request.app[NODE].store.leases))


async def take_lease(request: web.Request) -> web.Response:
    node, body = request.app[NODE], await _json(request)
    holder = body.get("holder") if isinstance(body, dict) else None
    if not isinstance(holder, str) or not _ID.match(holder):
        raise errors.InvalidReferenceError('holder must be an id of letters, digits, ".", "_" or "-", '
                                           'as in {"holder": "pod-1234", "uri": "s3://models/llama/"}')
    snapshot: Snapshot | None
    if isinstance(body.get("snapshot"), str):
        snapshot = await asyncio.to_thread(node.store.get, body["snapshot"])
    else:
        req = parse_ensure({k: v for k, v in body.items() if k in ("uri", "revision", "include", "exclude")})
        snapshot = await node.fetches.lookup(node.authorize(req.ref, None))
        if snapshot is None:
            raise errors.NotCachedError(f"{req.ref} is not cached on this node; ensure it first "
                                        f"(weightcache prefetch {req.ref})")
    await asyncio.to_thread(node.store.lease, holder, snapshot.id)
    return web.json_response({"holder": holder, "snapshot": snapshot.id, "path": str(snapshot.path)})


async def release_lease(request: web.Request) -> web.Response:
    holder, node = request.match_info["holder"], request.app[NODE]
    if holder.startswith(CSI_HOLDER_PREFIX):  # a mounted pod's model: only the CSI plugin's unpublish lets it go
        who = await asyncio.to_thread(describe_holder, node.store.root, holder)
        raise errors.InUseError(f"lease {holder} belongs to the CSI plugin: it keeps the model of {who} from being "
                                "evicted while mounted; delete the pod (kubelet unpublishes the volume) instead")
    if not _ID.match(holder):
        raise errors.InvalidReferenceError(f"{holder[:130]!r} is not a lease holder; holders are letters, digits, "
                                           "'.', '_' or '-' (list them with GET /v1/leases)")
    await asyncio.to_thread(node.store.release, holder)
    return web.json_response({"released": holder})


async def _engine_cache_model(request: web.Request) -> tuple[engine_cache.EngineName, Grant, Snapshot]:
    """The declared engine, the requester's Grant for the model (the node's Authority) and the cached snapshot
    of it this node serves: the key is computed from these, never taken from the artifact."""
    node, q = request.app[NODE], request.query
    name = engine_cache.EngineName.parse(request.match_info["name"])
    req = parse_ensure({"uri": q.get("uri"), "revision": q.get("revision"), "include": q.getall("include", []),
                        "exclude": q.getall("exclude", []), "namespace": q.get("namespace")})
    grant = node.authorize(req.ref, req.namespace)  # the one decision (weightcache/access.py)
    model = await node.fetches.lookup(grant)
    if model is None:
        raise errors.NotCachedError(f"{req.ref} is not cached on this node; an engine cache is kept only for a "
                                    "model snapshot this node serves (ensure the model first)")
    return name, grant, model


async def put_engine_cache(request: web.Request) -> web.Response:
    node = request.app[NODE]
    name, grant, model = await _engine_cache_model(request)
    key = engine_cache.EngineCacheKey.for_model(model, name, grant.who)
    limits = node.settings.store.engine_limits
    pipe = engine_cache.Pipe(engine_cache.body_limit(limits))

    def ingest() -> Snapshot:
        try:
            return engine_cache.ingest_tar(node.store, key, pipe, limits)
        finally:
            pipe.close()  # a refusal mid-body: the feeder stops at once
    task = asyncio.ensure_future(asyncio.to_thread(ingest))
    try:
        async for chunk in request.content.iter_chunked(1 << 20):
            if task.done():
                break
            await asyncio.to_thread(pipe.feed, chunk)
        pipe.close()
    except BaseException as exc:
        pipe.close(exc if isinstance(exc, errors.WeightcacheError) else ConnectionResetError("the body stopped"))
        await asyncio.wait({task})
        raise
    snapshot = await task
    return web.json_response({"key": str(name), "model_snapshot": model.id, "domain": key.domain,
                              "snapshot": snapshot_body(snapshot)}, status=201)


async def fill_engine_cache(request: web.Request) -> web.Response:
    node = request.app[NODE]
    if request.query.get("namespace"):
        raise errors.InvalidRequestError("namespace", "a namespace's engine caches stay on the node it handed "
                                         "them to; only the admin's are filled from peers (leave namespace out)")
    name, grant, model = await _engine_cache_model(request)
    peers = node.fetcher.peers
    if peers is None or not peers.clients:
        raise errors.ConfigError("this node has no peers (peerTokenFile and peers, docs/peers.md); put the cache "
                                 "here instead (weightcache engine-cache put)")
    key = engine_cache.EngineCacheKey.for_model(model, name, grant.who)
    snapshot = await asyncio.to_thread(engine_cache.fill_from_peers, node.store, key,
                                       request.query.get("snapshot", ""), list(peers.clients),
                                       node.settings.store.engine_limits)
    return web.json_response({"key": str(name), "model_snapshot": model.id, "domain": key.domain,
                              "snapshot": snapshot_body(snapshot)}, status=201)


async def get_engine_cache(request: web.Request) -> web.Response:
    node = request.app[NODE]
    name, grant, model = await _engine_cache_model(request)
    found = await asyncio.to_thread(engine_cache.lookup, node.store, model, name, grant.who)
    if found is None:
        raise errors.NotCachedError(f"no engine cache {name} for snapshot {model.id[:12]} that {grant.who} may "
                                    "read on this node; the engine compiles on its first start, then hand its "
                                    "cache over with POST /v1/engine-caches/{name}")
    return web.json_response({"key": str(name), "model_snapshot": model.id, "snapshot": snapshot_body(found),
                              "path": str(found.path)})


async def list_engine_caches(request: web.Request) -> web.Response:
    node = request.app[NODE]
    who = engine_cache.lister(request.query.get("namespace") or None)

    def listed() -> list[dict[str, Any]]:
        out = []
        for info in node.store.list():
            key = engine_cache.key_of(info.snapshot)
            if key is not None and engine_cache.visible_to(key, who):
                out.append({"key": str(key.name), "model_snapshot": key.model_snapshot, "domain": key.domain,
                            "snapshot": snapshot_body(info.snapshot), "last_used": info.last_used,
                            "leases": list(info.leases)})
        return out
    return web.json_response(await asyncio.to_thread(listed))


async def status(request: web.Request) -> web.Response:
    """What the daemon enforces now that no other answer says: its bandwidth limits (bytesPerSecond, the buckets'
    rates and the seconds workers waited on them; `live`: a config reload changes them without a restart)."""
    from weightcache.daemon.config import KEYS

    bandwidth = request.app[NODE].bandwidth.status()
    return web.json_response({"bandwidth": {**bandwidth, "live": KEYS["bytesPerSecond"][2].live}})


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def readyz(request: web.Request) -> web.Response:
    checks = request.app[NODE].ready()
    ready = all(checks.values())
    return web.json_response({"ready": ready, "checks": checks}, status=200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    body = await asyncio.to_thread(request.app[NODE].metrics.exposition)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def make_app(node: Node, *, token: bytes | None = None, access: SocketAccess | None = None) -> web.Application:
    """`access`: who may use the Unix socket (default: root and this process's uid)."""
    app = web.Application(middlewares=[_errors, _auth], client_max_size=1 << 20)
    app[NODE] = node
    app[ACCESS] = access or SocketAccess.configured(None)
    install_log_rate_limits()  # a process refused in a loop costs a few log lines, not megabytes
    app[LISTING] = Listing(node.store, _render)
    if token is not None:
        app[TOKEN] = token
    app.router.add_put("/v1/models", ensure)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{id}", get_model)
    app.router.add_delete("/v1/models/{id}", delete_model)
    app.router.add_put("/v1/models/{id}/pin", pin_model)
    app.router.add_delete("/v1/models/{id}/pin", pin_model)
    app.router.add_post("/v1/models/{id}/verify", verify_model)
    app.router.add_post("/v1/evict", evict_to)
    app.router.add_post("/v1/gc", gc)
    app.router.add_get("/v1/leases", list_leases)
    app.router.add_post("/v1/leases", take_lease)
    app.router.add_delete("/v1/leases/{holder}", release_lease)
    app.router.add_post("/v1/engine-caches/{name}", put_engine_cache)
    app.router.add_get("/v1/engine-caches/{name}", get_engine_cache)
    app.router.add_get("/v1/engine-caches", list_engine_caches)
    app.router.add_post("/v1/engine-caches/{name}/fill", fill_engine_cache)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app
