"""A small reverse proxy that records requests and injects the failures real object stores produce.

Put it in front of an HTTP server (the moto S3 server) and point a client at `proxy.endpoint_url`: requests are
forwarded unchanged (Host included, so SigV4 signatures stay valid), every request is recorded, and faults added
with `proxy.add(...)` are applied to the next matching requests:

    proxy.add("slowdown", method="GET", path="/bucket/model.safetensors", ranged_only=True, count=2)
    proxy.add("truncate", keep=0.5)          # Content-Length promises N bytes, half arrive, then FIN
    proxy.add("reset", keep=0.25)            # a quarter arrives, then RST (SO_LINGER 0)
    proxy.add("flip", at=10)                 # byte 10 of the body is flipped, status and headers unchanged
    proxy.add("delay", seconds=0.5)          # answer after a pause (trips client read timeouts)
    proxy.add("throttle", rate=200_000)      # the body trickles at 200 kB/s (a slow origin), in 50 ms steps
    proxy.add("throttle", rate=4_000_000, shared=True, count=-1)  # 4 MB/s for every matching body together
    hold = proxy.add("hold")                 # the request waits: hold.arrived is set, then hold.release.set()
    proxy.add("hold", ranged_only=True, one_range=True, count=-1)  # the first ranged GET held, and its retries
    proxy.add("status", status=403, code="AccessDenied")

    proxy.requests[-1].range == "bytes=0-99"

Faults match by method, a substring of the path, and optionally only requests with a Range header; each fires
`count` times (-1: forever), in the order they were added. Bodies are buffered: it is a test tool, not a fast path.

`proxy.reverse_etags = True` plays a store whose ETags are not MD5s (SSE-KMS, SSE-C): every ETag it answers
(header or listing XML) is reversed, and every If-Match it forwards is reversed back.
"""

from __future__ import annotations

import http.client
import http.server
import io
import re
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

KINDS = ("slowdown", "reset", "truncate", "flip", "delay", "status", "throttle", "hold")
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str  # without the query string
    query: str
    range: str | None
    if_match: str | None
    headers: dict[str, str] = field(repr=False, compare=False)


@dataclass
class Fault:
    kind: str
    method: str | None = None
    path: str = ""
    ranged_only: bool = False
    count: int = 1  # -1 forever
    keep: float = 0.5  # reset/truncate: fraction of the body sent first
    at: int | None = None  # flip: body offset (default: the middle)
    seconds: float = 0.0  # delay
    rate: int = 0  # throttle: body bytes per second
    shared: bool = False  # throttle: `rate` for all matching bodies together (one origin link), not each
    _next_free: float = 0.0  # throttle, shared: when the link is free again (steps are reserved in turn)
    _link: threading.Lock = field(default_factory=threading.Lock, repr=False)
    arrived: threading.Event = field(default_factory=threading.Event)  # hold: a matching request is waiting
    release: threading.Event = field(default_factory=threading.Event)  # hold: set it to let requests through
    status: int = 500  # status
    code: str = "InternalError"  # status: the S3 error code in the XML body
    retry_after: int | None = None  # slowdown/status: Retry-After header
    fired: int = 0
    one_range: bool = False  # after it first fires, it matches only requests with that first one's Range
    first_range: str | None = None

    def matches(self, method: str, path: str, range_: str | None) -> bool:
        return ((self.count < 0 or self.fired < self.count) and (self.method is None or self.method == method)
                and self.path in path and (range_ is not None or not self.ranged_only)
                and not (self.one_range and self.fired and range_ != self.first_range))


class QuietHTTPServer(http.server.ThreadingHTTPServer):
    """A threaded server that does not print tracebacks when a client hangs up, as tested clients do."""

    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


class FaultProxy:
    """Threaded reverse proxy on 127.0.0.1 (or `host`), port 0 (or `port`). Use as a context manager or call
    `close()`."""

    def __init__(self, target: str, host: str = "127.0.0.1", port: int = 0) -> None:
        parts = urlsplit(target)
        self.target = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.requests: list[RecordedRequest] = []
        self.faults: list[Fault] = []
        self.reverse_etags = False
        self._lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"proxy": self})
        self._server = QuietHTTPServer((host, port), handler)
        self.port = self._server.server_address[1]
        self.endpoint_url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="faultproxy",
                                        daemon=True)
        self._thread.start()

    def add(self, kind: str, **options: object) -> Fault:
        """Add a fault (see the module docstring); returns it, so a test can read `fault.fired`."""
        if kind not in KINDS:
            raise ValueError(f"unknown fault {kind!r}; use one of {KINDS}")
        fault = Fault(kind, **options)  # type: ignore[arg-type]
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        """Forget recorded requests and faults."""
        with self._lock:
            self.requests.clear()
            self.faults.clear()

    def requests_for(self, method: str, path: str = "") -> list[RecordedRequest]:
        with self._lock:
            return [r for r in self.requests if r.method == method and path in r.path]

    def ranges_for(self, path: str) -> list[tuple[int, int]]:
        """The [first, last] byte ranges (inclusive, as Range says) of the ranged GETs of `path`, in order."""
        out = []
        for r in self.requests_for("GET", path):
            if r.range:
                first, last = r.range.removeprefix("bytes=").split("-")
                out.append((int(first), int(last)))
        return out

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take(self, request: RecordedRequest) -> Fault | None:
        with self._lock:
            self.requests.append(request)
            for fault in self.faults:
                if fault.matches(request.method, request.path, request.range):
                    if not fault.fired:
                        fault.first_range = request.range
                    fault.fired += 1
                    return fault
        return None


