"""Talking to one peer's blob server: does it hold a blob (HEAD), and a ranged body of it (GET).

A peer is untrusted like an origin: it may lie about holding a blob, send other bytes, stall or vanish. The
client only reports what the peer said; `weightcache/peers/source.py` decides what to believe (every byte is
hashed, every blob verified against the origin's evidence before publish).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import http.client
import logging
import queue
import re
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit

import urllib3

from weightcache.errors import Answer, ConfigError, InvalidRequestError, SourceError
from weightcache.jsonbody import parse_json
from weightcache.peers.identity import OriginId
from weightcache.peers.inflight import TcpConnection
from weightcache.redact import redact
from weightcache.retry import Retryable
from weightcache.sources.http import NETWORK_ERRORS, read_capped

log = logging.getLogger(__name__)

#: What a peer is asked for: a blob by its sha256 (trusted evidence), or an object by its origin identity
Blob = str | OriginId
# ASCII digits, at most 19 (below 2^63): a peer's header is untrusted, and int() of 4,300 digits raises
_CONTENT_RANGE = re.compile(r"bytes ([0-9]{1,19})-([0-9]{1,19})/[0-9]{1,19}")
PARTIAL_HEADER = "X-Weightcache-Partial"  # set on answers about a blob still being downloaded
NOT_YET_HEADER = "X-Weightcache-Not-Yet"  # beside it on a 404: the peer is reading those bytes from the origin now
RETRY_MS_HEADER = "X-Weightcache-Retry-Ms"  # beside that: when the peer expects the first of them journalled
# on a 404 for a blob the peer lacks: a fetch of its is listing and planning now (it may be of this blob)
PLANNING_HEADER = "X-Weightcache-Planning"
STATUS_PATH = "/v1/blobs/status"  # many blobs' HEADs in one request (PeerClient.statuses, server._statuses)
MAX_STATUS_BLOBS = 4096  # blobs in one statuses request, at most: 64 hex digits and a newline each (server: 400)
_KINDS = ("blob", "partial", "empty")
STREAMS_HEADER = "X-Weightcache-Streams"  # on a body: how many bodies the peer sends now, all askers (Pace.answered)
_STREAMS = re.compile(r"[0-9]{1,6}")
JSON = "application/json"  # the media type of a ?digests= answer (server.PeerServer._digests: json_response)
_RETRY_MS = re.compile(r"[0-9]{1,6}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_SHORT = re.compile(r"[0-9]{1,3}|[0-3][0-9]{3}")  # a Content-Length below 4,000


class PeerRangeMissing(SourceError):
    """The peer is still downloading the blob and lacks the bytes asked for (404 to a range of a blob it said
    it had): ask the next source, without counting it against the peer."""
    answer = Answer(6, 502, "UNAVAILABLE")  # handled inside a fetch; this is what shows if one ever escapes


class PeerBlobGone(PeerRangeMissing):
    """The peer answers 404 for a blob it said it held: evicted since, or the download it served in flight is
    being moved to its blob (a window of a syncfs). No fault: ask it again later, as one that lacked the blob."""
    answer = Answer(6, 502, "UNAVAILABLE")  # handled inside a fetch; this is what shows if one ever escapes


class PeerRangePending(PeerRangeMissing):
    """The peer is reading these bytes from the origin now (404 with X-Weightcache-Not-Yet): wait and ask again,
    rather than read them from the origin a second time; `retry_s`: when the peer expects them (untrusted: the
    asker bounds it), None when it did not say."""
    answer = Answer(6, 502, "UNAVAILABLE")  # handled inside a fetch; this is what shows if one ever escapes

    def __init__(self, message: str, retry_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_s = retry_s


class PeerBusy(PeerRangeMissing):
    """The peer serves this node as many streams as it allows (429): ask again shortly or elsewhere, no fault."""
    answer = Answer(6, 502, "UNAVAILABLE")  # handled inside a fetch; this is what shows if one ever escapes


class PeerTooSlow(SourceError):
    """The peer sent a range below the rate floor (`Pace`): the rest comes from elsewhere, and this fetch leaves
    that peer out for a while, longer each time (source.BENCH_S)."""
    answer = Answer(6, 502, "UNAVAILABLE")  # handled inside a fetch; this is what shows if one ever escapes


class PeerBadAnswer(SourceError):
    """The peer answered a digest request with something that is not one (not JSON of the asked shape, over its
    size bound): an offence of the peer's, never a crash of the asker's."""
    answer = Answer(6, 502, "UNAVAILABLE")  # handled inside a fetch; this is what shows if one ever escapes


class PeerLied(SourceError):
    """A piece the peer sent was judged wrong before it was used (source.PeerSource._judged): it is banned, and
    the rest of its range comes from elsewhere."""
    answer = Answer(6, 502, "UNAVAILABLE")  # handled inside a fetch; this is what shows if one ever escapes


class PeerUnreachable(SourceError):
    """The peer did not answer (refused, timed out, reset). `timed_out`: nothing came back at all (no refusal, no
    reset): its link may be cut for a while, or it may be gone (source.PeerSource._asks). `probed`: the silence
    probe's verdict (silent, and no connect answered within as long as answers take): it is down, confirmed."""
    answer = Answer(6, 502, "UNAVAILABLE")  # handled inside a fetch; this is what shows if one ever escapes

    def __init__(self, message: str, timed_out: bool = False, probed: bool = False) -> None:
        super().__init__(message)
        self.timed_out, self.probed = timed_out, probed


class PeerDown(PeerUnreachable):
    """A request ended by a verdict that its peer is down, reached while it waited (`Pace.cut`, `down`): no failure
    of its own, nor a sign of this node's link; the verdict's consequences are drawn where it was reached
    (source.PeerSource._went_down)."""
    answer = Answer(6, 502, "UNAVAILABLE")  # handled inside a fetch; this is what shows if one ever escapes


def connect_timed_out(exc: BaseException | None) -> bool:
    """`exc`, or an error it was raised from, is a connect that timed out (no handshake completed)."""
    while exc is not None:
        if isinstance(exc, urllib3.exceptions.ConnectTimeoutError) and \
                not isinstance(exc, urllib3.exceptions.NewConnectionError):
            return True
        exc = exc.__cause__
    return False


def refused(exc: BaseException | None) -> bool:
    """`exc`, or an error it was raised from, is a connect the peer's host refused (ECONNREFUSED: its RST to this
    node's SYN): an answer from its side, never a sign of this node's link. A connect that could not be routed
    (ENETUNREACH, EHOSTUNREACH) is no refusal: this node's own interface or gateway may be what is gone."""
    while exc is not None:
        if isinstance(exc, ConnectionRefusedError):
            return True
        exc = exc.__cause__
    return False


def _timed_out(exc: BaseException) -> bool:
    """A connect or a read that timed out: no refusal, no reset (urllib3's NewConnectionError, a refused or
    unroutable connect, subclasses its ConnectTimeoutError)."""
    return isinstance(exc, urllib3.exceptions.TimeoutError | TimeoutError) and \
        not isinstance(exc, urllib3.exceptions.NewConnectionError)


