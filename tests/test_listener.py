"""The daemon's TCP listener under slowloris and floods (raw sockets against a real daemon): half-sent requests
are cut at the header deadline, connections beyond the cap are closed at accept, the Unix-socket API keeps
answering throughout, and the log stays small."""

from __future__ import annotations

import asyncio
import io
import logging
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
import urllib3

from tests.faultproxy import FaultProxy
from tests.fixtures_daemon import RunningDaemon, start_daemon
from tests.fixtures_s3 import S3
from weightcache.daemon import app as daemon_app
from weightcache.listener import ConnectionLimits, GuardedTCPSite, RateLimitFilter

TOKEN = "s3cr3t-token-0123456789abcdef"
LIMITS = ConnectionLimits(max_connections=16, header_timeout_s=1.0, body_timeout_s=1.0, idle_timeout_s=3.0)
HELD_S = 600.0  # a header deadline that holds a flood open for the whole test
Listening = tuple[RunningDaemon, GuardedTCPSite, io.StringIO]  # the daemon, its TCP site, what it logged


@pytest.fixture
async def tcp_daemon(short_dir: Path, model_copy: Path,
                     monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Listening]:
    monkeypatch.setattr(daemon_app, "TCP_LIMITS", LIMITS)
    (short_dir / "token").write_text(TOKEN)
    d = await start_daemon(short_dir, model_copy, config={"tcp": {"port": 0, "tokenFile": str(short_dir / "token")}})
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    site = next(s for s in d.daemon._runner.sites if isinstance(s, GuardedTCPSite))  # type: ignore[union-attr]
    try:
        yield d, site, log
    finally:
        root.removeHandler(handler)
        await d.daemon.stop()


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def _read_until_closed(sock: socket.socket, deadline: float) -> bytes:
    sock.settimeout(max(0.1, deadline - time.monotonic()))
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def _request(port: int, raw: bytes, *, wait: float = 10.0) -> bytes:
    with _connect(port) as sock:
        sock.sendall(raw)
        return _read_until_closed(sock, time.monotonic() + wait)


def _authorized(method: str, path: str, body: bytes = b"", extra: str = "") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: d\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


async def test_slowloris_is_cut_and_the_unix_api_keeps_answering(
        tcp_daemon: Listening) -> None:
    """200 half-sent requests against a cap of 16: the first flood is held open (its connections carry a header
    deadline no test outlasts), so what answers the honest clients is the guard's cap and shedding, never a
    deadline that happened to fire; a second flood under the 1 s deadline then sheds the held ones and is cut."""
    d, site, log = tcp_daemon
    port = site.port

    def flood(n: int) -> list[socket.socket]:
        socks = []
        for _ in range(n):
            sock = _connect(port)
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: d\r\nX-Slow: ")  # headers never finish
            socks.append(sock)
        return socks

    site.limits = replace(LIMITS, header_timeout_s=HELD_S)  # read at each accept: the held flood's deadline
    held = await asyncio.to_thread(flood, 200)
    cut: list[socket.socket] = []
    try:
        await _eventually(lambda: site.stats.shed == 200 - LIMITS.max_connections)  # each accept seen
        assert await asyncio.to_thread(d.client.list) == []  # the Unix API answers while the flood holds the cap
        assert (site.stats.active, site.stats.refused, site.stats.header_timeouts) == (LIMITS.max_connections, 0, 0)
        # a whole request takes the slot of a half-sent one: the TCP API still serves during the attack
        reply = await asyncio.to_thread(_request, port, _authorized("GET", "/v1/models"))
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
        assert site.stats.shed == 200 - LIMITS.max_connections + 1 and site.stats.header_timeouts == 0

        # the second flood, under the 1 s header deadline, sheds the 15 still held (once the honest connection and
        # the shed ones' descriptors are gone, its first connection takes a free slot and none sheds its own kind)
        await _eventually(lambda: (site.stats.active, site.stats.closing) == (LIMITS.max_connections - 1, 0))
        site.limits = LIMITS
        cut = await asyncio.to_thread(flood, LIMITS.max_connections)
        deadline = time.monotonic() + 60  # a bound for a hang only: the cut is asserted by what each one got
        answers = await asyncio.gather(*(asyncio.to_thread(_read_until_closed, s, deadline) for s in held + cut))
        shed_answers, cut_answers = answers[:200], answers[200:]
        assert all(a == b"" or b"needed this connection's slot" in a for a in shed_answers)  # closed, none served
        assert all(a == b"" or b"the request's headers did not arrive within 1s" in a for a in cut_answers)
        assert any(b"the request's headers did not arrive within 1s" in a for a in cut_answers)
        # each half-sent connection was closed exactly once, for its one reason: the held ones shed, the rest cut
        assert (site.stats.shed, site.stats.refused, site.stats.header_timeouts) == (200, 0, LIMITS.max_connections)
    finally:
        for sock in held + cut:
            sock.close()
    await _eventually(lambda: site.stats.active == 0)
    reply = await asyncio.to_thread(_request, port, _authorized("GET", "/v1/models"))  # the listener recovered
    assert reply.startswith(b"HTTP/1.1 200")
    assert len(log.getvalue()) < 20_000, f"{len(log.getvalue())} bytes of log for one flood"


