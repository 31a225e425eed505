"""The guarded TCP site every listener of the project uses, safe to expose inside a cluster (any pod can open
connections to it). Foundation, beside unixsock: the daemon, the peer server and the webhook all import it.

aiohttp alone keeps a connection that trickles a request's headers open for an hour and accepts every
connection the kernel hands it: a few hundred half-sent requests (slowloris) exhaust the process's file
descriptors, and then the Unix-socket API, CSI and the store's own files fail too. Each TCP connection here is
wrapped in a guard that:

- holds at most `max_connections` at once. At the cap a new connection takes the slot of, in this order: the
  connection idle between requests the longest (its last request answered whole, nothing of the answer left to
  send, no byte of a next request received), closed without a word; else the oldest one still waiting for its
  request headers (a half-sent request loses its slot to a client that sends whole requests), answered 408; and
  it is closed at accept only when every slot holds a request being read or answered (the fd is freed at once).
  RFC 9112 lets a server close an idle persistent connection at any time, and a client retries an idempotent
  request on a connection closed before any byte of its answer (urllib3 reconnects a pooled connection found
  closed before it sends; `peers/client.py` `PeerClient._request` sends again the one that raced the close).
  Before, an idle connection held its slot like a request being answered: a pool of them filled the cap, and new
  connections were refused, or shed one another (408) before their requests were read (docs/peers.md, "Session
  55");
- closes a connection whose request headers are not complete `header_timeout_s` after it connected or after
  the first byte of its next request (with a 408 saying so), and one whose body (Content-Length or chunked) is
  not complete `body_timeout_s` after its headers; a connection waiting for its answer is never cut (a
  streaming ensure lasts hours), and one idle between requests is closed by aiohttp after `idle_timeout_s`
  (the runner's keep-alive timeout: `ConnectionLimits.runner_args`);
- logs what it refused at most once per `LOG_EVERY_S`, with counts, and rate-limits the error logs of asyncio,
  aiohttp and the API (`RateLimitFilter`): a flood of bad connections costs kilobytes of log, not megabytes.

The guard reads request framing only (end of headers, Content-Length, chunked's last chunk); parsing stays
aiohttp's. Requests on the Unix socket do not pass through it (its file mode already limits who connects).

Every TCP listener of the project is one of these sites (daemon API, metrics port, peer listener, webhook): a
listener without it is the one a flood goes for. With `ssl_context` (the webhook) the guard holds the slot from
the TCP accept: the TLS handshake runs inside it (`loop.start_tls`) and counts against the header deadline, so
connections that never finish a handshake are shed and cut like half-sent headers (asyncio alone would let each
hold a descriptor for its 60 s handshake timeout, uncounted).

A connection the guard sheds or cuts is aborted (its 408 written first where there is one), never shut down:
`close()` on a TLS transport sends close_notify and holds the descriptor until the client answers or asyncio's
30 s shutdown timeout, so 700 half-sent TLS clients that never read kept a webhook under `ulimit -n 512` at its
last descriptor (and a fresh handshake failed). The descriptors of aborted connections are counted (`closing`)
until asyncio has closed them; a TLS shutdown that aiohttp itself starts (keep-alive timeout, `Connection:
close`) waits at most `tls_shutdown_timeout_s` and holds its slot until the descriptor is gone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger(__name__)

LOG_EVERY_S = 10.0
MAX_HEADER_BYTES = 64 * 1024  # aiohttp answers 400 to longer header lines; the guard only bounds its own buffer
NOISY_LOGGERS = ("asyncio", "aiohttp.server", "aiohttp.web", "aiohttp.access", "weightcache.daemon.api", __name__)


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 64
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 15.0
    tls_shutdown_timeout_s: float = 2.0  # a client answers close_notify in one round trip; asyncio waits 30 s
    # > 0: the kernel hands over a connection only once its first bytes came (or this many seconds passed:
    # TCP_DEFER_ACCEPT, Linux). A connect closed unused (the peers' silence probe: client.reachable) then never
    # reaches the process: at N = 32 each daemon accepted ~1,100 of them a fill, an aiohttp protocol set up and
    # torn down for each (8 % of its event loop, docs/peers.md "Less CPU a byte")
    defer_accept_s: int = 0

    def runner_args(self) -> dict[str, Any]:
        """aiohttp runner arguments: its keep-alive timeout closes connections idle between requests (it never
        fires while a request is being answered)."""
        return {"keepalive_timeout": self.idle_timeout_s}


@dataclass
class GuardStats:
    """What the guard did; `active` is the number of open TCP connections it admitted."""

    active: int = 0
    accepted: int = 0  # connections the kernel handed over, all told
    closing: int = 0  # connections the guard aborted whose descriptor asyncio has not closed yet
    refused: int = 0
    idle_closed: int = 0  # connections idle between requests closed (silently) to make room for a new connection
    shed: int = 0  # connections waiting for their request (half-sent) closed, with a 408, to make room for one
    header_timeouts: int = 0
    body_timeouts: int = 0
    handshake_failures: int = 0  # TLS handshakes that failed (bad client, plain HTTP on a TLS port)
    waiting: dict[_Guard, None] = field(default_factory=dict)  # connections reading headers, oldest first
    # connections whose last request is read (being answered, or idle once answered), the earliest request first
    answered: dict[_Guard, None] = field(default_factory=dict)
    _logged: dict[str, int] = field(default_factory=dict)
    _last_log: float = 0.0

    def idle(self) -> _Guard | None:
        """The connection idle between requests whose last request came first, None when there is none."""
        return next((c for c in self.answered if c.idle()), None)

    def note(self) -> None:
        """Log the counters when they moved, at most once per LOG_EVERY_S."""
        now = time.monotonic()
        counts = {"refused (connection cap)": self.refused,
                  "idle keep-alive connections closed for new connections": self.idle_closed,
                  "half-sent requests shed for new connections": self.shed,
                  "header timeouts": self.header_timeouts, "body timeouts": self.body_timeouts,
                  "failed TLS handshakes": self.handshake_failures}
        if now - self._last_log < LOG_EVERY_S or counts == self._logged:
            return
        moved = {k: v - self._logged.get(k, 0) for k, v in counts.items() if v != self._logged.get(k, 0)}
        self._logged, self._last_log = counts, now
        log.warning("TCP listener closed connections: %s (%d open); a client is too slow or too many "
                    "connect at once", ", ".join(f"{n} {k}" for k, n in moved.items()), self.active)


class _Guard(asyncio.Protocol):
    """One TCP connection: forwards everything to aiohttp's protocol, enforcing the header and body deadlines.
    With `tls`, it is first the raw connection (slot, deadline), then the plaintext protocol of the TLS transport
    that `start_tls` builds on it."""

    def __init__(self, inner: RequestHandler, limits: ConnectionLimits, stats: GuardStats,
                 tls: ssl.SSLContext | None = None) -> None:
        self._inner = inner
        self._limits = limits
        self._stats = stats
        self._tls = tls
        self._transport: asyncio.Transport | None = None  # the raw one, then (TLS) the plaintext one
        self._admitted = False  # forwarded to aiohttp
        self._handshake: asyncio.Task[None] | None = None  # TLS: runs until aiohttp has the connection
        self._early: list[bytes] = []  # TLS: plaintext that arrived with the handshake's last flight
        self._early_eof = False
        self._counted = False  # holds one of the `max_connections` slots
        self._closing = False  # aborted by the guard, counted in `stats.closing` until its descriptor is gone
        self._timer: asyncio.TimerHandle | None = None  # fires at or before `_deadline`; rearmed lazily
        self._deadline: float | None = None  # loop time when the current phase (`_what`) must be complete
        self._what = "header"
        self._state = "head"  # head: reading headers; body: reading a body; wait: request read, answer pending
        self._head = bytearray()
        self._remaining = 0  # body bytes still to come (Content-Length)
        self._chunked_tail = b""  # chunked bodies end with 0\r\n\r\n

    # -- asyncio.Protocol ---------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._stats.accepted += 1
        if self._stats.active + self._stats.closing >= self._limits.max_connections:  # descriptors, not slots
            if (idle := self._stats.idle()) is not None:  # free to close (RFC 9112 9.8): no 408, no failure
                self._stats.idle_closed += 1
                self._stats.note()
                idle._close("idle")
            elif (victim := next(iter(self._stats.waiting), None)) is not None:
                self._stats.shed += 1
                victim._close("shed")
            else:  # every slot holds a request being read or answered
                self._stats.refused += 1
                self._stats.note()
                transport.abort()
                return
        self._counted = True
        self._stats.active += 1
        self._arm(self._limits.header_timeout_s, "header")  # with TLS it covers the handshake too
        if self._tls is None:
            self._open(transport)
        else:  # no byte may reach this protocol before start_tls puts TLS in between (it resumes reading)
            transport.pause_reading()
            self._handshake = asyncio.get_running_loop().create_task(self._start_tls(transport, self._tls))

    async def _start_tls(self, raw: asyncio.Transport, context: ssl.SSLContext) -> None:
        try:
            plain = await asyncio.get_running_loop().start_tls(
                raw, self, context, server_side=True, ssl_handshake_timeout=self._limits.header_timeout_s,
                ssl_shutdown_timeout=self._limits.tls_shutdown_timeout_s)
        except OSError:  # ssl.SSLError, a reset, the handshake timeout: the client's problem, counted and quiet
            if self._counted:
                self._stats.handshake_failures += 1
                self._stats.note()
            plain = None
        if plain is None or not self._counted:  # failed, or shed or timed out (we closed it) meanwhile
            self._stop_timer()
            self._release()
            raw.abort()
            self._gone()  # the SSL protocol never hands this one's connection_lost to us
            return
        self._open(plain)
        for data in self._early:
            self._inner.data_received(data)
        self._early.clear()
        if self._early_eof:
            self._inner.eof_received()

    def _open(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._admitted = True
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._counted:
            return
        self._frame(data)
        if self._admitted:
            self._inner.data_received(data)
        else:  # TLS: the request came with the handshake, before start_tls returned the transport
            self._early.append(data)

    def eof_received(self) -> bool | None:
        if not self._admitted:  # TLS: handed to aiohttp with the early data
            self._early_eof = True
            return None
        self._inner.eof_received()  # aiohttp's answer is always None: the transport closes at EOF
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        self._release()
        self._gone()
        if self._admitted:
            self._admitted = False
            self._inner.connection_lost(exc)

    def _release(self, *, closing: bool = False) -> None:
        """Give the slot back (at once when shed: the new connection takes it before the old one is gone; with
        `closing`, its descriptor stays counted until `_gone`)."""
        self._stats.waiting.pop(self, None)
        self._stats.answered.pop(self, None)
        if self._counted:
            self._counted = False
            self._stats.active -= 1
        if closing and not self._closing:
            self._closing = True
            self._stats.closing += 1

    def _gone(self) -> None:
        if self._closing:
            self._closing = False
            self._stats.closing -= 1

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    # -- framing ------------------------------------------------------------------------------------------------
    def _frame(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self._state == "wait":  # the next request starts: its headers have their own deadline
                self._state = "head"
                self._arm(self._limits.header_timeout_s, "header")
            if self._state == "head":
                view = self._read_head(view)
            elif self._remaining:
                used = min(self._remaining, len(view))
                self._remaining -= used
                view = view[used:]
                if not self._remaining:
                    self._request_read()
            else:  # chunked: the body ends at the zero-length chunk
                tail = self._chunked_tail + bytes(view)
                end = tail.find(b"0\r\n\r\n")
                if end < 0:
                    self._chunked_tail = tail[-4:]
                    return
                view = view[max(0, end + 5 - len(self._chunked_tail)):]
                self._chunked_tail = b""
                self._request_read()

    def _read_head(self, view: memoryview) -> memoryview:
        start = max(0, len(self._head) - 3)
        self._head += view
        end = self._head.find(b"\r\n\r\n", start)
        if end < 0:
            if len(self._head) > MAX_HEADER_BYTES:  # aiohttp refuses it; keep our buffer bounded meanwhile
                del self._head[: len(self._head) - 3]
            return view[len(view):]
        rest = len(self._head) - (end + 4)
        head = bytes(self._head[:end]).lower()
        self._head.clear()
        length, chunked = _body_framing(head)
        if chunked or length:
            self._state, self._remaining = "body", length
            self._arm(self._limits.body_timeout_s, "body")
        else:
            self._request_read()
        return view[len(view) - rest:]

    def _request_read(self) -> None:
        self._state = "wait"
        self._disarm()
        self._stats.answered[self] = None  # after the others: the connections' requests in the order they came

    def idle(self) -> bool:
        """Idle between requests: a request read (`wait`) and answered whole, aiohttp waiting for the next one
        (its handler awaits `_waiter` then, and only then: the answer's write_eof is done and no request is
        queued), nothing of the answer left in the transport's buffer, and no byte of a next request received (a
        byte makes the state `head`). The one look at aiohttp's internals (its own keep-alive timeout reads the
        same, `_process_keepalive`): an aiohttp release without `_waiter` fails mypy here, and
        tests/test_listener.py's test of idle connections with it."""
        if self._state != "wait" or self._transport is None or self._transport.is_closing():
            return False
        waiter = self._inner._waiter  # typed in aiohttp (mypy checks it is there), private: see above
        return waiter is not None and not waiter.done() and self._transport.get_write_buffer_size() == 0

    # -- deadlines ----------------------------------------------------------------------------------------------
    # One timer per connection, not one per phase: arming moves `_deadline`, disarming clears it, and the timer
    # (set for the earliest deadline it has to cover) checks when it fires whether its deadline still stands. A
    # keep-alive connection serving many small requests pays for a timer about once per deadline, not twice per
    # request (a call_later and a cancel for the headers, the same for the body).
    def _arm(self, seconds: float, what: str) -> None:
        self._stats.waiting.pop(self, None)
        self._stats.answered.pop(self, None)
        loop = asyncio.get_running_loop()
        self._deadline, self._what = loop.time() + seconds, what
        if self._timer is not None and self._timer.when() > self._deadline:
            self._timer.cancel()
            self._timer = None
        if self._timer is None:
            self._timer = loop.call_at(self._deadline, self._expire)
        if what == "header":
            self._stats.waiting[self] = None

    def _disarm(self) -> None:
        self._stats.waiting.pop(self, None)
        self._deadline = None  # the timer stays; when it fires it finds no deadline, or a later one to wait for

    def _stop_timer(self) -> None:
        self._disarm()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        deadline, what = self._deadline, self._what
        if deadline is None or not self._counted:
            return
        loop = asyncio.get_running_loop()
        if loop.time() < deadline:  # the phase moved on (or a new one began) since this timer was set
            self._timer = loop.call_at(deadline, self._expire)
            return
        self._deadline = None
        if what == "header":
            self._stats.header_timeouts += 1
        else:
            self._stats.body_timeouts += 1
        self._stats.note()
        self._close(what)

    def _close(self, what: str) -> None:
        """Answer 408 and abort (`what`: header, body or shed; idle: abort without a word, a connection idle
        between requests); the slot is free at once, the descriptor within one turn of the loop (no TLS shutdown,
        no wait for a client that does not read)."""
        self._stop_timer()
        transport = self._transport
        if transport is None or transport.is_closing():
            self._release()
            return
        self._release(closing=True)
        if self._admitted and what != "idle":  # mid-handshake there is no TLS to answer over yet
            transport.write(self._timeout_answer(what))  # sent at once where the socket takes it, else dropped
        transport.abort()

    def _timeout_answer(self, what: str) -> bytes:
        why = {"header": f"the request's headers did not arrive within {self._limits.header_timeout_s:g}s",
               "body": f"the request's body did not arrive within {self._limits.body_timeout_s:g}s",
               "shed": "the listener needed this connection's slot while its request headers were incomplete"}[what]
        message = json.dumps({"error": "request_timeout", "message": f"{why}; send the whole request at once"}).encode()
        return (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\n"
                b"Content-Length: " + str(len(message)).encode() + b"\r\n\r\n" + message)