def peer_base_url(url: str) -> str:
    """`http(s)://host:port` of a configured peer, without path, query or userinfo; ConfigError otherwise."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.password:
        raise ConfigError(f"peer {redact(url)!r}: expected http(s)://HOST:PORT (no userinfo: the token comes "
                          "from peerTokenFile)")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"peer {url!r}: expected http(s)://HOST:PORT with no path")
    try:
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"peer {url!r}: {exc}") from exc
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port else "")


class PeerClient:
    """One peer's blob endpoint; thread-safe (urllib3 pool)."""

    def __init__(self, url: str, token: bytes, *, connect_timeout: float, read_timeout: float,
                 pool_size: int = 8, ca_certs: str | None = None) -> None:
        self.url = peer_base_url(url)
        self._connect_timeout, self._read_timeout = connect_timeout, read_timeout
        self._auth = {"Authorization": "Bearer " + token.decode("ascii", "replace")}
        self._pool = urllib3.PoolManager(maxsize=pool_size, retries=False, ca_certs=ca_certs,
                                         timeout=urllib3.Timeout(connect=connect_timeout, read=read_timeout))
        self._pool.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}  # a Pace sees the socket

    def __repr__(self) -> str:
        return f"PeerClient({self.url})"

    @property
    def address(self) -> tuple[str, int]:
        """The peer's host and port (a TCP connect probes it: _Watchdog._probe)."""
        parts = urlsplit(self.url)
        return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)

    def blob_url(self, blob: Blob) -> str:
        if isinstance(blob, OriginId):  # the peer maps it to a blob from records of its own downloads only
            return f"{self.url}/v1/origin?{urlencode(blob.query())}"
        return f"{self.url}/v1/blobs/sha256/{blob}"

    def holds(self, sha256: Blob, size: int) -> bool:
        """The peer says it has the blob, with the size the origin lists (a different size: not the same blob,
        so no point asking). Refusals read as 'no'; PeerUnreachable when the peer cannot be reached."""
        return self.probe(sha256, size) in ("blob", "partial", "empty")

    def _timeout(self, connect_s: float | None, read_s: float | None = None) -> urllib3.Timeout:
        """The client's timeouts, its connect's at most `connect_s` and its read's at most `read_s` (None: as
        configured)."""
        connect = self._connect_timeout if connect_s is None else min(connect_s, self._connect_timeout)
        read = self._read_timeout if read_s is None else min(read_s, self._read_timeout)
        return urllib3.Timeout(connect=connect, read=read)

    def probe(self, sha256: Blob, size: int, connect_s: float | None = None, read_s: float | None = None,
              pace: Pace | None = None) -> str | None:
        """"blob" (published there), "partial" (downloading it now), "empty" (downloading it, nothing read from
        the origin yet), "planning" (lacks it, and a fetch of its has yet to register its downloads: it may be
        about to download it) or None (neither, or another size). `connect_s`, `read_s`: shorter timeouts.
        `pace`: `Pace.cut` (`down`) ends the HEAD, its connect included: a verdict that the peer is down
        (source.PeerSource._went_down); PeerDown then."""
        resp = self._asked("HEAD", self.blob_url(sha256), pace, "HEAD", headers=self._auth,
                           timeout=self._timeout(connect_s, read_s))
        if pace is not None and pace.was_cut:
            resp.close()
        else:
            resp.read()  # nothing: a HEAD's answer has no body; read, its connection is the pool's again
            resp.release_conn()
        if resp.status == 401:
            log.warning("peer %s refuses our token (401): the daemons' peerTokenFile must hold the same token",
                        self.url)
        if resp.status == 404 and resp.headers.get(PLANNING_HEADER) == "1":
            return "planning"
        if resp.status != 200 or resp.headers.get("Content-Length") != str(size):
            return None
        partial = resp.headers.get(PARTIAL_HEADER)
        return "blob" if not partial else "empty" if partial == "empty" else "partial"

    def _asked(self, method: str, url: str, pace: Pace | None, what: str, **kwargs: Any) -> Any:
        """A short request's answer, its body unread: PeerUnreachable when the peer cannot be reached, PeerDown
        when `pace` was cut (`down`: a verdict that the peer is down ended it, its connect included). The Pace is
        finished before this returns: a verdict never shuts down a connection that is the pool's again."""
        _asking.pace = pace
        try:
            resp = self._request(method, url, preload_content=False, redirect=False, **kwargs)
        except NETWORK_ERRORS as exc:
            if pace is not None and pace.down:
                raise PeerDown(f"peer {self.url} found down while asked ({what})") from exc
            raise PeerUnreachable(f"peer {self.url} unreachable: {type(exc).__name__}", _timed_out(exc)) from exc
        finally:
            _asking.pace = None
        if pace is not None:
            pace.finish()
        return resp

    def statuses(self, blobs: dict[str, int], connect_s: float | None = None, read_s: float | None = None,
                 pace: Pace | None = None) -> dict[str, str | None] | None:
        """What `probe` says of each blob (sha256 -> its size), in one request (server `_statuses`): None when the
        peer answers no such request (a daemon of a release before it: ask it per blob). Untrusted: only the blobs
        asked are read from the answer, a kind outside `probe`'s or a size not the one asked reads as None (as a
        HEAD with another size), and an answer over its bound (about 100 bytes a blob), not JSON or not of that
        shape reads as None for every blob (PeerBadAnswer is not raised: a round asks on); PeerUnreachable when the
        peer cannot be reached. `pace`: as `probe`'s (a verdict that the peer is down ends it: PeerDown)."""
        resp = self._asked("POST", self.url + STATUS_PATH, pace, "statuses", body="\n".join(blobs).encode("ascii"),
                           headers={**self._auth, "Content-Type": "text/plain"},
                           timeout=self._timeout(connect_s, read_s))
        if pace is not None and pace.was_cut:  # the verdict came with its answer's head: its body is not read
            resp.close()
            raise PeerDown(f"peer {self.url} found down while asked (statuses)")
        none: dict[str, str | None] = dict.fromkeys(blobs)
        if resp.status in (400, 404, 405):  # no such route there (or another form of it): its HEADs say
            _reuse(resp, None)
            return None
        if resp.status != 200 or resp.headers.get("Content-Type", "").partition(";")[0].strip() != JSON:
            if resp.status == 401:
                log.warning("peer %s refuses our token (401): the daemons' peerTokenFile must hold the same token",
                            self.url)
            _reuse(resp, None)
            return none
        limit = 64 + 100 * len(blobs)  # "<64 hex>": ["partial", <19 digits>], per blob
        try:
            body: bytes = resp.read(limit + 1, decode_content=True)
        except NETWORK_ERRORS as exc:
            resp.close()
            raise PeerUnreachable(f"{type(exc).__name__} reading peer {self.url}'s blob statuses") from exc
        if len(body) > limit:  # the rest unread: its connection is not the pool's again
            resp.close()
        else:
            resp.release_conn()
        try:
            value = parse_json(body, what=f"peer {self.url}'s blob statuses") if len(body) <= limit else None
        except InvalidRequestError:
            value = None
        answers = value.get("blobs") if isinstance(value, dict) else None
        planning = value.get("planning") if isinstance(value, dict) else None
        if not isinstance(answers, dict) or not isinstance(planning, bool):
            log.warning("peer %s answered blob statuses that are not {\"planning\": bool, \"blobs\": {...}} "
                        "within %d bytes: read as holding none", self.url, limit)
            return none
        for sha256, size in blobs.items():
            said = answers.get(sha256)
            if said is None:
                none[sha256] = "planning" if planning else None
            elif isinstance(said, list) and len(said) == 2 and said[0] in _KINDS and type(said[1]) is int \
                    and said[1] == size:
                none[sha256] = said[0]
        return none

    def open_range(self, sha256: Blob, pos: int, end: int) -> Any:
        """GET bytes [pos, end) of a blob: the checked response, body unread; Retryable for anything else."""
        resp, served = self.open_span(sha256, pos, end)
        if served != end:
            resp.close()
            raise Retryable(f"peer {self.url} answered bytes {pos}-{served - 1} to bytes {pos}-{end - 1}")
        return resp

    def open_span(self, sha256: Blob, pos: int, end: int, pace: Pace | None = None,
                  connect_s: float | None = None) -> tuple[Any, int]:
        """GET bytes [pos, end) of a blob; a peer still downloading it may answer a shorter span [pos, served):
        (the checked response with its body unread, served). `pace`: the watchdog may cut this request's
        connection, headers included, when it falls below its rate floor (not while it connects: `connect_s`,
        a shorter connect timeout, bounds that)."""
        headers = {**self._auth, "Range": f"bytes={pos}-{end - 1}", "Accept-Encoding": "identity"}
        _asking.pace = pace
        try:
            resp = self._request("GET", self.blob_url(sha256), headers=headers, preload_content=False,
                                 redirect=False, timeout=self._timeout(connect_s))
        except NETWORK_ERRORS as exc:
            raise Retryable(f"{type(exc).__name__} from peer {self.url}") from exc
        finally:
            _asking.pace = None
        if pace is not None:
            pace.answered(streams_of(resp), resp)
        if resp.status in (404, 429):  # answers, not faults: the connection serves the next ask (no handshake)
            _reuse(resp, pace)
        if resp.status == 404 and not resp.headers.get(PARTIAL_HEADER):
            # it held the blob (HEAD) and has it no more, or is moving its finished download to it
            raise PeerBlobGone(f"peer {self.url} does not hold the blob now")
        if resp.status == 404:
            if resp.headers.get(NOT_YET_HEADER):
                retry = _RETRY_MS.fullmatch(resp.headers.get(RETRY_MS_HEADER, ""))
                raise PeerRangePending(f"peer {self.url} is fetching bytes {pos}-{end - 1} from the origin now",
                                       int(retry[0]) / 1000 if retry else None)
            raise PeerRangeMissing(f"peer {self.url} has not downloaded bytes {pos}-{end - 1} yet")
        if resp.status == 429:
            raise PeerBusy(f"peer {self.url} is serving us all the streams it allows")
        if resp.status == 408:
            # its listener, at its connection cap, shed this connection for a new one's slot before it had read
            # our request (listener `_close`, "shed"). Still needed: a listener closes connections idle between
            # requests first, without a word (then `_request` sends the ask again), but with none idle it sheds
            # the connection waiting longest for its request, and in a burst of connects that is a new one whose
            # request sits unread in its socket (the 408s of the N = 16 bench at the fill's start; a peer of a
            # release before session 55 never closed idle ones and sent these more often). A busy peer, not a
            # failed one: as a fault it was taken for down, its ranges handed on, and the node that asked finished
            # 2 s after the rest
            resp.close()
            raise PeerBusy(f"peer {self.url} shed our connection (408): it holds all the connections it allows")
        if resp.status != 206:
            resp.close()
            raise Retryable(f"peer {self.url} answered HTTP {resp.status} to bytes {pos}-{end - 1}")
        m = _CONTENT_RANGE.fullmatch(resp.headers.get("Content-Range", ""))
        if m is None or int(m[1]) != pos or not pos <= int(m[2]) < end:
            # a 206 for bytes not asked (or none a number holds) is no fault of the network: our server answers
            # the range asked or its head (server `_stream`). An offence, so the range goes on without it at once
            # rather than asking it again until the range's wait (PENDING_S) runs out
            resp.close()
            raise PeerBadAnswer(f"peer {self.url} answered bytes {pos}-{end - 1} with a Content-Range of other bytes")
        if isinstance(resp, urllib3.HTTPResponse):
            resp.enforce_content_length = False  # a short body returns what came: the caller resumes elsewhere
        return resp, int(m[2]) + 1

    def piece_digests(self, blob: Blob, spans: list[tuple[int, int]]) -> list[bytes | None]:
        """The peer's SHA-256 of each span [a, b) of a blob, of bytes it holds verified or read from the origin
        itself (server.PeerServer._digests); None for a span it does not vouch for, every span None when it
        does not hold the blob (404) or speaks no digests. PeerUnreachable when it cannot be reached;
        PeerBadAnswer for an answer that is not one digest or null per span within its size bound."""
        query = "digests=" + ",".join(f"{a}-{b - 1}" for a, b in spans)
        url = self.blob_url(blob)
        try:
            resp = self._request("GET", url + ("&" if "?" in url else "?") + query, headers=self._auth,
                                 preload_content=False, redirect=False)
        except NETWORK_ERRORS as exc:
            raise PeerUnreachable(f"peer {self.url} unreachable: {type(exc).__name__}") from exc
        if resp.status == 200 and resp.headers.get("Content-Type", "").partition(";")[0].strip() != JSON:
            # a daemon of a release before ?digests= (a rolling upgrade) answers a plain GET: the blob itself. It
            # speaks no digests, which is no offence; its connection is closed, not drained of the blob
            resp.close()
            resp.release_conn()
            return [None] * len(spans)
        limit = 64 + 70 * len(spans)  # {"sha256": [...]}: 64 hex digits, quotes and a comma, or null, per span
        body = read_capped(resp, limit, f"peer {self.url}'s piece digests", broke=PeerUnreachable)
        if resp.status != 200:
            return [None] * len(spans)
        if len(body) > limit:
            raise PeerBadAnswer(f"peer {self.url} sent piece digests over {limit} bytes for {len(spans)} spans")
        try:
            value = parse_json(body, what=f"peer {self.url}'s piece digests", example='{"sha256": ["<hex>", null]}')
        except InvalidRequestError as exc:
            raise PeerBadAnswer(str(exc)) from None
        sums = value.get("sha256") if isinstance(value, dict) else None
        if not isinstance(sums, list) or len(sums) != len(spans) or \
                not all(d is None or (isinstance(d, str) and _HEX64.fullmatch(d)) for d in sums):
            raise PeerBadAnswer(f"peer {self.url} answered piece digests that are not one sha256 or null for "
                                f"each of {len(spans)} spans")
        return [bytes.fromhex(d) if d is not None else None for d in sums]

    def engine_cache_files(self, snapshot_id: str, limit: int) -> Any:
        """The peer's file list of the admin's engine cache `snapshot_id` (decoded JSON, untrusted: the caller
        checks its shape and its digest), None when it has none; at most `limit` bytes of answer are read."""
        try:
            resp = self._request("GET", f"{self.url}/v1/engine-caches/{snapshot_id}", headers=self._auth,
                                 preload_content=False, redirect=False)
        except NETWORK_ERRORS as exc:
            raise PeerUnreachable(f"peer {self.url} unreachable: {type(exc).__name__}") from exc
        if resp.status != 200:
            resp.release_conn()
            return None
        body = read_capped(resp, limit, f"peer {self.url}'s engine cache file list", broke=PeerUnreachable)
        if len(body) > limit:
            raise SourceError(f"peer {self.url} sent an engine cache file list over {limit} bytes")
        return parse_json(body, what=f"peer {self.url}'s engine cache file list",  # deep nesting, bad UTF-8: refused
                          example='{"files": [["path", 1, "<sha256>"]]}')

    def close(self) -> None:
        self._pool.clear()

    def _request(self, method: str, url: str, **kwargs: Any) -> Any:
        """`self._pool.request`, sent again (at most CLOSED_RETRIES times) where it went out on a pooled
        connection that the peer closed before any byte of its answer came. A peer's listener at its cap closes
        connections idle between requests, without a word (listener.py; RFC 9112 9.8), and one our request was
        already on its way to reads as closed unanswered here. urllib3 reconnects a pooled connection found
        closed before it sends; this is the one that raced the close, and each ask is safe to send again (HEAD,
        a ranged GET, a digests GET, the statuses POST, which only reads). Never a fresh connection's failure (a
        peer that closes at once is not asked twice), nor one that a verdict cut (the request's Pace)."""
        tries = 0
        while True:
            _asking.reused = False
            try:
                return self._pool.request(method, url, **kwargs)
            except urllib3.exceptions.ProtocolError as exc:
                pace = _asking.pace
                if tries >= CLOSED_RETRIES or not _asking.reused or not _closed_unanswered(exc) or \
                        (pace is not None and (pace.was_cut or pace.down)):
                    raise
                tries += 1
                log.debug("peer %s closed a pooled connection before answering our %s: sent again", self.url,
                          method)


