"""The peer server: a node's verified blobs, read-only, to other weightcache daemons holding the shared token.

    HEAD /v1/blobs/sha256/<64 hex>     200 with Content-Length when the blob is published here, else 404 (with
                                       X-Weightcache-Planning: 1 while a fetch here lists and plans: it may
                                       download this blob within seconds)
    GET  /v1/blobs/sha256/<64 hex>     the body; one `Range: bytes=a-b` (or a-, -n) answers 206, else 200
    GET  /v1/engine-caches/<40 hex>    {"files": [[path, size, sha256], ...]} of an engine cache the node's admin
                                       put (docs/engine-caches.md, "Peers"), by its snapshot id; 404 for any
                                       other snapshot (a model's file list, a namespace's cache)
    HEAD, GET /v1/origin?scheme=s3&bucket=B&key=K&etag=E[&version=V]&size=N
                                       the same for an object named by its origin identity (identity.OriginId):
                                       the blob a manifest of this node records for exactly that bucket, key,
                                       ETag, version and size, or this node's download of it in flight
    POST /v1/blobs/status              body: sha256 digests (64 lowercase hex each, one a line, at most
                                       MAX_STATUS_BLOBS); {"planning": bool, "blobs": {"<hex>": [kind, size]}}:
                                       for each digest this node holds ("blob") or downloads ("partial": origin
                                       bytes of it journalled or claimed, "empty": not yet), what its HEAD would
                                       say, in one request (a fetch's round asks each peer about every blob of
                                       a model at once: docs/peers.md, "Session 54"); a digest it lacks is left out
    GET  either blob URL with ?digests=A-B,C-D (inclusive byte spans, as in Range)
                                       {"sha256": [hex or null, ...]}: the SHA-256 of each span this node holds
                                       verified (a published blob) or read from the origin itself (journalled in
                                       flight), null for a span it does not; an asker judges a peer's piece by it
                                       (docs/peers.md, "The lying peer"). At most MAX_DIGEST_SPANS spans of at most
                                       MAX_DIGEST_BYTES in all, hashed from the file on request, paced by the
                                       asker's token bucket like a body

Only `blobs/sha256/` is reachable: the digest must be 64 lowercase hex digits, and the file is opened component by
component with O_NOFOLLOW under a descriptor of the blobs directory, so a symlink planted in the store (or a
digest naming one) is refused, never followed. A blob still downloading (registered in `InFlight`) is served only
for ranges its partial file has written and journalled from the origin (never a peer's bytes relayed before they
are verified), at once and at the link's speed; other ranges answer 404 with `X-Weightcache-Partial: 1`, and with
`X-Weightcache-Not-Yet: 1` too when this node reads them from the origin now (ask again soon).
Every request needs `Authorization: Bearer <token>`, compared in constant time. Each peer (remote address) gets
at most `max_streams` bodies at once, fewer while many peers ask (their share of `stream_budget`; 429 beyond,
with Retry-After) and a token bucket of `rate_bytes_s`, so
serving never starves the node's own pods; file reads run in threads, never on the event loop. Each body says how
many this node sends now, all peers together (`X-Weightcache-Streams`): the asker judges its rate by its share.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from weightcache.download import PartialFile
from weightcache.listener import ConnectionLimits, GuardedTCPSite
from weightcache.peers.client import (
    MAX_STATUS_BLOBS,
    NOT_YET_HEADER,
    PARTIAL_HEADER,
    PLANNING_HEADER,
    RETRY_MS_HEADER,
    STATUS_PATH,
    STREAMS_HEADER,
)
from weightcache.peers.identity import OriginId, record_matches
from weightcache.peers.inflight import InFlight
from weightcache.ratelimit import BandwidthLimits, Limiter
from weightcache.store.origins import IndexReader
from weightcache.units import ascii_int

log = logging.getLogger(__name__)

BLOB_ROUTE = "/v1/blobs/sha256/{digest}"
ENGINE_CACHE_ROUTE = "/v1/engine-caches/{snapshot}"
_SNAPSHOT = re.compile(r"[0-9a-f]{40}")
ORIGIN_ROUTE = "/v1/origin"
_HEX = re.compile(r"[0-9a-f]{64}")
_RANGE = re.compile(r"bytes=([0-9]*)-([0-9]*)")  # ASCII only: \d also matches '٣', which int() reads
_SPAN = re.compile(r"([0-9]{1,19})-([0-9]{1,19})")  # one span of ?digests=, ASCII digits, below 10^19
_MAX_DIGITS = 19  # a longer number is past any blob (10^19 > 2^63): read as such, never given to int()
SEND_SLICE = 1 << 20  # bytes read and written per step: bounds memory per stream and rate-limit granularity
SERVE_SLICE = 32 << 10  # the step while the node's serving limit is set: 1 MiB is a second of a 1 MB/s uplink
WRITE_TIMEOUT_S = 30.0  # a peer that stops reading loses its stream (and its slot) after this
NOT_YET_WAIT_S = 0.3  # a request for a claimed range waits this long for its first journalled bytes, then "not yet"
POLL_S = 0.05  # how often such a request looks at the journal (while the claim has no rate to say when)
PUBLISH_WAIT_S = 3.0  # how long a stream following a finished download looks for its blob (_published)
FOLLOW_WAKE_S = 0.5  # a stream following a claim looks again at least this often (it is woken as pieces land)
# a digest request hashes at most this many spans and bytes: an asker judges one piece of a peer at a time
MAX_DIGEST_SPANS = 64
MAX_DIGEST_BYTES = 64 << 20


@dataclass(frozen=True)
class PeerLimits:
    """Per-peer serving limits; a peer is its remote address."""

    rate_bytes_s: int = 500 << 20  # token bucket refill; 0 = unlimited
    max_streams: int = 8  # bodies served to one peer at once: one fetch's workers (8) may all wait on this node
    # while many peers ask at once, each gets its share of this many streams (at least min_streams; 0: no budget):
    # a node serving 15 askers 8 streams each gave every stream 1/120 of its link, and each looked like a trickler
    stream_budget: int = 32
    min_streams: int = 2
    listener: ConnectionLimits = field(default_factory=lambda: ConnectionLimits(
        max_connections=128, header_timeout_s=10.0, body_timeout_s=10.0, idle_timeout_s=30.0, defer_accept_s=10))


@dataclass
class _Peer:
    bucket: Limiter  # bytes per second with a one-second burst (ratelimit.py)
    streams: int = 0


class _Slices:
    """The serving bucket's slices, one at a time, to the waiting stream whose rate since it began is lowest (a new
    stream first). Each stream polling the bucket on its own was a lottery: in a fleet behind 1 MB/s links a stream
    now and then went 10 s without a slice and its asker's read timed out (4 in one netns bench run at N = 16; 12
    streams on one bucket here: gaps of 1-3.6 s). In the order asked (a FIFO), a new stream waited a whole round of
    the others' slices: at N = 32, 62 streams, 2.2 s, and its asker cut it as a trickler after 1 s (574 cuts, all
    ready 3.80x). The slowest first is what the asker's watchdog judges: a stream's rate since it was asked."""

    def __init__(self) -> None:
        self._waiting: list[tuple[float, int, asyncio.Future[None]]] = []  # (stream began, bytes sent, turn)
        self._held = False

    async def take(self, bucket: Limiter, n: int, began: float, sent: int) -> None:
        """`n` bytes of `bucket` for a stream that began at `began` (monotonic) and has sent `sent` bytes."""
        if self._held:
            turn = asyncio.get_running_loop().create_future()
            self._waiting.append((began, sent, turn))
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():  # granted as it was cancelled: the next one's turn
                    self._next()
                raise
        self._held = True
        try:
            await bucket.take(n)
        finally:
            self._next()

    def _next(self) -> None:
        now = time.monotonic()  # the rates now, not as they were when each began waiting (a stream waiting long
        self._waiting = [w for w in self._waiting if not w[2].done()]  # sends nothing: its rate falls meanwhile)
        if not self._waiting:
            self._held = False
            return
        rates = [sent / max(now - began, 1e-3) for began, sent, _ in self._waiting]
        self._waiting.pop(rates.index(min(rates)))[2].set_result(None)  # held, now by that stream


class PeerServer:
    """aiohttp app serving `blobs_dir` (the store's `blobs/sha256`) to bearers of `token`."""

    def __init__(self, blobs_dir: Path, token: bytes, limits: PeerLimits | None = None,
                 inflight: InFlight | None = None, index_path: Path | None = None,
                 bandwidth: BandwidthLimits | None = None,
                 blob_missed: Callable[[str], None] = lambda digest: None) -> None:
        """`inflight`: downloads of this node whose journalled ranges may be served before they are blobs.
        `index_path`: the store's index.db, whose manifest rows map an origin identity to a blob (default: the
        one beside `blobs_dir`, root/index.db). `bandwidth`: the node's bytesPerSecond, whose `serve` bucket
        paces what this server sends to all peers together (none by default). `blob_missed`: told a digest
        asked for whose blob was not there, before its download is looked up (on an executor thread): a test
        ends the download there, the window `_open_held` looks again for."""
        self.blobs_dir = blobs_dir
        self.inflight = inflight
        self._blob_missed = blob_missed
        self.records = IndexReader(index_path or blobs_dir.parent.parent / "index.db")
        self._token = b"Bearer " + token
        self.limits = limits or PeerLimits()
        self.bandwidth = bandwidth or BandwidthLimits()
        self._slices = _Slices()  # the serving bucket's slices, to the slowest stream first
        self._peers: dict[str, _Peer] = {}
        self.bytes_served = 0
        self.app = web.Application()
        self.app.router.add_get(BLOB_ROUTE, self._blob)  # and HEAD
        self.app.router.add_get(ORIGIN_ROUTE, self._origin)  # and HEAD
        self.app.router.add_post(STATUS_PATH, self._statuses)
        self.app.router.add_get(ENGINE_CACHE_ROUTE, self._engine_cache)
        self._runner: web.AppRunner | None = None
        self.site: GuardedTCPSite | None = None  # its `stats` count the connections the listener took
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (port 0: any); returns the port. Header and body timeouts and a connection cap
        come from the daemon's guarded TCP listener."""
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False,
                                     **self.limits.listener.runner_args())
        await self._runner.setup()
        self.site = site = GuardedTCPSite(self._runner, host, port, limits=self.limits.listener)
        await site.start()
        self.port = site.port
        log.info("peer server on %s:%d serving %s", host, self.port, self.blobs_dir)
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _authorized(self, request: web.Request) -> bool:
        given = request.headers.get("Authorization", "").encode("utf-8", "replace")
        if not hmac.compare_digest(given, self._token):
            return False
        if self.inflight is not None and request.remote:  # a peer asking is up: its fetches hear of it
            # (PeerSource._is_down), and its connection: what its kernel acknowledges on it (client._Acks)
            self.inflight.asked_by(request.remote, request.transport.get_extra_info("socket")
                                   if request.transport is not None else None)
        return True

    async def _blob(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return _unauthorized()
        digest = request.match_info["digest"]
        if not _HEX.fullmatch(digest):
            return web.Response(status=400, text="a blob is named by 64 lowercase hex digits of its sha256\n")
        try:
            return await self._held_blob(request, digest)
        except _Left:  # the download it was answered from finished meanwhile: its blob now (or a plain 404)
            try:
                return await self._held_blob(request, digest)
            except _Left:  # another download of it, registered and gone within this request
                return self._lacks("blob")

    async def _held_blob(self, request: web.Request, digest: str) -> web.StreamResponse:
        """`_blob`'s answer: the published blob, else the download in flight; `_Left` when that download left
        InFlight while it was looked at."""
        if (not_yet := await self._not_yet(request, digest)) is not None:
            return not_yet
        held = self.inflight.get(digest) if self.inflight is not None else None
        if held is not None and held.journalled and "Range" not in request.headers and \
                (downloading := self._unwritten(request, digest)) is not None:
            # a HEAD of a download registered here: answered from memory, no file opened and no thread hop. Most
            # requests of a fleet starting together are these (at N = 32, 6,000 of 8,200 in a fill), and each
            # waited for a thread of the loop's executor, shared with the disk reads, on a machine already busy.
            # Not a file read in one request (unjournalled): it is written to its blob while its download stays
            # registered, and its HEAD says it holds the blob (the look on disk below)
            return downloading
        try:  # one thread hop for both: the published blob, else the download in flight
            fd, partial = await asyncio.to_thread(self._open_held, digest)
        except FileNotFoundError:
            return self._unwritten(request, digest) or self._lacks("blob")
        except OSError as exc:
            log.warning("peer request for blob %s refused: %s", digest, exc)
            return self._lacks("blob")
        try:
            return await self._send(request, fd, digest, partial)
        finally:
            os.close(fd)

    async def _statuses(self, request: web.Request) -> web.Response:
        """What a HEAD of each blob named in the body would say (`PeerClient.statuses`), in one answer: the blobs
        downloading here from `InFlight` on the event loop, the others looked for on disk in one thread hop."""
        if not self._authorized(request):
            return _unauthorized()
        length = request.content_length
        names = (await request.read()).decode("ascii", "replace").split() \
            if length is not None and length <= MAX_STATUS_BLOBS * 65 else None
        if names is None or len(names) > MAX_STATUS_BLOBS or not all(_HEX.fullmatch(n) for n in names):
            return web.Response(status=400, text=f"at most {MAX_STATUS_BLOBS} sha256 digests, 64 lowercase hex "
                                                 "digits each, one a line\n")
        answers: dict[str, list[str | int]] = {}
        look: list[str] = []
        for name in dict.fromkeys(names):
            held = self.inflight.get(name) if self.inflight is not None else None
            if held is not None and held.journalled:  # as `_unwritten`: a download registered here
                answers[name] = [self._downloading(name), held.obj.size]
            else:  # published, or a file read in one request (written to its blob while registered): on disk
                look.append(name)
        sizes = await asyncio.to_thread(self._published_sizes, look) if look else []
        for name, size in zip(look, sizes, strict=True):
            held = self.inflight.get(name) if self.inflight is not None else None
            if size is not None:
                answers[name] = ["blob", size]
            elif held is not None:
                answers[name] = [self._downloading(name), held.obj.size]
        planning = self.inflight is not None and self.inflight.is_planning()
        return web.json_response({"planning": planning, "blobs": answers})

    def _downloading(self, name: str) -> str:
        assert self.inflight is not None
        return "partial" if self.inflight.started(name) else "empty"

    def _published_sizes(self, digests: list[str]) -> list[int | None]:
        """The size of each blob published here, None for one that is not (or not a regular file)."""
        sizes: list[int | None] = []
        for digest in digests:
            try:
                fd = open_blob(self.blobs_dir, digest)
            except OSError:
                sizes.append(None)
                continue
            try:
                sizes.append(os.fstat(fd).st_size)
            finally:
                os.close(fd)
        return sizes

    def _lacks(self, what: str) -> web.Response:
        """404 for a blob this node neither holds nor downloads; "planning" while a fetch of this node has yet to
        register its downloads (InFlight.planning): the asker's fleet waits for it rather than read its share."""
        planning = self.inflight is not None and self.inflight.is_planning()
        return web.Response(status=404, headers={PLANNING_HEADER: "1"} if planning else None,
                            text=f"{what} not held by this node\n")

    def _unwritten(self, request: web.Request, name: str) -> web.Response | None:
        """The answer to a HEAD of a download registered here, its part on disk or not yet (a file read in one
        request: its worker creates the part, or the blob, when its bytes come): downloading, as `_send` answers
        one with a part; None for any other request, or no such download. A plain 404 reads as idle, and once
        their grace is over the askers read this node's share elsewhere (`PeerSource._serving_owner`). A download
        verified and published but not yet out of InFlight answers "downloading" a moment longer: its asker asks
        its ranges, served from the blob."""
        partial = self.inflight.get(name) if self.inflight is not None and request.method == "HEAD" else None
        if partial is None or self.inflight is None:
            return None
        headers = _headers(name, partial.obj.size)
        headers[PARTIAL_HEADER] = "1" if self.inflight.started(name) else "empty"
        return web.Response(status=200, headers=headers)

    def _open_held(self, digest: str) -> tuple[int, PartialFile | None]:
        """A read-only fd of the published blob, else of its download in flight (with its PartialFile);
        FileNotFoundError when neither is here (a download finished or discarded meanwhile included)."""
        try:
            return open_blob(self.blobs_dir, digest), None
        except FileNotFoundError:
            self._blob_missed(digest)
            partial = self.inflight.get(digest) if self.inflight is not None else None
            if partial is None:  # a download leaves InFlight only after its blob is published: it may have, since
                return open_blob(self.blobs_dir, digest), None  # the look above (else FileNotFoundError: neither)
        try:
            return os.open(partial.part, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), partial
        except OSError as exc:
            # the finished download became its blob since the first look (it leaves InFlight only after): a
            # 404 now would tell the asker this node is idle, and it would read this node's share elsewhere
            try:
                return open_blob(self.blobs_dir, digest), None
            except FileNotFoundError:
                raise FileNotFoundError(str(exc)) from exc

    async def _not_yet(self, request: web.Request, name: str) -> web.Response | None:
        """The answer to a GET of a blob downloading here whose asked range has nothing journalled from the origin
        yet (after the short wait of `_journalled`), given on the event loop without opening a file (no thread
        hop): most asks of a fleet filling together are these. None: go on as for any request."""
        asks_bytes = request.method == "GET" and "digests" not in request.query  # not HEAD, not digests (_send)
        partial = self.inflight.get(name) if self.inflight is not None and asks_bytes else None
        span = parse_range(request.headers.get("Range"), partial.obj.size) if partial is not None else None
        # complete: every byte written and hashed; a file read in one request is in its blob already (nothing in
        # its part's journal), so the blob is served as a HEAD says, not "missing" (an origin read for the asker)
        if partial is None or span is None or self.inflight is None or partial.complete:
            return None
        start, end, _ = span
        if await self._journalled(name, partial, start, end) > start:
            return None
        self._still_registered(name, partial)
        pending = self.inflight.pending(name, start)
        return _not_held(start, end, pending, self.inflight.eta(name, start) if pending else None)

    async def _engine_cache(self, request: web.Request) -> web.Response:
        """The file list of an admin's engine cache: the asker checks it against the snapshot id it was given
        (the tree's content digest) before it asks for a blob of it."""
        if not self._authorized(request):
            return _unauthorized()
        snapshot = request.match_info["snapshot"]
        if not _SNAPSHOT.fullmatch(snapshot):
            return web.Response(status=400, text="a snapshot is named by 40 lowercase hex digits\n")
        files = await asyncio.to_thread(self.records.engine_cache_files, snapshot)
        if files is None:
            return web.Response(status=404, text="no engine cache of the admin's with that id on this node\n")
        return web.json_response({"files": files})

    def _recorded(self, oid: OriginId) -> str | None:
        """The sha256 of the blob this node downloaded (or linked on evidence) as exactly the object `oid` names,
        from the manifests it wrote; blocking."""
        rows = self.records.files_with_etag(oid.etag, oid.size)
        return next((sha for uri, path, etag, version, size, sha in rows
                     if record_matches(oid, uri, path, etag, version, size)), None)

    async def _origin(self, request: web.Request) -> web.StreamResponse:
        """An object by its origin identity: only a blob this node's own manifests record for that identity."""
        if not self._authorized(request):
            return _unauthorized()
        oid = OriginId.from_query(request.query)
        if oid is None:
            return web.Response(status=400, text="an object is named by scheme=s3, bucket, key, etag, size and "
                                                 "optionally version\n")
        try:
            return await self._held_object(request, oid)
        except _Left:  # as in `_blob`
            try:
                return await self._held_object(request, oid)
            except _Left:
                return self._lacks("object")

    async def _held_object(self, request: web.Request, oid: OriginId) -> web.StreamResponse:
        if (not_yet := await self._not_yet(request, oid.address)) is not None:
            return not_yet
        digest = await asyncio.to_thread(self._recorded, oid)
        fd, partial = None, None
        if digest is not None:
            try:
                fd = await asyncio.to_thread(open_blob, self.blobs_dir, digest)
            except OSError:  # evicted since, or not a regular file: never followed
                fd = None
            if fd is not None and os.fstat(fd).st_size != oid.size:
                os.close(fd)
                fd = None
        name = digest or oid.address
        if fd is None:
            name = oid.address
            partial = self.inflight.get(name) if self.inflight is not None else None
            if partial is None:
                return self._lacks("object")
            try:
                fd = await asyncio.to_thread(os.open, partial.part, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:  # not written yet, or discarded meanwhile
                return self._unwritten(request, name) or self._lacks("object")
            except OSError:
                return self._lacks("object")
        try:
            return await self._send(request, fd, name, partial)
        finally:
            os.close(fd)

    async def _send(self, request: web.Request, fd: int, digest: str,
                    partial: PartialFile | None) -> web.StreamResponse:
        size = os.fstat(fd).st_size
        span = parse_range(request.headers.get("Range"), size)
        if span is None:
            return web.Response(status=416, headers={"Content-Range": f"bytes */{size}"},
                                text=f"Range starts past the end of this blob ({size} bytes): ask for bytes=FIRST-LAST "
                                     "with FIRST below the size\n")
        if request.method == "GET" and "digests" in request.query:
            return await self._digests(request, fd, digest, partial, size)
        start, end, ranged = span
        headers = _headers(digest, end - start)
        follow = None
        if partial is not None:  # a download in flight: only what it has journalled from the origin
            # "empty": nothing read from the origin yet (a node of a fleet starting together): the asker reads
            # its own ranges from the origin without asking this node for each
            assert self.inflight is not None
            headers[PARTIAL_HEADER] = "1" if self.inflight.started(digest) else "empty"
            if request.method != "HEAD":
                servable = self.inflight.origin_end(digest, partial, start, end)
                claim = self.inflight.following(digest, servable) if servable < end else None
                if claim is not None:  # streamed to the claim's end as its pieces land (_stream)
                    follow, end, ranged = partial, min(end, claim.end), True
                else:
                    servable = await self._journalled(digest, partial, start, end)
                    if servable <= start:
                        self._still_registered(digest, partial)
                        pending = self.inflight.pending(digest, start)
                        return _not_held(start, end, pending, self.inflight.eta(digest, start) if pending else None)
                    if servable < end:  # a shorter range than asked: the asker asks again for the rest
                        end, ranged = servable, True
                headers["Content-Length"] = str(end - start)
        if ranged:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        if request.method == "HEAD":
            return web.Response(status=206 if ranged else 200, headers=headers)
        return await self._stream(request, fd, digest, (start, end), web.StreamResponse(
            status=206 if ranged else 200, headers=headers), follow)

    async def _stream(self, request: web.Request, fd: int, digest: str, span: tuple[int, int],
                      resp: web.StreamResponse, follow: PartialFile | None = None) -> web.StreamResponse:
        """Send bytes [start, end) of `fd` as `resp`'s body, within the asking peer's streams and rate. `follow`:
        the download in flight whose claimed range this is, sent as its origin pieces are journalled; when they
        stop coming (the claim stalled or failed) the body ends short and the connection closes, and the asker
        takes the rest elsewhere."""
        start, end = span
        peer_key = request.remote or "?"
        peer = self._peers.setdefault(peer_key, _Peer(Limiter(self.limits.rate_bytes_s, burst_s=1.0)))
        allowed = self._streams_allowed(peer)
        if peer.streams >= allowed:
            return web.Response(status=429, headers={"Retry-After": "1"},
                                text=f"at most {allowed} streams per peer now; retry elsewhere\n")
        peer.streams += 1
        # how many bodies this node sends now, all peers together: the asker's rate floor is its share of them
        # (client.Pace.answered; a stream of a node serving 62 looked like a trickler at the floor of one)
        resp.headers[STREAMS_HEADER] = str(sum(p.streams for p in self._peers.values()))
        pos = start
        began = time.monotonic()
        blob: int | None = None  # the published blob, once the download followed became it
        try:
            if follow is not None:
                resp.force_close()  # a body that may end short is never followed by another answer
            await resp.prepare(request)
            step = min(SEND_SLICE, self.limits.rate_bytes_s or SEND_SLICE)  # the bucket paces slices, not bodies
            serve = self.bandwidth.serve
            while pos < end:
                if serve.rate:  # the node's serving limit, taken in slices that stay under its link's queue
                    step = min(step, SERVE_SLICE)
                n = min(step, end - pos)
                if follow is not None and (n := await self._landed(digest, follow, pos, pos + n)) == 0:
                    # the download ended: verified and published (the rest from the blob, at the link's speed:
                    # the owner finished before its askers, whose streams lag behind its journal), or not
                    blob = await self._published(digest)
                    if blob is None:
                        log.info("the claim of blob %s stopped at byte %d: a stream following it ends short",
                                 digest[:12], pos)
                        return resp
                    fd, follow, n = blob, None, min(step, end - pos)
                await peer.bucket.take(n)
                if serve.rate:
                    await self._slices.take(serve, n, began, pos - start)
                data = await read_at(fd, n, pos)
                if not data:
                    raise OSError(f"blob {digest} shorter than its size")  # never pad: the client sees a cut body
                async with asyncio.timeout(WRITE_TIMEOUT_S):  # a timer, not wait_for's task per slice
                    await resp.write(data)
                pos += len(data)
                self.bytes_served += len(data)
            await resp.write_eof()
            return resp
        except (ConnectionError, TimeoutError):  # the peer went away or stopped reading: its loss, not an error
            log.info("peer %s stopped reading blob %s at a stream's byte %d", peer_key, digest[:12], pos - start)
            return resp
        finally:
            peer.streams -= 1
            if blob is not None:
                os.close(blob)

    async def _digests(self, request: web.Request, fd: int, digest: str, partial: PartialFile | None,
                       size: int) -> web.Response:
        """The SHA-256 of each span asked (`?digests=A-B,...`) that this node holds on its own evidence: a
        published blob (verified before it got its name) or origin bytes of its download in flight, journalled;
        null for any other span (bytes it got from a peer are not vouched for, as they are not relayed)."""
        spans = parse_spans(request.query.get("digests", ""), size)
        if spans is None:
            return web.Response(status=400, text=f"digests=FIRST-LAST[,FIRST-LAST...]: at most {MAX_DIGEST_SPANS} "
                                                 f"spans inside the blob, {MAX_DIGEST_BYTES >> 20} MiB in all\n")
        if partial is not None:
            assert self.inflight is not None
            spans_held = [(a, b) if self.inflight.origin_end(digest, partial, a, b) >= b else None for a, b in spans]
        else:
            spans_held = list(spans)
        peer = self._peers.setdefault(request.remote or "?", _Peer(Limiter(self.limits.rate_bytes_s, burst_s=1.0)))
        await peer.bucket.take(sum(b - a for a, b in (s for s in spans_held if s is not None)))  # a disk read
        sums = await asyncio.to_thread(_hash_spans, fd, spans_held)
        return web.json_response({"sha256": sums})

    def _streams_allowed(self, peer: _Peer) -> int:
        """Streams one peer may have now: `max_streams`, fewer while many peers ask at once (their share of
        `stream_budget`, at least `min_streams`), so 15 askers get 2 fast streams each rather than 8 slow ones."""
        askers = sum(1 for p in self._peers.values() if p.streams) + (0 if peer.streams else 1)
        if not self.limits.stream_budget:
            return self.limits.max_streams
        return min(self.limits.max_streams, max(self.limits.min_streams, self.limits.stream_budget // askers))

    async def _published(self, digest: str) -> int | None:
        """A descriptor of the blob `digest` once published here, or None (never a download's, nor a link). A
        verified download leaves InFlight once its part is the blob (fetch/publish.py `durable`, Transfer
        `download`), but a stream may find its claim ended first, so it is looked for a while (PUBLISH_WAIT_S);
        one that failed never comes."""
        if not _HEX.fullmatch(digest):  # an origin identity's download: its blob is named by its digest
            return None
        deadline = time.monotonic() + PUBLISH_WAIT_S
        while True:
            try:
                return await asyncio.to_thread(open_blob, self.blobs_dir, digest)
            except OSError:
                if time.monotonic() >= deadline:
                    return None
            await asyncio.sleep(POLL_S * 2)

    async def _landed(self, digest: str, partial: PartialFile, start: int, end: int) -> int:
        """How many origin bytes from `start` (at most to `end`) are journalled, waiting for the claim bringing
        them to land its next piece; 0 once no claim brings them (stalled, failed, or the download ended)."""
        assert self.inflight is not None
        while True:
            # most slices of a relay are journalled already (a piece lands 8 slices): sent without a future
            if (got := self.inflight.origin_end(digest, partial, start, end)) > start:
                return got - start
            landing = self.inflight.watch(digest)  # before looking again: a piece landing meanwhile still wakes it
            try:
                if (got := self.inflight.origin_end(digest, partial, start, end)) > start:
                    return got - start
                if not self.inflight.pending(digest, start) or self.inflight.get(digest) is not partial:
                    return 0
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(landing, FOLLOW_WAKE_S)
            finally:
                self.inflight.unwatch(digest, landing)

    def _still_registered(self, name: str, partial: PartialFile) -> None:
        """Before a download's range is answered as not held: `_Left` when the download left InFlight since it was
        looked up. Its last bytes landed and it was verified and published meanwhile (or it was discarded): its
        journal, no longer registered, reads as holding nothing (`origin_end`), and "not downloaded yet" sent the
        asker to the origin for a range this node now holds whole (a node whose held origin read was retried and
        finished while an ask waited on its claim, `_journalled`)."""
        assert self.inflight is not None
        if self.inflight.get(name) is not partial:
            raise _Left(name)

    async def _journalled(self, digest: str, partial: PartialFile, start: int, end: int) -> int:
        """How far from `start` (at most `end`) origin bytes are journalled; when none are yet but the range is
        on its way (claimed), wait up to NOT_YET_WAIT_S for the first ones (a long poll: the asker is not made to
        ask again and again for a piece about to land)."""
        assert self.inflight is not None
        waited_since = time.monotonic()
        while (got := self.inflight.origin_end(digest, partial, start, end)) == start:
            left = NOT_YET_WAIT_S - (time.monotonic() - waited_since)
            if left <= 0 or not self.inflight.pending(digest, start) or self.inflight.get(digest) is not partial:
                break
            # a piece due after the wait is answered "not yet" now, with when (Retry-Ms): holding the request
            # only woke the loop 15 times for nothing
            if (eta := self.inflight.eta(digest, start)) is not None and eta > left:
                break
            await asyncio.sleep(min(left, max(POLL_S, eta or 0.0)))
        return got


async def read_at(fd: int, n: int, pos: int) -> bytes | memoryview:
    """Up to `n` bytes of `fd` at `pos`: on the event loop while they are in the page cache (RWF_NOWAIT: a
    stream's slices were just journalled, or read by the last asker), else in a thread, as a read that may wait on
    the disk must. The thread hop per 32 KiB slice was a quarter of a serving daemon's CPU in a fleet fill (its
    queue put and the GIL handed back and forth: 67 us against 1.4 us, py-spy --gil at N = 16; docs/peers.md)."""
    buf = bytearray(n)
    try:
        got = os.preadv(fd, [buf], pos, os.RWF_NOWAIT)
    except OSError:  # EAGAIN: not cached (or only in part); EOPNOTSUPP: a filesystem without it
        got = 0
    if got == 0:  # the end of the file, or nothing cached: the thread's read says which
        return await asyncio.to_thread(os.pread, fd, n, pos)
    return memoryview(buf)[:got]


def _headers(digest: str, length: int) -> dict[str, str]:
    """The headers of an answer with (or, to a HEAD, about) `length` bytes of a blob."""
    return {"Content-Length": str(length), "Accept-Ranges": "bytes", "ETag": f'"{digest}"',
            "Content-Type": "application/octet-stream"}


class _Left(Exception):
    """The download a request was being answered from left InFlight meanwhile (`PeerServer._still_registered`):
    the request is answered again, from what this node holds now."""


def _not_held(start: int, end: int, pending: bool, eta_s: float | None = None) -> web.Response:
    """404 with X-Weightcache-Partial; with X-Weightcache-Not-Yet too when the bytes are on their way here (a
    claim that is moving): the asker waits and asks again rather than read them from the origin itself, about
    when the claim's rate says the first piece is journalled (X-Weightcache-Retry-Ms) when it has a rate."""
    if pending:
        headers = {PARTIAL_HEADER: "1", NOT_YET_HEADER: "1"}
        if eta_s is not None:
            headers[RETRY_MS_HEADER] = str(min(int(eta_s * 1000), 999_999))
        return web.Response(status=404, headers=headers,
                            text=f"bytes {start}-{end - 1} are being fetched by this node: ask again shortly\n")
    return web.Response(status=404, headers={PARTIAL_HEADER: "1"}, text=f"bytes {start}-{end - 1} not downloaded yet\n")


def _unauthorized() -> web.Response:
    return web.Response(status=401, text="peer token required: Authorization: Bearer <peerTokenFile>\n",
                        headers={"WWW-Authenticate": 'Bearer realm="weightcache-peers"'})


def open_blob(blobs_dir: Path, digest: str) -> int:
    """A read-only fd of blobs/sha256/<2>/<digest>, each component opened with O_NOFOLLOW (a symlink anywhere
    below the blobs directory raises OSError ELOOP/ENOTDIR); only regular files."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    top = os.open(blobs_dir, flags | os.O_DIRECTORY)
    try:
        sub = os.open(digest[:2], flags | os.O_DIRECTORY, dir_fd=top)
    finally:
        os.close(top)
    try:
        fd = os.open(digest, flags | os.O_NONBLOCK, dir_fd=sub)  # NONBLOCK: a planted FIFO cannot hang us
    finally:
        os.close(sub)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"blob {digest} is not a regular file")
    return fd


def parse_range(header: str | None, size: int) -> tuple[int, int, bool] | None:
    """(start, end, ranged) for one `bytes=` range (RFC 9110 14.1.2): ranged=False, the whole body, for no or an
    unparsable Range (a server may ignore it); None when unsatisfiable (416)."""
    whole = (0, size, False)
    if header is None:
        return whole
    m = _RANGE.fullmatch(header.strip())
    if m is None or (not m[1] and not m[2]):
        return whole
    if not m[1]:  # suffix: the last n bytes
        n = _number(m[2])
        return (max(0, size - n), size, True) if n > 0 and size > 0 else None
    first = _number(m[1])
    last = _number(m[2]) if m[2] else max(first, size - 1)
    if last < first:
        return whole
    if first >= size:
        return None
    return first, min(last, size - 1) + 1, True


def parse_spans(text: str, size: int) -> list[tuple[int, int]] | None:
    """`A-B,C-D` (inclusive, ASCII digits) as [(A, B + 1), ...] inside a blob of `size` bytes; None when
    malformed, empty, past the blob, or over MAX_DIGEST_SPANS spans or MAX_DIGEST_BYTES in all."""
    parts = text.split(",", MAX_DIGEST_SPANS)
    if len(parts) > MAX_DIGEST_SPANS:
        return None
    spans, total = [], 0
    for part in parts:
        m = _SPAN.fullmatch(part)
        if m is None:
            return None
        first, last = int(m[1]), int(m[2])
        if not first <= last < size:
            return None
        total += last + 1 - first
        spans.append((first, last + 1))
    return spans if total <= MAX_DIGEST_BYTES else None


def _hash_spans(fd: int, spans: list[tuple[int, int] | None]) -> list[str | None]:
    """The SHA-256 (hex) of each span of the file, None for None; None too where the file is shorter."""
    out: list[str | None] = []
    for span in spans:
        if span is None:
            out.append(None)
            continue
        h, pos, end = hashlib.sha256(), *span
        while pos < end and (data := os.pread(fd, min(SEND_SLICE, end - pos), pos)):
            h.update(data)
            pos += len(data)
        out.append(h.hexdigest() if pos == end else None)
    return out


def _number(digits: str) -> int:
    """A Range header's ASCII digits as an int; more than _MAX_DIGITS of them as 2^64, past any blob (int() of
    4,300 digits raises, which was a 500)."""
    n = ascii_int(digits) if len(digits) <= _MAX_DIGITS else 1 << 64
    assert n is not None  # the regex admits ASCII digits only
    return n