def _reverse_etag(value: str) -> str:
    return re.sub(r"[0-9a-f]{32}", lambda m: m[0][::-1], value)


class _Handler(http.server.BaseHTTPRequestHandler):
    proxy: FaultProxy
    protocol_version = "HTTP/1.1"  # keep-alive, as clients' pools expect

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _handle(self) -> None:
        path, _, query = self.path.partition("?")
        body = self._request_body()
        fault = self.proxy._take(RecordedRequest(self.command, path, query, self.headers.get("Range"),
                                                 self.headers.get("If-Match"), dict(self.headers.items())))
        if fault and fault.kind == "delay":
            time.sleep(fault.seconds)
        if fault and fault.kind == "hold":
            fault.arrived.set()
            fault.release.wait(60)
        if fault and fault.kind in ("slowdown", "status"):
            status, code = (503, "SlowDown") if fault.kind == "slowdown" else (fault.status, fault.code)
            return self._send_error(status, code, fault.retry_after)
        status, reason, headers, payload = self._forward(body)
        if self.proxy.reverse_etags:
            headers = [(k, _reverse_etag(v) if k.lower() == "etag" else v) for k, v in headers]
            payload = re.sub(rb"(<ETag>(?:&quot;|\")?)([0-9a-f]{32})", lambda m: m[1] + m[2][::-1], payload)
        if fault and fault.kind == "flip" and payload:
            at = len(payload) // 2 if fault.at is None else fault.at
            payload = payload[:at] + bytes([payload[at] ^ 0xFF]) + payload[at + 1:]
        self.send_response(status, reason)
        for name, value in headers:
            self.send_header(name, value)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if fault and fault.kind in ("reset", "truncate"):
            self.wfile.write(payload[:int(len(payload) * fault.keep)])
            return self._hang_up(reset=fault.kind == "reset")
        if fault and fault.kind == "throttle" and self.command != "HEAD":
            return self._trickle(payload, fault.rate, fault if fault.shared else None)
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _trickle(self, payload: bytes, rate: int, link: Fault | None) -> None:
        """`rate` bytes/s in 50 ms steps; with `link` (10 ms steps), each step takes its turn on that fault's
        shared link (a queue of reservations: N bodies at once get rate/N each)."""
        step = max(1, rate // 20) if link is None else max(1, rate // 100)
        for pos in range(0, len(payload), step):
            if link is not None:
                with link._link:
                    start = max(time.monotonic(), link._next_free)
                    link._next_free = start + min(step, len(payload) - pos) / rate
                time.sleep(max(0.0, start - time.monotonic()))  # this step's turn on the link
            try:
                self.wfile.write(payload[pos:pos + step])
                self.wfile.flush()
            except OSError:  # the client went away (cancelled): stop sending
                self.close_connection = True
                return
            if link is None:
                time.sleep(0.05)

    do_GET = do_PUT = do_POST = do_PATCH = do_DELETE = do_HEAD = _handle

    def _request_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0], 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.proxy.target, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            if self.proxy.reverse_etags and "If-Match" in headers:
                headers["If-Match"] = _reverse_etag(headers["If-Match"])
            if body or self.command in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            payload = resp.read()
            keep = [(k, v) for k, v in resp.getheaders()
                    if k.lower() not in _HOP_BY_HOP and (k.lower() != "content-length" or self.command == "HEAD")]
            return resp.status, resp.reason, keep, payload
        finally:
            conn.close()

    def _send_error(self, status: int, code: str, retry_after: int | None) -> None:
        payload = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                   f"<Message>injected by faultproxy</Message><RequestId>faultproxy</RequestId></Error>").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        if retry_after is not None:
            self.send_header("Retry-After", str(retry_after))
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _hang_up(self, *, reset: bool) -> None:
        """Close mid-body: a FIN (truncate), or an RST (reset: SO_LINGER with a zero timeout)."""
        self.close_connection = True
        self.wfile.flush()
        if reset:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.rfile.close()
            self.wfile.close()
            self.connection.close()  # the last reference: the kernel sends RST now
            self.rfile, self.wfile = io.BytesIO(), io.BytesIO()  # for the server's own flush and close after us