#: Times a request is sent again after a pooled connection was closed before any byte of its answer
#: (`PeerClient._request`): a peer at its cap may close several of a pool's idle connections at once.
CLOSED_RETRIES = 2


def _closed_unanswered(exc: urllib3.exceptions.ProtocolError) -> bool:
    """urllib3's "Connection aborted.": the connection was closed or reset before the answer's status line came
    (http.client's RemoteDisconnected, a reset, a broken pipe while sending), not a timeout or a bad answer."""
    return len(exc.args) > 1 and isinstance(exc.args[1], ConnectionError)


def streams_of(resp: Any) -> int:
    """The bodies a peer says it sends now (`STREAMS_HEADER`), 0 when it does not say (a 404, or a daemon of a
    release before it: the floor of a peer sending this range alone, as then)."""
    m = _STREAMS.fullmatch(resp.headers.get(STREAMS_HEADER, ""))
    return int(m[0]) if m else 0


def _reuse(resp: Any, pace: Pace | None) -> None:
    """Read a short answer's body (at most 4 KiB, by its Content-Length) and give its connection back to the
    pool; any other body closes the connection. A fleet polling its owners closed one connection per "not yet"
    and opened a new one for the next ask. The range's Pace is finished first: the watchdog never shuts down a
    connection that is the pool's again."""
    if pace is not None:
        pace.finish()
    short = _SHORT.fullmatch(resp.headers.get("Content-Length", ""))
    if (pace is not None and pace.was_cut) or not isinstance(resp, urllib3.HTTPResponse) or not short:
        resp.close()
        return
    try:
        resp.read(4000)
        resp.release_conn()
    except NETWORK_ERRORS:
        resp.close()


