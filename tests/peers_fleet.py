"""Test and benchmark helper: nodes of a fleet on 127.0.0.1, each with its own store root and a real peer server.

    with Fleet(tmp_path, token) as fleet:
        a = fleet.node("a")                      # store at tmp_path/a, peer server on 127.0.0.1:0
        b = fleet.node("b", peers=[a.url])
        b.fetcher(endpoint_url=proxy.endpoint_url).ensure(admin(ref))

Each peer server runs on its own event loop thread, as in the daemon (the fetch engine's threads never share it).
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from tests.faultproxy import FaultProxy
from weightcache.fetch import Fetcher
from weightcache.peers import PeerClient, PeerSet
from weightcache.peers.inflight import InFlight
from weightcache.peers.server import PeerLimits, PeerServer
from weightcache.store import Store


@dataclass
class FleetNode:
    name: str
    store: Store
    server: PeerServer
    url: str
    peers: PeerSet
    fetchers: list[Fetcher] = field(default_factory=list)

    def fetcher(self, **options: object) -> Fetcher:
        f = Fetcher(self.store, peers=self.peers, **options)  # type: ignore[arg-type]
        self.fetchers.append(f)
        return f


class Fleet:
    """Nodes sharing one event loop thread for their peer servers."""

    def __init__(self, root: Path, token: bytes, limits: PeerLimits | None = None) -> None:
        self.root, self.token = root, token
        # every test node is 127.0.0.1, one "peer" to the others: no per-peer stream cap, no budget shared by peers
        self.limits = limits or PeerLimits(max_streams=64, stream_budget=0)
        self.nodes: list[FleetNode] = []
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="peer-servers", daemon=True)
        self._thread.start()

    def run(self, coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)  # type: ignore[arg-type]

    def node(self, name: str, peers: Sequence[str] = ()) -> FleetNode:
        store = Store(self.root / name)
        inflight = InFlight()
        server = PeerServer(store.layout.blobs, self.token, self.limits, inflight)
        port = self.run(server.start("127.0.0.1", 0))
        url = f"http://127.0.0.1:{port}"
        node = FleetNode(name, store, server, url, self._peer_set(peers, inflight, url))
        self.nodes.append(node)
        return node

    def connect(self, node: FleetNode, peers: Sequence[str]) -> None:
        """Give a node its peer list after the fact (nodes of one wave list each other)."""
        node.peers.close()
        node.peers = self._peer_set(peers, node.peers.inflight, node.url)

    def _peer_set(self, peers: Sequence[str], inflight: InFlight, url: str) -> PeerSet:
        clients = [PeerClient(u, self.token, connect_timeout=2.0, read_timeout=5.0) for u in peers]
        return PeerSet(clients, inflight=inflight, self_url=url)

    def stop(self, node: FleetNode) -> None:
        """Stop a node's peer server (bodies being sent may finish)."""
        self.run(node.server.stop())

    def restart(self, node: FleetNode) -> None:
        """A stopped node's peer server listens on its port again (its daemon restarted; its link back)."""
        node.server = PeerServer(node.store.layout.blobs, self.token, self.limits, node.peers.inflight)
        self.run(node.server.start("127.0.0.1", int(node.url.rsplit(":", 1)[1])))

    def kill(self, node: FleetNode) -> None:
        """A node's peer server dies: every connection is cut at once (bodies mid-way included), then it stops."""
        async def cut() -> None:
            runner = node.server._runner  # a crash is not part of the server's API
            if runner is not None and runner.server is not None:
                for conn in runner.server.connections:
                    if conn.transport is not None:
                        conn.transport.abort()
            await node.server.stop()

        self.run(cut())

    def close(self) -> None:
        for n in self.nodes:
            for f in n.fetchers:
                f.close()
            n.peers.close()
            self.run(n.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def origin_bytes(proxy: FaultProxy, prefix: str) -> int:
    """Body bytes the origin sent for ranged GETs under `prefix` (the fetch engine always asks for ranges;
    listings and HEADs carry no model bytes)."""
    total = 0
    for r in proxy.requests_for("GET", prefix):
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", r.range or "")
        if m is None:
            raise AssertionError(f"a GET of {r.path} without a byte range ({r.range!r}): bytes not counted")
        total += int(m[2]) - int(m[1]) + 1
    return total



class HostilePeer:
    """A peer server that lies in the ways a hostile node can, on a real socket (127.0.0.1, one thread per
    connection): it says it holds every blob in `sizes` (HEAD: 200 and the listed size), and answers a GET
    with `mode`:

        "trickle-body"     a correct 206 head, then the right bytes one every `every_s` seconds
        "trickle-headers"  the status line and headers one byte every `every_s` seconds
        "huge-range"       a 206 whose Content-Range holds 5,000-digit numbers (int() refuses them)
        "honest"           a correct 206 with the right bytes at once
        "shed-first"       its first GET answered as our listener sheds a connection at its cap (408, Connection:
                           close: listener `_close`), the rest as "honest"
        "paced"            a correct 206, then the right bytes at `rate` bytes a second (a busy honest peer's share)
        "planning"         every HEAD and GET of a blob: 404 `X-Weightcache-Planning: 1` ("about to fetch it"), for ever
        "relay-then-cut"   HEAD: downloading it (`X-Weightcache-Partial: 1`, a relay); GET: a correct 206 head and
                           the range's first 256 KiB, then nothing; `cut()` then refuses every new connection while
                           the streams stay open and silent (a node whose link is cut: no handshake completes)
        "relay-pause"      a live relay waiting on its origin pieces: HEAD as "relay-then-cut"; GET: a correct 206
                           head, the range's first 256 KiB, then for `silent_s` nothing, then the rest
        "relay-slow-missing"  a relay that lacks the range: HEAD as "relay-then-cut"; GET: after `every_s`, a 404
                           that says it downloads the blob (`X-Weightcache-Partial: 1`: "missing")
        "relay-full-link"  a live relay behind a full link: as "relay-pause", its head sent after `every_s` (answers
                           take that long), and while it is silent no handshake completes (its listener's queue
                           full: the kernel drops every SYN)

    A digest request (`?digests=`, server.PeerServer._digests) is answered 200 with `digests` as its JSON body
    when given (a malformed or oversized answer); with `old_release`, as a daemon from before `?digests=` answers
    it (a plain GET: the whole blob, 200, application/octet-stream); else 404. `requests` counts the GETs it
    answered, `connections` the connections it accepted (a silence probe is one); `close()` stops every
    connection at once. `streams`: each body's head says the peer sends that many
    bodies now (X-Weightcache-Streams, as PeerServer._stream does). `closes`: each body's head says Connection: close
    (as PeerServer._stream's of a claim it follows: a body that may end short). `not_yet_from`: a GET of a range
    from this byte on is answered "not yet, in 3 s" (it reads those bytes from the origin now), whatever the mode.
    `head_s`: each HEAD is answered after this long (its answers take that). `close_on`: each connection's request
    of that number (1: its first) is read and the connection closed without a byte of answer (`closed` counts
    them): with 2, a pooled connection that our listener at its cap closed as idle while an ask was on its way."""

    def __init__(self, sizes: dict[str, int], bodies: dict[str, bytes], mode: str, every_s: float = 2.0,
                 digests: bytes | None = None, old_release: bool = False, streams: int | None = None,
                 rate: int = 0, silent_s: float = 0.0, closes: bool = False, not_yet_from: int | None = None,
                 head_s: float = 0.0, close_on: int | None = None) -> None:
        import socket

        self.sizes, self.bodies, self.mode, self.every_s = sizes, bodies, mode, every_s
        self.streams, self.rate, self.silent_s, self.closes = streams, rate, silent_s, closes
        self.digests, self.old_release, self.not_yet_from = digests, old_release, not_yet_from
        self.head_s, self.close_on = head_s, close_on
        self.closed = 0
        self._mute = threading.Event()  # cut(mute=True): its open connections answer nothing more
        self.requests = self.connections = 0
        self._stop = threading.Event()
        self._accepting = threading.Event()  # cleared: connections wait in the listener's queue
        self._accepting.set()
        self._parked = threading.Event()  # the accept thread saw it cleared
        # "relay-full-link": a queue of one connection; with it held, the kernel drops every SYN
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=0 if mode == "relay-full-link" else None)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, name="hostile-peer", daemon=True).start()

    def _accept(self) -> None:
        self._listener.settimeout(0.05)
        while not self._stop.is_set():
            if not self._accepting.is_set():
                self._parked.set()
                self._accepting.wait()
                self._parked.clear()
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: object) -> None:
        import socket
        assert isinstance(conn, socket.socket)
        asked = 0
        with conn, conn.makefile("rb") as reader:
            try:
                while not self._stop.is_set():
                    line = reader.readline()
                    if not line:
                        return
                    method, path = line.split()[:2]
                    if self._mute.is_set() or (method == b"HEAD" and self._stop.wait(self.head_s)):
                        self._stop.wait()  # its link is cut: asked, it never answers
                        return
                    headers = {}
                    while (h := reader.readline()) not in (b"\r\n", b"\n", b""):
                        k, _, v = h.decode().partition(":")
                        headers[k.strip().lower()] = v.strip()
                    reader.read(int(headers.get("content-length", "0")))  # a POST's body (statuses): not a request
                    asked += 1
                    if asked == self.close_on:  # read whole, never answered: closed (FIN) as it is
                        self.closed += 1
                        return
                    sha, _, query = path.decode().rsplit("/", 1)[-1].partition("?")
                    size = self.sizes.get(sha)
                    if query.startswith("digests=") and size is not None and self.digests is not None:
                        self.requests += 1
                        conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                     f"Content-Length: {len(self.digests)}\r\n\r\n".encode() + self.digests)
                        continue
                    if query.startswith("digests=") and size is not None and self.old_release:
                        self.requests += 1
                        conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                                     f"Content-Length: {size}\r\n\r\n".encode() + self.bodies[sha])
                        continue
                    if size is None or query:
                        conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                        continue
                    if self.mode == "planning":
                        self.requests += method == b"GET"
                        conn.sendall(b"HTTP/1.1 404 Not Found\r\nX-Weightcache-Planning: 1\r\n"
                                     b"Content-Length: 0\r\n\r\n")
                        continue
                    if method == b"HEAD":
                        partial = "X-Weightcache-Partial: 1\r\n" if self.mode.startswith("relay-") else ""
                        conn.sendall(f"HTTP/1.1 200 OK\r\n{partial}Content-Length: {size}\r\n\r\n".encode())
                        continue
                    self.requests += 1
                    first, last = (int(x) for x in headers["range"].removeprefix("bytes=").split("-"))
                    self._answer(conn, sha, first, last, size)
            except OSError:
                return  # the asker cut us: what a hostile peer gets

    def _answer(self, conn: object, sha: str, first: int, last: int, size: int) -> None:
        import socket
        assert isinstance(conn, socket.socket)
        huge = "9" * 5000
        span = f"{huge}-{huge}" if self.mode == "huge-range" else f"{first}-{last}"
        fanout = f"X-Weightcache-Streams: {self.streams}\r\n" if self.streams is not None else ""
        fanout += "Connection: close\r\n" if self.closes else ""
        head = (f"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {span}/{size}\r\n{fanout}"
                f"Content-Length: {last - first + 1}\r\n\r\n").encode()
        if self.not_yet_from is not None and first >= self.not_yet_from:
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nX-Weightcache-Partial: 1\r\nX-Weightcache-Not-Yet: 1\r\n"
                         b"X-Weightcache-Retry-Ms: 3000\r\nContent-Length: 0\r\n\r\n")
            return
        if self.mode == "shed-first" and self.requests == 1:
            message = b'{"error": "request_timeout", "message": "the listener needed this connection\'s slot"}'
            conn.sendall(b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\n"
                         b"Content-Length: " + str(len(message)).encode() + b"\r\n\r\n" + message)
            conn.close()
            return
        if self.mode == "relay-full-link" and self._stop.wait(self.every_s):
            return
        if self.mode == "relay-slow-missing":
            if not self._stop.wait(self.every_s):
                conn.sendall(b"HTTP/1.1 404 Not Found\r\nX-Weightcache-Partial: 1\r\nContent-Length: 0\r\n\r\n")
            return
        if self.mode == "trickle-headers":
            for i in range(len(head)):
                conn.sendall(head[i:i + 1])
                if self._stop.wait(self.every_s):
                    return
        else:
            conn.sendall(head)
        if self.mode == "huge-range":
            return
        body = self.bodies[sha][first:last + 1]
        if self.mode in ("honest", "shed-first"):
            conn.sendall(body)
            return
        if self.mode == "paced":
            step = max(1, self.rate // 20)
            for i in range(0, len(body), step):
                conn.sendall(body[i:i + step])
                if self._stop.wait(step / self.rate):
                    return
            return
        if self.mode == "relay-then-cut":
            conn.sendall(body[:256 << 10])
            self._stop.wait()
            return
        if self.mode in ("relay-pause", "relay-full-link"):
            conn.sendall(body[:256 << 10])
            if self.mode == "relay-pause":
                self._stop.wait(self.silent_s)
            else:
                self._full_link()
            conn.sendall(body[256 << 10:])
            return
        for i in range(len(body)):
            conn.sendall(body[i:i + 1])
            if self._stop.wait(self.every_s):
                return

    def _full_link(self) -> None:
        """For `silent_s` no new connection completes its handshake: the listener stops accepting and one
        connection of its own fills its queue, so the kernel drops every SYN (the asker's resend after 1 s
        completes once the queue is drained). A connect of the asker's (its silence probe) may fill the queue
        first, once the listener stopped accepting: the queue is full all the same, and this connect's SYN is
        dropped. It gives up before the kernel's resend: without a timeout it waited on resends (1, 3, 7, 15 s
        ...) and the listener never accepted again, the owner silent and unreachable for good (CI, on a loaded
        machine: connects to it timed out for 17 s, and its range was taken over)."""
        import socket

        self._accepting.clear()
        self._parked.wait(1.0)
        until = time.monotonic() + self.silent_s
        try:
            own: socket.socket | None = socket.create_connection(self._listener.getsockname()[:2], timeout=0.5)
        except OSError:  # the queue is full already
            own = None
        try:
            self._stop.wait(max(0.0, until - time.monotonic()))
        finally:
            self._accepting.set()
            if own is not None:
                own.close()

    def cut(self, mute: bool = False) -> None:
        """New connections are refused; the open ones stay as they are (`mute`: and answer nothing asked on them
        from now on, as across a link cut)."""
        if mute:
            self._mute.set()
        self._listener.close()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()

    def __enter__(self) -> HostilePeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