_FRAMING = re.compile(rb"\r\n[ \t]*(content-length|transfer-encoding)[ \t]*:([^\r]*)")


def _body_framing(head: bytes) -> tuple[int, bool]:
    """(Content-Length, chunked) from lower-cased header bytes (the request line first); a malformed length
    counts as none (aiohttp answers it with 400). Only the two framing headers are looked at (a scan, not a
    split of every header line)."""
    length, chunked = 0, False
    for name, value in _FRAMING.findall(head):
        value = value.strip()
        if name == b"content-length" and value.isdigit():
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value:
            chunked = True
    return (0, True) if chunked else (length, False)


class GuardedTCPSite(web.BaseSite):
    """A TCPSite whose connections pass through the guard; `stats` says what it refused."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, limits: ConnectionLimits | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        super().__init__(runner)
        self._host, self._port = host, port
        self._tls = ssl_context
        self.limits = limits or ConnectionLimits()
        self.stats = GuardStats()
        self.port = 0

    @property
    def name(self) -> str:
        return f"{'https' if self._tls else 'http'}://{self._host}:{self.port or self._port}"

    async def start(self) -> None:
        await super().start()
        inner = self._runner.server
        assert inner is not None
        install_log_rate_limits()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Guard(inner(), self.limits, self.stats, self._tls),
                                                self._host,
                                                self._port, backlog=self._backlog, reuse_address=True)
        sock: socket.socket = self._server.sockets[0]
        self.port = sock.getsockname()[1]
        if self.limits.defer_accept_s and hasattr(socket, "TCP_DEFER_ACCEPT"):  # Linux; elsewhere accepted at once
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, int(self.limits.defer_accept_s))


class RateLimitFilter(logging.Filter):
    """At most `burst` records per (logger, message template) per `window_s`; the first record after a quiet
    spell says how many were dropped."""

    def __init__(self, burst: int = 5, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.burst, self.window_s = burst, window_s
        self._clock = clock  # a test's own clock decides when a window ends, not how fast it can log
        self._seen: dict[tuple[str, str], list[float]] = {}  # key -> [window start, count, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg)[:200])
        now = self._clock()
        entry = self._seen.get(key)
        if entry is None or now - entry[0] >= self.window_s:
            dropped = int(entry[2]) if entry is not None else 0
            self._seen[key] = [now, 1, 0]
            if len(self._seen) > 1000:  # bounded: forget the oldest keys
                for old in sorted(self._seen, key=lambda k: self._seen[k][0])[:500]:
                    del self._seen[old]
            if dropped:
                record.msg = f"{record.msg} [{dropped} similar messages dropped in the last {self.window_s:.0f}s]"
            return True
        entry[1] += 1
        if entry[1] <= self.burst:
            return True
        entry[2] += 1
        return False


_FILTER = RateLimitFilter()


def install_log_rate_limits() -> None:
    """Put the one rate limit on the loggers a hostile client can make talk (idempotent)."""
    for name in NOISY_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