#: The rate floor of a range from a peer: after SLOW_GRACE_S it must have sent, on average since it was asked,
#: a quarter (FLOOR_SHARE) of what this fetch reads per origin connection, within [SLOW_MIN_BYTES_S,
#: SLOW_BYTES_S] (SLOW_BYTES_S until the fetch has read from the origin), or its connection is cut and the rest is
#: read elsewhere. A peer trickling a byte every 2 s stays under every read timeout and held a whole fetch; it
#: costs SLOW_GRACE_S (and a watchdog tick) at any of these floors. An absolute 1 MiB/s cut every peer of a fleet
#: filling at once behind a slow origin link (each served 15 askers at 0.2-0.8 MB/s a stream), and the fleet read
#: the model 5-11 times from the origin: relative to the origin, a peer is slow only when the origin would be
#: much faster.
#: A floor is what the peer's whole uplink must send, so a stream's is that over the bodies the peer says it sends
#: now (`STREAMS_HEADER`): a complete holder serving 62 streams of a 32-node fleet sent each 14 kB/s of its 0.88 MB/s
#: and was cut at 64 KiB/s (36 cuts of a run at N = 32), or at 1 MiB/s by a fetch without an origin rate (290). The
#: peer's word is untrusted: it counts for at most MAX_FANOUT streams (an honest peer has no more: its listener
#: holds 128 connections), and for at most STREAMS_PER_ASKER per other node of the fleet (a server's max_streams),
#: so a trickler still costs a second: a byte every 2 s is below every floor (SLOW_MIN_BYTES_S / MAX_FANOUT at the
#: least, 512 B/s).
SLOW_BYTES_S = 1 << 20
SLOW_MIN_BYTES_S = 64 << 10
FLOOR_SHARE = 0.25
SLOW_GRACE_S = 1.0
MAX_FANOUT = 128
STREAMS_PER_ASKER = 8
#: Before its answer's headers come, a request's grace is SLOW_GRACE_S, or ANSWER_SLACK times what the peer's
#: answers to this fetch took, or any peer's (moving means: this node's own links), at most MAX_ANSWER_WAIT_S: a
#: fleet of 32 on full 0.25 MB/s FIFO links with two cores had answers take over a second, and 35,437 asks were cut
#: before their answer came (0 bytes in 1.1 s), 150 a second, each one more request, and the origin read 2.0x the
#: model. A peer trickling its headers never completes an answer: it is cut at SLOW_GRACE_S, or at ANSWER_SLACK
#: times what the other answers took.
ANSWER_SLACK = 3.0
MAX_ANSWER_WAIT_S = 10.0
WATCH_TICK_S = 0.1  # how often the watchdog looks at the streams it watches (a cut comes this much late at most)
LOOK_MIN_S = 0.03  # a look due at a silence to come (_Watchdog._silent) waits this long at least: looks coalesced
#: A watchdog look that comes STALL_S or more after its tick was due: this process ran nothing meanwhile (its CPU
#: taken by others, a cgroup's quota spent, the GIL held), its readers no more than the watchdog, so what the peers
#: sent waited in the sockets unread. That time is no slowness of theirs: every stream's floor clock starts again
#: later by it (`Pace.stalled`), as for a wait of this node's own (`Pace.held`). Judged by the wall clock alone, a
#: look after a stall of a second cut every stream still waiting for its answer as "0 bytes in 1.0 s, no answer", and
#: benched the peer: a node whose only healthy holder was benched so read the ranges in flight, 2 MiB of a 5 MiB
#: model, from the origin (tests/test_peers.py::test_a_peer_killed_mid_transfer_costs_a_retry_elsewhere, CI on a
#: 2-core machine: stalls of 0.5-1.6 s of the whole test process in a third of its runs under load).
STALL_S = 0.1
#: A peer that sent nothing on any stream for SILENT_S while a stream waits on it, and while bytes came from
#: elsewhere (its link up: `Link`), is probed: a TCP connect, PROBE_CONNECTS at once, answered by the peer's
#: kernel (its daemon may be busy) within PROBE_S. None answered, and bytes still coming from elsewhere: its link
#: is cut, or it is dead, and its streams are cut as unreachable (their ranges go to the next node at once). A
#: silence alone proves nothing: a relay waits on its owner's origin pieces, and flows starve for a second or
#: more in a full link's queue (RELAY_GRACE_S); a node cut off mid-transfer held its ranges 2.6-10 s (read
#: timeouts, the relay floor's grace). Several connects, PROBE_GAP_S apart: a full queue drops SYNs (a live node
#: taken for cut at 3 connects at once within 0.4 s: its range read from the origin again, --faults).
#: A probe waits PROBE_S, or as long as answers take (`probe_wait`): on full 0.25 MB/s FIFO links (the netns
#: bench at N = 32) whole bursts of SYNs were dropped, and probes of 0.5 s took live peers for cut in 4,985 streams
#: of one fill (their ranges read from the origin again: 1.26x the model). A connect's SYN and SYN-ACK wait in the
#: queues its answers wait in. A probe sends a new connect every PROBE_GAP_S all through its wait (at most
#: PROBE_MAX_CONNECTS), each a new draw of a full queue's drops: three connects and then the kernel's own SYN
#: resend (1 s after each) answered the netns bench's live peers in 0.3-0.7 s where the first SYN was lost (one
#: probe in five), and probes of 0.5 s took live peers for cut in 5-9 streams a --faults run; so a probe waits
#: PROBE_SLACK times what answers take, not ANSWER_SLACK (which spanned that resend): at answers of 0.43 s it
#: waited 1.3 s, and the cut node's ranges went on 2 s after the cut. Not shorter: what answers take includes
#: a filling peer's long poll (up to 0.3 s, server NOT_YET_WAIT_S), and timed without it the probe waited 0.5 s
#: and a fill without faults took live peers for cut in 20 streams (docs/peers.md, "The silence probe measured").
SILENT_S = 0.4
#: The probe itself begins at this much silence, before SILENT_S: a cut peer's verdict is its silence's start (its last
#: bytes, up to 0.1 s after the cut in a link's queue), this, and the probe's wait; at SILENT_S the netns bench's nodes
#: whose peer server sent the cut node nothing found it 1.0 s after its cut (docs/peers.md, "Session 55"). Its
#: backoff once found up, and the link's test ("a byte from elsewhere within SILENT_S / 2"), stay SILENT_S's.
PROBE_SILENT_S = 0.3
PROBE_S = 0.5
PROBE_CONNECTS, PROBE_GAP_S, PROBE_MAX_CONNECTS = 3, 0.1, 16
PROBE_SLACK = 2.0
#: A silent peer that answered its probe (or whose kernel acknowledged what this node sends it) is looked at again
#: PROBE_AGAIN_S later, however long its silence: a relay silent for seconds (its owner's origin pieces) and cut off
#: just after a look is found within this, PROBE_S and a look's lateness. Looked at again only once its silence had
#: doubled (up to 2 s), the netns bench's N = 32 --faults run had 10 of 20 live nodes hand the cut node's ranges on
#: within 1 s (max 1.8 s: probes begun 1.5-2.9 s into a silence that began before the cut), 18 of 20 (max 1.2 s)
#: with this (docs/peers.md, "Session 56's final main"). The doubling was for the probes' cost when each connect
#: reached the peer's daemon (22 probe connections a second a node at N = 32, 37 accepted); the peer server's
#: listener defers the accept now (a probe's connect, reset unused, never wakes it).
PROBE_AGAIN_S = SILENT_S
#: What this node's own peer server hears from a silent peer's host tells that its link is up without a connect: the
#: peer's kernel acknowledges what the server sends it within a round trip, whatever its daemon does and whether or
#: not its listener's queue or a full link drops SYNs (a connect could not tell a cut node from a live one behind a
#: full 1 MB/s link in 0.5 s: docs/peers.md, "The silence probe measured"). An acknowledgement from it within
#: ACK_RECENT_S before the probe would begin, or while it runs, says its link is up: no connect is made, and it is
#: looked at again as a peer that answered a probe is (its silence doubled). Only one that recent counts: the netns
#: bench's cut node had acknowledged the servers' bytes until its cut, its relays to them silent long before, and a
#: rule of "acknowledged since its streams went silent" took it for live through its cut. The converse is not used:
#: bytes of the server unacknowledged for twice the kernel's smoothed round trip (at least 0.25 s) took live peers
#: for cut in a fill without faults (18 streams, all ready 1.34x against 1.22x; docs/peers.md).
ACK_RECENT_S = 0.1
#: The converse, as a sign to probe and a probe's second channel, not as a verdict alone: a silent peer whose kernel
#: stopped acknowledging what this node's peer server sends it (segments in flight, none acknowledged for ACK_STALE_S,
#: an acknowledgement having come since it was last found up) is probed once its streams are silent SILENT_EARLY_S,
#: whatever backoff a probe that found it up set (PROBE_AGAIN_S); and such a probe, its connects unanswered and its
#: kernel acknowledging nothing all through, ends at PROBE_S, not at twice what answers take (a filling peer's long
#: poll in them). A node cut off stops acknowledging at its cut: the netns bench's probes of it began 0.4-1.1 s after
#: the cut (SILENT_S, the tick, that backoff for a relay silent before the cut) and waited 0.5-1.0 s, and its
#: verdict came 0.5-2.2 s after the cut (docs/peers.md, "Session 55").
ACK_STALE_S = 0.2
SILENT_EARLY_S = 0.2
#: What answers take is the peer's daemon's time as well as the queues' (its CPU on a busy machine, a filling peer's
#: long poll); what a live peer's handshake takes is the queues' alone, and this node's probes time it. A probe waits
#: no longer than HANDSHAKE_SLACK times the slowest handshake of the peer's last HANDSHAKE_KEEP probes that a connect
#: answered and of every probe of this process that one answered in the last HANDSHAKE_RECENT_S (its own links'
#: queues), PROBE_S at least, where the peer has one such probe and the process HANDSHAKE_MIN of them lately; else
#: as long as answers take, as before. The netns bench at N = 32 with faults: answers took up to 1.0 s and the cut
#: node's probes waited 1.0-2.1 s, while 99.9 % of the 15,691 probes that a live peer's connect answered did so in
#: 0.46 s (docs/peers.md, "Session 56"); a live peer's handshake came later than this wait in none of them.
HANDSHAKE_SLACK, HANDSHAKE_KEEP, HANDSHAKE_RECENT_S, HANDSHAKE_MIN = 2.0, 8, 2.0, 8