async def test_a_body_that_never_arrives_is_cut(tcp_daemon: Listening) -> None:
    _, site, _ = tcp_daemon
    raw = _authorized("PUT", "/v1/models", b'{"uri": "s3://models/x/"}')
    reply = await asyncio.to_thread(_request, site.port, raw[:-10])  # ten body bytes short
    assert reply.startswith(b"HTTP/1.1 408") and b"the request's body did not arrive within 1s" in reply
    assert site.stats.body_timeouts == 1  # cut by the body deadline (the 10 s read above only bounds a hang)


async def test_whole_requests_pipelined_chunked_and_kept_alive_are_served(
        tcp_daemon: Listening) -> None:
    _, site, _ = tcp_daemon
    body = b'{"holder": "h1", "uri": "s3://models/never-fetched/"}'
    chunked = (f"POST /v1/leases HTTP/1.1\r\nHost: d\r\nAuthorization: Bearer {TOKEN}\r\n"
               f"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n").encode() + \
        f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    reply = await asyncio.to_thread(_request, site.port, chunked)
    assert reply.startswith(b"HTTP/1.1 404") and b"not_cached" in reply  # read whole, answered, not cut

    keep = _authorized("GET", "/healthz").replace(b"Connection: close", b"Connection: keep-alive")

    def idle_then_again() -> tuple[bytes, bytes]:
        with _connect(site.port) as sock:
            sock.sendall(keep + keep)  # two requests in one write
            time.sleep(LIMITS.header_timeout_s * 1.5)  # idle between requests is not a header timeout
            first = sock.recv(65536)
            sock.sendall(_authorized("GET", "/healthz"))
            return first, _read_until_closed(sock, time.monotonic() + 10)

    first, last = await asyncio.to_thread(idle_then_again)
    assert first.count(b"HTTP/1.1 200") == 2 and last.startswith(b"HTTP/1.1 200")
    assert site.stats.header_timeouts == 0 and site.stats.body_timeouts == 0

    def idle_too_long() -> float:
        with _connect(site.port) as sock:
            sock.sendall(keep)
            sock.recv(65536)
            started = time.monotonic()
            _read_until_closed(sock, started + LIMITS.idle_timeout_s + 10)
            return time.monotonic() - started

    assert await asyncio.to_thread(idle_too_long) < LIMITS.idle_timeout_s + 5  # aiohttp's keep-alive closes it


def test_the_rate_limit_keeps_a_burst_and_counts_what_it_dropped() -> None:
    now = [0.0]  # the filter's clock: the window ends when the test says, however long 1000 records take to log
    rate = RateLimitFilter(burst=3, window_s=0.2, clock=lambda: now[0])
    out = io.StringIO()
    logger = logging.getLogger("test_listener.rate")
    handler = logging.StreamHandler(out)
    logger.addHandler(handler)
    logger.addFilter(rate)
    logger.propagate = False
    try:
        for i in range(1000):
            logger.error("socket.accept() failed: %s", i)
        logger.error("another message")
        now[0] = 0.19
        logger.error("socket.accept() failed: %s", "still in the window")
        now[0] = 0.2
        logger.error("socket.accept() failed: %s", "again")
    finally:
        logger.removeHandler(handler)
        logger.removeFilter(rate)
    lines = out.getvalue().splitlines()
    assert lines[:3] == [f"socket.accept() failed: {i}" for i in range(3)]
    assert lines[3] == "another message"
    assert lines[4] == "socket.accept() failed: again [998 similar messages dropped in the last 0s]"
    assert len(lines) == 5