def answer_wait(*clocks: PeerFlow | None, slack: float = ANSWER_SLACK) -> float:
    """How long to wait for a peer's answer: `slack` times what the answers of `clocks` took (moving means: the
    peer's to this fetch, any peer's), at most MAX_ANSWER_WAIT_S; 0 before any answer came."""
    took = max((c.answer_s or 0.0 for c in clocks if c is not None), default=0.0)
    return min(MAX_ANSWER_WAIT_S, slack * took)


def probe_wait(*clocks: PeerFlow | None) -> float:
    """How long a silence probe waits for a peer's kernel to answer a connect: PROBE_S, or PROBE_SLACK times what
    the answers of `clocks` took where that is longer (its connects go out all through the wait: `reachable`)."""
    return max(PROBE_S, answer_wait(*clocks, slack=PROBE_SLACK))


class _Asking(threading.local):
    pace: Pace | None = None  # the Pace of the request this thread is making now
    reused = False  # the connection its request went out on had carried one before (the pool's `_get_conn`)


_asking = _Asking()


class Link:
    """When a fetch last received a byte from anywhere (any peer, the origin): what tells a peer gone quiet from
    this node's own link gone (a node cut off hears from no one). `quiet()`: no byte and no peer's answer for
    `quiet_s`, after one came; `back`: when one came after such a quiet (this node's link back); `cut_back`: when
    one came after a quiet in which a peer's request failed and was taken for this link (`blame`): the link was
    cut off, not merely idle. A node whose only request, an origin read, is held past `quiet_s` moves `back` when
    the hold ends, with no link cut: a claimed read that handed its rest on at `back` read 0.75 MiB of a test's
    model again (docs/peers.md, "a claimed origin read hands its rest back after a cut")."""

    def __init__(self, quiet_s: float = 2.0) -> None:
        self.last = time.monotonic()
        self.quiet_s = quiet_s
        self.sign: float | None = None  # the last byte or answer
        self.back = 0.0
        self.cut_back = 0.0
        self._blamed = 0.0  # when a peer's failure was last taken for this link

    def touch(self) -> None:
        self.last = time.monotonic()
        self.heard()

    def heard(self) -> None:
        """A byte, or a peer's answer, came now."""
        now = time.monotonic()
        if self.sign is not None and now - self.sign >= self.quiet_s:
            self.back = now
            if self._blamed > self.sign:  # a request failed in this quiet: the link was cut off
                self.cut_back = now
        self.sign = now

    def blame(self) -> None:
        """A peer's request failed now and was taken for this link, not the peer's (PeerSource._not_theirs)."""
        self._blamed = time.monotonic()

    def quiet(self) -> bool:
        sign = self.sign
        return sign is not None and time.monotonic() - sign >= self.quiet_s


class PeerFlow:
    """Bytes from one peer over all of a fetch's streams from it: a peer is slow only when all of them together
    are below the floor. A peer serving many askers at once sends each stream little, and one stream may wait on
    its turn while the others flow; a trickler is below the floor on every stream at once. With `addr` (the
    peer's host and port) and `link` (the fetch's), the watchdog probes a peer silent on every stream (SILENT_S);
    `connections`: this node's peer server's connections from the peer's host, what its probe asks first (_Acks)."""

    def __init__(self, addr: tuple[str, int] | None = None, link: Link | None = None,
                 connections: Callable[[], list[TcpConnection]] | None = None) -> None:
        self._lock = threading.Lock()
        self._samples: collections.deque[tuple[float, int]] = collections.deque([(time.monotonic(), 0)])
        self._total = 0
        # the bodies the peer said it sends, in its latest answer to this fetch: a stream that began while it sent
        # 2 is judged by its share of the 62 it sends later (Pace.due)
        self.streams = 1
        self.addr, self.link = addr, link
        self.connections = connections  # this node's peer server's connections from the peer's host (_Acks)
        self.last = time.monotonic()  # its last byte, on any stream
        self.probing = False
        self.probe_after = 0.0  # a probe it answered: the next one not before this (_Watchdog._probe)
        self.answer_s: float | None = None  # how long its answers' headers took (a moving mean; Pace.answered)
        self.probe_s = PROBE_S  # how long its last silence probe waited for a connect (_Watchdog._probe)
        self.found_up = 0.0  # when a probe, or a recent acknowledgement, last found it up (acks_stalled)
        # how long its last probes that a connect answered took to that answer (_Watchdog.handshake_wait)
        self.handshakes: collections.deque[float] = collections.deque(maxlen=HANDSHAKE_KEEP)

    def add(self, n: int) -> None:
        now = time.monotonic()
        self.last = now
        if self.link is not None:
            self.link.touch()
        with self._lock:
            self._total += n
            self._samples.append((now, self._total))
            while len(self._samples) > 2 and self._samples[1][0] < now - 4 * SLOW_GRACE_S:
                self._samples.popleft()

    def took(self, seconds: float) -> None:
        """An answer's headers came `seconds` after it was asked."""
        with self._lock:
            self.answer_s = seconds if self.answer_s is None else 0.8 * self.answer_s + 0.2 * seconds

    @property
    def total(self) -> int:
        return self._total

    def rate(self, now: float, window: float) -> float:
        """Bytes per second over the last `window` seconds (since the first sample, when it is younger)."""
        with self._lock:
            since, base = self._samples[0]
            for t, total in self._samples:
                if t > now - window:
                    break
                since, base = t, total
            return (self._total - base) / max(window, now - since, 1e-3)


class Pace:
    """One range asked of a peer: what it sent and since when; `cut` shuts its socket down (from the watchdog
    thread), so the read blocked on it returns at once and the asker goes on with the bytes not yet received.
    The floor's clock starts again when the answer's headers came (`answered`): a peer that took most of the
    grace to answer (a long poll, a busy link) gets its body's grace too; a header trickler is cut all the same."""

    def __init__(self, length: int, min_rate: int = SLOW_BYTES_S, grace_s: float = SLOW_GRACE_S,
                 flow: PeerFlow | None = None, max_fanout: int = MAX_FANOUT, answers: PeerFlow | None = None) -> None:
        """`min_rate`: the floor of a peer sending this range alone; `max_fanout`: the most streams the peer's word
        on its fan-out counts for (`answered`); `flow`: the fetch's streams from this peer; `answers`: the fetch's
        answers from all its peers (how long they take: this node's own links)."""
        self.started = self.asked = time.monotonic()
        self.length, self.min_rate, self.grace_s = length, min_rate, grace_s
        self.peer_floor = min_rate  # what the peer's whole uplink must send
        self.max_fanout = max(1, min(max_fanout, MAX_FANOUT))
        self.streams = 0  # the bodies the peer said it sends now (`answered`; 0: no answer yet)
        self.flow, self.answers = flow, answers
        self.got = 0
        self.was_cut = False
        self.unreachable = False  # cut because its peer answered no connect while silent (the watchdog's probe)
        self.down = False  # ended by a verdict that its peer is down (`cut`, `down`): before it connected, too
        self._done = False
        self._conn: _HTTPConnection | _HTTPSConnection | None = None
        self._resp: urllib3.BaseHTTPResponse | None = None  # the answer, once its headers came (`answered`)
        self._held_since: float | None = None
        self._lock = threading.Lock()

    def attach(self, conn: _HTTPConnection | _HTTPSConnection) -> None:
        with self._lock:
            self._conn = conn
            if self.down and conn.sock is not None:  # its peer found down before it took a pooled connection
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)

    def expect(self, length: int) -> None:
        """The peer answers this many bytes (a peer still downloading may answer a shorter span)."""
        with self._lock:
            self.length = length

    def add(self, n: int) -> None:
        """`n` bytes arrived; once all did, the connection is the pool's again and is never cut."""
        with self._lock:
            self.got += n
            self._done = self._done or self.got >= self.length
        if self.flow is not None:
            self.flow.add(n)

    def answered(self, streams: int = 0, resp: urllib3.BaseHTTPResponse | None = None) -> None:
        """The answer's headers came: the body's floor counts from now, and is this stream's share of the peer's
        (`streams`: the bodies it says it sends now, bounded by `max_fanout`; 0: it did not say). `resp`: the
        answer (urllib3's), whose body `cut` shuts down."""
        now = time.monotonic()
        with self._lock:
            self.started, self._resp = now, resp
            self.streams = max(1, streams)
            for clock in (self.flow, self.answers):
                if clock is not None:
                    clock.took(now - self.asked)
            if self.flow is not None and streams:
                self.flow.streams = streams
            self.min_rate = self._share()

    def _share(self) -> int:
        """This stream's floor (under the lock): its share of the peer's, by the most bodies the peer said it sends
        (this answer's, or its latest to this fetch)."""
        streams = max(self.streams, self.flow.streams if self.flow is not None else 1)
        share = self.peer_floor // max(1, min(streams, self.max_fanout))
        return min(self.peer_floor, max(SLOW_MIN_BYTES_S // MAX_FANOUT, share))

    def finish(self) -> None:
        with self._lock:
            self._done = True

    @property
    def answered_yet(self) -> bool:
        """Its answer's headers came (`answered`): what waits on the peer now is its body, or nothing."""
        return self.streams > 0 or self._done

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """This node keeps the range waiting (its own peer bytesPerSecond): no slowness of the peer's, so the
        floor is not judged meanwhile and its clock starts again later by the time held. Without it a node whose
        peer limit gives each of its workers about the floor's rate (8 MiB/s over 8 workers) cut every peer as a
        trickler and fetched from the origin instead."""
        since = time.monotonic()
        with self._lock:
            self._held_since = since
        try:
            yield
        finally:
            with self._lock:
                self.started += time.monotonic() - since
                self._held_since = None

    def stalled(self, seconds: float, now: float) -> None:
        """This process ran nothing for `seconds` before `now` (STALL_S): the floor's clock starts again later by
        that, or by as much of it as this stream has been judged for."""
        with self._lock:
            if self._held_since is None:  # a hold moves the clock by all of its time when it ends (`held`)
                self.started += max(0.0, min(seconds, now - self.started))

    def due(self, now: float) -> bool:
        with self._lock:
            grace = self.grace_s
            if self.streams:
                self.min_rate = self._share()
            else:  # no answer yet: as long as the peer's answers take, or any peer's (this node's links)
                grace = max(grace, answer_wait(self.flow, self.answers))
            slow = not self._done and self._held_since is None and \
                self.got < self.min_rate * (now - self.started - grace)
        return slow and (self.flow is None or self.flow.rate(now, self.grace_s) < self.min_rate)

    def waiting(self) -> bool:
        """It waits on its peer's bytes: not done, not cut, not held by this node."""
        with self._lock:
            return not self._done and not self.was_cut and self._held_since is None

    def cut(self, unreachable: bool = False, down: bool = False) -> bool:
        """Shut the socket down; False while there is none yet (connecting, below the floor: its timeout bounds that;
        `unreachable`, the probe's verdict, ends a connect too). `down`: a verdict that the peer is down, reached
        elsewhere (source.PeerSource._went_down), ends the request wherever it is: a connect, or one not begun
        yet (it ends as it connects, or as it takes a pooled connection)."""
        with self._lock:
            if self._done or self.was_cut:
                return True
            self.down = self.down or down
            # a connect in flight is ended by a verdict only (below the floor, its timeout bounds it): to a node cut
            # off it held its range KNOWN_CONNECT_S (1 s or more) after the verdict (_connect)
            ending = unreachable or down
            sock = None if self._conn is None else self._conn.sock or (self._conn.connecting if ending else None)
            # an answer that says Connection: close (a relay of a claim: server.PeerServer._stream) takes the
            # socket from its connection (http.client), and only the answer can shut it: such streams were never
            # cut, and a relay cut off mid-stream held its range to the read timeout (--faults: 8.3-10 s)
            shut = functools.partial(sock.shutdown, socket.SHUT_RDWR) if isinstance(sock, socket.socket) else \
                None if self._resp is None else self._resp.shutdown
            if shut is None:
                return False
            self.was_cut, self.unreachable = True, unreachable
            # under the lock: a range that completes meanwhile must not see its pooled connection shut
            with contextlib.suppress(OSError, ValueError, RuntimeError):  # closed or given back meanwhile
                shut()
        return True

    def describe(self) -> str:
        took = time.monotonic() - self.started
        said = f"; it sends {self.streams} bodies" if self.streams > 1 else "" if self.streams else "; no answer"
        return (f"{self.got} bytes in {took:.1f}s, below the floor of {self.min_rate >> 10} KiB/s after "
                f"{self.grace_s:g}s{said}")


class Helpers:
    """Daemon threads kept for the next job: the watchdog's silence probes ran a new thread each, and a fleet fill
    at N = 32 probed ~15 silent relays a second a node (a thread started and torn down each). A job goes to an
    idle thread, or to a new one when none is idle (jobs never wait on each other: a probe waits seconds); a thread
    idle for IDLE_S ends."""

    IDLE_S = 30.0

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a job that no `run` has counted on yet
        self.started = 0  # threads started, all told

    def run(self, job: Callable[..., None], *args: Any) -> None:
        with self._lock:
            spawn = self._idle == 0
            if spawn:
                self.started += 1
            else:
                self._idle -= 1  # that thread's: it takes this job (or another's just put, the same)
        self._jobs.put((job, args))
        if spawn:
            threading.Thread(target=self._serve, name=self.name, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                job, args = self._jobs.get(timeout=self.IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # nobody counted on this thread: it ends
                        self._idle -= 1
                        return
                continue  # a `run` counted on it as it timed out: its job is coming
            try:
                job(*args)
            except Exception:  # a job's failure is its own; the thread serves the next
                log.exception("%s failed", self.name)
            with self._lock:
                self._idle += 1


class _Watchdog:
    """One thread for every Pace of the process: it cuts those that fall below their floor."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._paces: set[Pace] = set()
        self._thread: threading.Thread | None = None
        self._due = time.monotonic()  # when its next look is due: a look later than STALL_S after it, a stall
        self.probers = Helpers("peer-probe")
        # (when, how long) of this process's probes that a connect answered, the last HANDSHAKE_RECENT_S of them
        self._handshakes: collections.deque[tuple[float, float]] = collections.deque()

    def handshake(self, flow: PeerFlow, seconds: float) -> None:
        """A probe of `flow`'s peer had a connect answered `seconds` after it began."""
        now = time.monotonic()
        flow.handshakes.append(seconds)
        with self._cv:
            self._handshakes.append((now, seconds))
            while self._handshakes and self._handshakes[0][0] < now - HANDSHAKE_RECENT_S:
                self._handshakes.popleft()

    def recent_handshake(self, now: float) -> float | None:
        """The slowest handshake of this process's probes in the last HANDSHAKE_RECENT_S, where there were
        HANDSHAKE_MIN of them (self._cv held); once a look, not once a silent peer."""
        while self._handshakes and self._handshakes[0][0] < now - HANDSHAKE_RECENT_S:
            self._handshakes.popleft()
        return max(took for _, took in self._handshakes) if len(self._handshakes) >= HANDSHAKE_MIN else None

    @staticmethod
    def handshake_wait(flow: PeerFlow, recent: float | None) -> float | None:
        """How long a probe of `flow`'s peer waits at most by what handshakes took: HANDSHAKE_SLACK times the slowest
        of its last probes' and `recent` (this process's: `recent_handshake`), PROBE_S at least; None where the peer
        has had none answered, or the process too few lately."""
        if not flow.handshakes or recent is None:
            return None
        return max(PROBE_S, HANDSHAKE_SLACK * max(max(flow.handshakes), recent))

    def watch(self, pace: Pace) -> None:
        with self._cv:
            idle = not self._paces
            self._paces.add(pace)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="peer-watchdog", daemon=True)
                self._thread.start()
            if idle:  # it sleeps until a first stream; otherwise it looks at this one on its next tick (waking it
                self._due = max(self._due, time.monotonic())  # for each ask was a thread switch per request); a
                self._cv.notify()  # look due now, or at the tick it waits for (not waiting: the notify is lost)

    def unwatch(self, pace: Pace) -> None:
        with self._cv:
            self._paces.discard(pace)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._paces:
                    self._cv.wait()
                now = time.monotonic()
                late, self._due = now - self._due, now + WATCH_TICK_S
                if late >= STALL_S:  # this process was stalled: none of it counts against the peers (STALL_S)
                    for p in self._paces:
                        p.stalled(late, now)
                due = [p for p in self._paces if p.due(now)]
            cut = [pace for pace in due if pace.cut()]
            with self._cv:
                self._paces.difference_update(cut)
                silent, next_look = self._silent(now)
            for flow, since, wait, silent_enough in silent:
                socks = flow.connections() if flow.connections is not None else []
                if not silent_enough:  # silent SILENT_EARLY_S, or in its backoff: probed only on a stall of its acks
                    if not acks_stalled(socks, flow.found_up, now):
                        continue
                elif _Acks(socks).told():
                    # its kernel acknowledges what this node's peer server sends it: up, no connect (ACK_RECENT_S),
                    # looked at again as one that answered a probe: its connects never more than before (looked at
                    # every 0.2 s, a fill without faults had 10 streams of live peers cut by the probes that followed)
                    flow.probe_after, flow.found_up = now + PROBE_AGAIN_S, now
                    continue
                flow.probing = True
                self.probers.run(self._probe, flow, since, wait, now, not silent_enough)
            with self._cv:
                # the next look at the next silence due (SILENT_EARLY_S, PROBE_SILENT_S), the tick at the latest: a
                # probe
                # begun at the tick after the silence began it up to WATCH_TICK_S late
                wait_s = max(LOOK_MIN_S, min(WATCH_TICK_S, next_look - time.monotonic()))
                self._due = time.monotonic() + wait_s
                self._cv.wait(wait_s)

    def _silent(self, now: float) -> tuple[list[tuple[PeerFlow, float, float, bool]], float]:
        """Peers to probe (self._cv held), with how long each probe waits, and whether it is silent enough to be
        probed whatever its acknowledgements say: a stream waits on each, it sent nothing on any stream for
        PROBE_SILENT_S (since its last byte, or the oldest such stream's ask) and is past its backoff, and bytes came
        from elsewhere since; silent SILENT_EARLY_S, or in its backoff, it is probed only on a stall of what this
        node's peer server sends it (`acks_stalled`, ACK_STALE_S). A probe waits PROBE_S, or as long as answers take
        on this node's links (`probe_wait`: the peer's answers to the fetch, or any peer's), no longer than handshakes
        take where this process has timed them (`handshake_wait`). And when the next look
        is due: the earliest of the silences to come, WATCH_TICK_S from now at the latest."""
        # each flow's oldest waiting ask and its fetches' answer clocks first, the probe's wait only for the flows
        # found silent: computed for every stream, it was most of the cost of a look (~290 of ~370 us a look at
        # 64 streams; ten looks a second in each of the netns bench's 32 daemons)
        oldest: dict[PeerFlow, tuple[float, set[PeerFlow | None]]] = {}
        for p in self._paces:
            flow = p.flow
            if flow is not None and flow.addr is not None and flow.link is not None and p.waiting():
                seen = oldest.get(flow)
                if seen is None:
                    oldest[flow] = (p.asked, {p.answers})
                else:
                    seen[1].add(p.answers)
                    if p.asked < seen[0]:
                        oldest[flow] = (p.asked, seen[1])
        probe, next_look = [], now + WATCH_TICK_S
        recent = self.recent_handshake(now)
        for flow, (asked, answers) in oldest.items():
            if flow.probing:
                continue
            since = max(flow.last, asked)
            early = SILENT_EARLY_S if flow.connections is not None else PROBE_SILENT_S
            if now - since < early:
                next_look = min(next_look, since + early)
                continue
            enough = now - since >= PROBE_SILENT_S and now >= flow.probe_after
            if not enough and flow.connections is None:
                continue
            if not enough and now - since < PROBE_SILENT_S:
                next_look = min(next_look, since + PROBE_SILENT_S)
            if flow.link is not None and flow.link.last > since:
                wait = max(probe_wait(flow, clock) for clock in answers)
                cap = self.handshake_wait(flow, recent)
                probe.append((flow, since, wait if cap is None else min(wait, cap), enough))
        return probe, next_look

    def _probe(self, flow: PeerFlow, since: float, wait: float, looked: float | None = None,
               stalled: bool = False) -> None:
        """A silent peer's kernel answers a connect within `wait`, or its waiting streams are cut as unreachable
        (while bytes still come from elsewhere: a node cut off itself hears from no one, and cuts nothing). Its
        kernel acknowledging nothing of what this node's peer server sends it all through, PROBE_S is enough
        (`_Acks.stalled`). `looked`: when the watchdog found it silent, `stalled`: begun on a stall of its
        acknowledgements (`acks_stalled`), before its silence was enough (the verdict's log line)."""
        try:
            addr, link = flow.addr, flow.link
            flow.probe_s = wait
            acks = _Acks(flow.connections() if flow.connections is not None else [])
            try:
                reach = Reach(True) if addr is None or link is None else reachable(addr, wait, acks.told, acks.stalled)
            except OSError:  # this node could not probe (out of descriptors): no verdict on the peer
                reach = Reach(True)
            if reach.handshake_s is not None:
                self.handshake(flow, reach.handshake_s)
            if reach.up or link is None:
                # looked at again PROBE_AGAIN_S from now, its silence however long
                now = time.monotonic()
                flow.probe_after, flow.found_up = now + PROBE_AGAIN_S, now
                return
            if acks.ended:
                flow.probe_s = PROBE_S
            # it spoke meanwhile, or nothing came from elsewhere lately: a node cut off hears from no one, and all
            # of its peers went silent when its link did
            if flow.last > since or link.last < time.monotonic() - SILENT_S / 2:
                return
            with self._cv:
                paces = [p for p in self._paces if p.flow is flow]
            now = time.monotonic()
            log.info("silence probe: peer %s:%d sent nothing for %.2f s, probed %.2f s into its silence%s%s; no "
                     "connect answered within %.2f s%s: unreachable", *(addr or ("?", 0)), now - since,
                     acks.began - since, " on its acknowledgements' stall" if stalled else "",
                     "" if looked is None else f" ({acks.began - looked:.2f} s after its look)",
                     flow.probe_s, ", nor its kernel acknowledged what this node sends it" if acks.ended else "")
            cut = [p for p in paces if p.cut(unreachable=True)]
            with self._cv:
                self._paces.difference_update(cut)
        finally:
            flow.probing = False


@dataclass(frozen=True, slots=True)
class Reach:
    """`reachable`'s verdict. No __bool__ on purpose: `if reachable(...)` would be always true (mypy's truthy-bool,
    enabled in pyproject.toml, refuses it); say `.up`."""

    up: bool
    handshake_s: float | None = None  # how long after the probe began a connect answered; None where none did


def reachable(addr: tuple[str, int], timeout: float, told: Callable[[], bool | None] | None = None,
              gone: Callable[[], bool] | None = None) -> Reach:
    """Does `addr` complete a TCP handshake within `timeout`? A connect every PROBE_GAP_S all through `timeout`
    (further apart where PROBE_MAX_CONNECTS would not span it): a full link's queue drops a burst of packets
    together, and the kernel sends a lost SYN again only 1 s later, so each new connect is a new draw of the
    queue's drops; PROBE_CONNECTS refused, and none waiting, is no. The connections are reset at once, unused. A
    selector, not select(): a daemon's descriptors pass 1024 (FD_SETSIZE) with many peers and pods. Once
    `timeout` is over the sockets are looked at once more: a probe thread that woke late (a busy CPU: the netns
    bench started probes up to 0.5 s after they were due) would count its own lateness as the peer's silence.
    `told`: asked between connects, what else says the peer's link is up (`_Acks`): True is the answer at once;
    `gone`: asked after it, what else says it is down (`_Acks.stalled`): True is the answer no at once. The
    handshake's time (`Reach.handshake_s`) feeds the probes' wait (`_Watchdog.handshake`)."""
    try:
        infos = socket.getaddrinfo(addr[0], addr[1], type=socket.SOCK_STREAM)
    except OSError:
        return Reach(False)
    family, kind, proto, _, sockaddr = infos[0]
    started, opened, failed = time.monotonic(), 0, 0
    gap = max(PROBE_GAP_S, timeout / PROBE_MAX_CONNECTS)
    with selectors.DefaultSelector() as waiting:
        try:
            while True:
                left = started + timeout - time.monotonic()
                if left > 0 and opened < PROBE_MAX_CONNECTS and time.monotonic() >= started + opened * gap:
                    s = socket.socket(family, kind, proto)
                    opened += 1
                    # registered first: the finally below closes what is registered, should a call after fail
                    waiting.register(s, selectors.EVENT_WRITE, s)
                    s.setblocking(False)
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # closed with a reset
                    s.connect_ex(sockaddr)
                wait = max(0.0, min(left, started + opened * gap - time.monotonic())) \
                    if opened < PROBE_MAX_CONNECTS else max(0.0, left)
                for key, _ in waiting.select(wait):
                    if key.data.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                        return Reach(True, time.monotonic() - started)
                    failed += 1
                    waiting.unregister(key.data)
                    key.data.close()
                if (not waiting.get_map() and failed >= PROBE_CONNECTS) or left <= 0:
                    return Reach(False)
                if told is not None and told():
                    return Reach(True)
                if gone is not None and gone():
                    return Reach(False)
        finally:
            for key in list(waiting.get_map().values()):
                key.data.close()


def answers_no_connect(addr: tuple[str, int], wait: float,
                       connections: Callable[[], list[TcpConnection]] | None = None) -> bool:
    """The silence probe's test (`_Watchdog._probe`) of a peer that failed a request: no connect to `addr` completes
    within `wait` (`reachable`), and its kernel acknowledged nothing this node's peer server sent it meanwhile
    (`connections`: that server's connections from its host, `_Acks`). False where this node could not probe (out
    of descriptors): no verdict."""
    acks = _Acks(connections() if connections is not None else [])
    try:
        return not reachable(addr, wait, acks.told).up
    except OSError:
        return False


def acked_ago(sock: TcpConnection) -> float | None:
    """Seconds since the peer's kernel last acknowledged anything on a connected TCP socket, from the kernel's
    TCP_INFO (Linux); None where it cannot say (closed, not TCP, no TCP_INFO). `sock`: a socket, or asyncio's
    TransportSocket of a server connection."""
    state = ack_state(sock)
    return None if state is None else state[1]


def ack_state(sock: TcpConnection) -> tuple[int, float] | None:
    """Segments in flight on a connected TCP socket, and seconds since the peer's kernel last acknowledged anything,
    from the kernel's TCP_INFO (Linux); None where it cannot say (closed, not TCP, no TCP_INFO)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except (OSError, ValueError):  # closed since it was listed (ValueError: a TransportSocket's -1 descriptor)
        return None
    if len(info) < 60:
        return None
    # struct tcp_info (linux/tcp.h): tcpi_unacked, tcpi_last_ack_recv
    unacked, last_ack_ms = struct.unpack_from("=I", info, 24)[0], struct.unpack_from("=I", info, 56)[0]
    return int(unacked), last_ack_ms / 1000


def acks_stalled(sockets: list[TcpConnection], found_up: float, now: float | None = None) -> bool:
    """A silent peer's kernel stopped acknowledging what this node's peer server sends it (ACK_STALE_S): segments in
    flight on one of `sockets`, nothing acknowledged on any of them for ACK_STALE_S, and the last acknowledgement on
    any of them no earlier than `found_up` (when a probe or a recent acknowledgement last found it up) less
    ACK_RECENT_S: a stall a probe already spanned is not probed again, one begun after an acknowledgement that found
    it up is (on whichever connection: the --faults bench's cut node was found up by one that had sent its last
    bytes, and the stall was another's)."""
    now = time.monotonic() if now is None else now
    states = [state for sock in sockets if (state := ack_state(sock)) is not None]
    if not any(unacked > 0 for unacked, _ in states):
        return False
    quiet = min(ago for _, ago in states)  # since the last acknowledgement on any connection
    return quiet >= ACK_STALE_S and now - quiet >= found_up - ACK_RECENT_S


class _Acks:
    """Whether the connections of this node's peer server from a silent peer's host say its link is up (ACK_RECENT_S):
    `told()` is True when its kernel acknowledged bytes on one of them lately, else None (nothing to tell);
    `stalled()` is True when segments are in flight on one of them and none was acknowledged since ACK_STALE_S
    before this began, PROBE_S ago at least (a second channel's silence: the probe's verdict at PROBE_S)."""

    def __init__(self, sockets: list[TcpConnection]) -> None:
        self.began = time.monotonic()
        self._socks = sockets
        self.ended = False  # `stalled` ended the probe

    def stalled(self) -> bool:
        now = time.monotonic()
        if now - self.began < PROBE_S:
            return False
        for sock in self._socks:
            state = ack_state(sock)
            if state is not None and state[0] > 0 and now - state[1] <= self.began - ACK_STALE_S:
                self.ended = True
                return True
        return False

    def told(self) -> bool | None:
        now = time.monotonic()
        for sock in self._socks:
            ago = acked_ago(sock)
            if ago is not None and now - ago >= self.began - ACK_RECENT_S:
                return True
        return None


WATCHDOG = _Watchdog()


#: After a receive that brought less than GATHER_BYTES, a peer's body is read again only GATHER_S later: a fleet
#: fill's peer bodies came a packet or two a receive (a server sends a stream 32 KiB slices, each a burst of ~23
#: packets at the link's rate, and its reader woke for each: up to ~700 wakes a second a node at 1 MB/s); 4-7 %
#: less daemon CPU in the netns bench at N = 16 and 32 (docs/peers.md, "Less CPU a byte"). The bytes wait in the
#: socket's buffer meanwhile, not on the wire: the rate is not capped (a receive after the wait takes all that
#: came), and the watchdog sees them GATHER_S late at most (its floors' grace is SLOW_GRACE_S, its silence SILENT_S).
GATHER_BYTES = 16 << 10
GATHER_S = 0.02


class EagerBody:
    """A peer's response body read one receive at a time, so its Pace sees bytes as they come. A buffered read of
    128 KiB blocks until all of it is in: a peer serving 30 streams over a 20 MB/s link sends one stream 0.1-0.6
    MB/s, and such a stream showed 0 bytes for over a second while bytes flowed, so the watchdog cut honest peers
    as tricklers (issue 38: most of the 431 cuts of a 16-node fill, and the origin reads that followed them)."""

    _fp = None  # sources.base.body_readinto reads through `readinto` below, never around it

    def __init__(self, resp: Any) -> None:
        self._resp = resp
        fp = getattr(resp, "_fp", None)
        self._body = fp if isinstance(fp, http.client.HTTPResponse) else None
        self._small = False  # the last receive brought less than GATHER_BYTES

    def readinto(self, view: memoryview) -> int:
        if self._body is None:
            return int(self._resp.readinto(view))
        if self._small and self._body.length:
            # let a burst's next packets gather in the kernel (see GATHER_S): one wake for several of them
            time.sleep(GATHER_S)
        data = self._body.read1(len(view))  # what one receive brought (http.client keeps the body's count)
        view[:len(data)] = data
        self._small = 0 < len(data) < min(GATHER_BYTES, len(view))
        return len(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._resp, name)


def _connect(conn: _HTTPConnection | _HTTPSConnection) -> socket.socket:
    """urllib3's HTTPConnection._new_conn, with the socket kept as the connection's `connecting` while it connects:
    a request's Pace shuts it down at the silence probe's verdict on the peer (Pace.cut), and the connect ends at
    once (reset), not at its timeout."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(conn._dns_host, conn.port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise urllib3.exceptions.NewConnectionError(conn, f"Failed to establish a new connection: {exc}") from exc
    try:
        for option in conn.socket_options or ():
            sock.setsockopt(*option)
        sock.settimeout(conn.timeout)
        conn.connecting = sock
        if (pace := _asking.pace) is not None and pace.down:  # its peer found down before it began (Pace.cut)
            raise TimeoutError("its peer was found down")
        sock.connect(addr)
    except TimeoutError as exc:
        sock.close()
        raise urllib3.exceptions.ConnectTimeoutError(
            conn, f"Connection to {conn.host} timed out. (connect timeout={conn.timeout})") from exc
    except OSError as exc:
        sock.close()
        raise urllib3.exceptions.NewConnectionError(conn, f"Failed to establish a new connection: {exc}") from exc
    finally:
        conn.connecting = None
    return sock


class _HTTPConnection(urllib3.connection.HTTPConnection):
    connecting: socket.socket | None = None  # its socket while it connects (_connect)

    def _new_conn(self) -> socket.socket:
        return _connect(self)


class _HTTPSConnection(urllib3.connection.HTTPSConnection):
    connecting: socket.socket | None = None

    def _new_conn(self) -> socket.socket:
        return _connect(self)


def _handed(conn: Any) -> Any:
    """A connection the pool hands this thread's request: whether it is a pooled one not found closed (a fresh
    one's `sock` is None until it connects; `_request` sends again only on a reused one), and this request's Pace
    watching it."""
    assert isinstance(conn, _HTTPConnection | _HTTPSConnection)  # always one of ours (ConnectionCls): for mypy
    _asking.reused = conn.sock is not None
    if (pace := _asking.pace) is not None:
        pace.attach(conn)
    return conn


class _HTTPPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _HTTPConnection

    def _get_conn(self, timeout: float | None = None) -> Any:
        return _handed(super()._get_conn(timeout))


class _HTTPSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _HTTPSConnection

    def _get_conn(self, timeout: float | None = None) -> Any:
        return _handed(super()._get_conn(timeout))