async def _eventually(check: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def test_a_streaming_ensure_longer_than_every_timeout_is_never_cut(
        short_dir: Path, model_copy: Path, s3: S3, fault_proxy: FaultProxy,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon_app, "TCP_LIMITS", ConnectionLimits(max_connections=4, header_timeout_s=0.5,
                                                          body_timeout_s=0.5, idle_timeout_s=0.5))
    s3.upload_dir(model_copy, "models", "tiny/")
    fault_proxy.add("delay", seconds=0.4, method="GET", ranged_only=True, count=-1)
    (short_dir / "token").write_text(TOKEN)
    d = await start_daemon(short_dir, model_copy, config={
        "tcp": {"port": 0, "tokenFile": str(short_dir / "token")}, "concurrency": 1, "chunkSize": "64Ki",
        "endpoints": {"s3": {"endpointUrl": fault_proxy.endpoint_url}}})
    try:
        body = b'{"uri": "s3://models/tiny/"}'
        started = time.monotonic()
        reply = await asyncio.to_thread(_request, d.daemon.tcp_port or 0,
                                        _authorized("PUT", "/v1/models?wait=1", body), wait=120)
        took = time.monotonic() - started
    finally:
        await d.daemon.stop()
    assert took > 2.0, "the download was meant to outlast every timeout of the listener"
    assert reply.startswith(b"HTTP/1.1 200") and b'{"snapshot": ' in reply, reply[-300:]


async def test_one_timer_per_connection_still_cuts_the_next_requests_headers_at_their_deadline() -> None:
    """The guard keeps one deadline timer per connection: after a request whose body had a long deadline, the
    next request's half-sent headers are cut at the (shorter) header deadline, not when the body's would have."""
    from aiohttp import web

    from weightcache.listener import _body_framing

    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    app = web.Application()
    app.router.add_post("/e", echo)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=30)
    await runner.setup()
    site = GuardedTCPSite(runner, "127.0.0.1", 0, limits=ConnectionLimits(4, header_timeout_s=0.5, body_timeout_s=5.0,
                                                                 idle_timeout_s=30))
    await site.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
        for _ in range(3):  # keep-alive requests with bodies: each arms the header then the body deadline
            writer.write(b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200") and await reader.readexactly(5) == b"hello"
        writer.write(b"POST /e HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 30)  # a deadline for a hang only: which cut is counted
        assert answer.startswith(b"HTTP/1.1 408") and b"headers did not arrive within 0.5s" in answer
        assert site.stats.header_timeouts == 1 and site.stats.body_timeouts == 0, "cut at the header deadline"
        writer.close()
    finally:
        await runner.cleanup()
    head = b"post /m http/1.1\r\nhost: x\r\ncontent-length : 12\r\nx-content-length: 99\r\ntransfer-encoding: gzip"
    assert _body_framing(head) == (12, False)
    assert _body_framing(b"post / http/1.1\r\ntransfer-encoding: gzip, chunked\r\ncontent-length: 3") == (0, True)
    assert _body_framing(b"get / http/1.1\r\ncontent-length: x1") == (0, False)


async def test_at_its_cap_idle_keep_alive_connections_are_closed_silently_before_a_half_sent_one_is_shed() -> None:
    """At the cap a new connection takes the slot of the connection idle between requests the longest, closed
    without a 408 (a pooled client's next request goes out on a new connection: urllib3 finds it closed before it
    sends); a half-sent request is shed (408) only once no connection is idle, and a connection whose request is
    being answered is never touched. Before, an idle keep-alive connection held its slot like a request being
    answered: the new connection took the half-sent one's slot, and at a cap of idle ones it was refused (reset
    at accept) (docs/peers.md, "Session 55")."""
    from aiohttp import web

    release = asyncio.Event()
    holding: list[web.Request] = []

    async def quick(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def held(request: web.Request) -> web.Response:
        holding.append(request)
        await release.wait()
        return web.Response(text="done")

    app = web.Application()
    app.router.add_get("/", quick)
    app.router.add_get("/held", held)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=HELD_S)
    await runner.setup()
    site = GuardedTCPSite(runner, "127.0.0.1", 0, limits=ConnectionLimits(4, header_timeout_s=HELD_S,
                                                                 body_timeout_s=HELD_S, idle_timeout_s=HELD_S))
    await site.start()
    keep = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    hold = b"GET /held HTTP/1.1\r\nHost: x\r\n\r\n"
    pool = urllib3.PoolManager(retries=False, timeout=10, maxsize=1)  # a pooled client, as peers/client.py's
    url = f"http://127.0.0.1:{site.port}/"
    socks: list[socket.socket] = []

    def connect(raw: bytes, *, answered: bool) -> socket.socket:
        sock = _connect(site.port)
        socks.append(sock)
        sock.sendall(raw)
        if answered:
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        return sock

    def served() -> bytes:  # a new connection's whole request, at the cap
        return _request(site.port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")

    def closed_silently(sock: socket.socket) -> bool:
        return _read_until_closed(sock, time.monotonic() + 5) == b""

    def untouched(sock: socket.socket) -> bool:  # open, nothing sent to it
        sock.setblocking(False)
        try:
            sock.recv(1)
        except BlockingIOError:
            return True
        finally:
            sock.setblocking(True)
        return False

    try:
        assert (await asyncio.to_thread(pool.request, "GET", url)).status == 200  # pooled: idle the longest
        idle = await asyncio.to_thread(connect, keep, answered=True)  # idle, answered after the pool's
        slow = await asyncio.to_thread(connect, b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ", answered=False)
        await asyncio.to_thread(connect, hold, answered=False)  # being answered
        await _eventually(lambda: site.stats.active == 4 and len(holding) == 1)  # its request read

        assert (await asyncio.to_thread(served)).startswith(b"HTTP/1.1 200")  # in the pooled one's slot
        assert untouched(slow) and untouched(idle)
        assert (site.stats.idle_closed, site.stats.shed, site.stats.refused) == (1, 0, 0)
        await _eventually(lambda: site.stats.active == 3)  # the served one closed (Connection: close)
        again = await asyncio.to_thread(pool.request, "GET", url)  # found closed before it was sent: a new one
        assert again.status == 200 and again.data == b"ok"
        assert (await asyncio.to_thread(served)).startswith(b"HTTP/1.1 200")  # in the raw idle one's slot:
        assert await asyncio.to_thread(closed_silently, idle)  # no 408, as an idle connection may be closed
        assert (site.stats.idle_closed, site.stats.shed, site.stats.refused) == (2, 0, 0)
        await _eventually(lambda: site.stats.active == 3)
        await asyncio.to_thread(connect, hold, answered=False)
        await asyncio.to_thread(connect, hold, answered=False)  # in the pool's second connection's slot
        await _eventually(lambda: (site.stats.idle_closed, site.stats.shed, site.stats.refused) == (3, 0, 0))

        # none idle now: the half-sent request is shed, then a connection is refused at accept
        assert (await asyncio.to_thread(served)).startswith(b"HTTP/1.1 200")
        shed = await asyncio.to_thread(_read_until_closed, slow, time.monotonic() + 5)
        assert shed.startswith(b"HTTP/1.1 408") and b"needed this connection's slot" in shed
        assert (site.stats.idle_closed, site.stats.shed, site.stats.refused) == (3, 1, 0)
        await _eventually(lambda: (site.stats.active, site.stats.closing) == (3, 0))
        await asyncio.to_thread(connect, hold, answered=False)
        await _eventually(lambda: site.stats.active == 4)
        assert await asyncio.to_thread(served) == b"" and site.stats.refused == 1  # reset at accept

        release.set()  # the four answered, kept alive: idle, so the pool's next request takes one's slot
        await _eventually(lambda: site.stats.idle() is not None)
        assert (await asyncio.to_thread(pool.request, "GET", url)).status == 200
        assert (site.stats.idle_closed, site.stats.shed, site.stats.refused) == (4, 1, 1)
    finally:
        release.set()
        pool.clear()
        for sock in socks:
            sock.close()
        await runner.cleanup()
