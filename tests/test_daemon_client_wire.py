"""The daemon client's own HTTP/1.1 (weightcache/daemon/client.py, `_UnixConnection`), against answers written
byte by byte on a real Unix socket: what aiohttp sends (chunked progress lines cut anywhere, Content-Length bodies,
a body to the connection's end) and what no daemon sends (a closed connection, a web page of another protocol)."""

from __future__ import annotations

import contextlib
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from weightcache.daemon.client import DaemonClient, DaemonError
from weightcache.errors import NotCachedError

Answer = Callable[[socket.socket, bytes], None]


@pytest.fixture
def serve() -> Iterator[Callable[[Answer], tuple[DaemonClient, list[bytes]]]]:
    """serve(answer) -> a client of a socket whose every connection gets `answer(conn, request)`; the requests
    received are collected."""
    tmp = tempfile.TemporaryDirectory(prefix="wc-wire-")  # AF_UNIX paths are short; pytest's tmp_path is long
    listeners: list[socket.socket] = []

    def start(answer: Answer) -> tuple[DaemonClient, list[bytes]]:
        path = Path(tmp.name) / f"d{len(listeners)}.sock"
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(path))
        server.listen(4)
        listeners.append(server)
        seen: list[bytes] = []

        def loop() -> None:
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                with conn:
                    request = b""
                    while b"\r\n\r\n" not in request:
                        request += conn.recv(65536)
                    head, _, body = request.partition(b"\r\n\r\n")
                    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), 0)
                    while len(body) < length:
                        body += conn.recv(65536)
                    seen.append(request)
                    # the client may close once it has what it reads (the snapshot line, not the last chunk)
                    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                        answer(conn, request)

        threading.Thread(target=loop, daemon=True).start()
        return DaemonClient(path, timeout=10), seen

    yield start
    for server in listeners:
        server.close()
    tmp.cleanup()


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def test_progress_lines_cut_across_chunks_arrive_whole(serve: Callable[[Answer], tuple[DaemonClient, list[bytes]]]
                                                        ) -> None:
    lines = b'{"progress": {"phase": "listing"}}\n{"progress": {"phase": "downloading"}}\n{"snapshot": {"id": "ab"}}\n'

    def answer(conn: socket.socket, _: bytes) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n")
        for at in range(0, len(lines), 7):  # every line cut somewhere, each cut its own write
            conn.sendall(_chunked(lines[at:at + 7])[:-5])
        conn.sendall(b"0\r\n\r\n")

    client, seen = serve(answer)
    heard: list[object] = []
    assert client.ensure("s3://b/m/", on_progress=heard.append) == {"id": "ab"}
    assert heard == [{"phase": "listing"}, {"phase": "downloading"}]
    head = seen[0].split(b"\r\n\r\n")[0]
    assert head.startswith(b"PUT /v1/models?wait=1 HTTP/1.1\r\n") and b"Content-Length: " in head


def test_bodies_by_length_to_the_end_and_errors(serve: Callable[[Answer], tuple[DaemonClient, list[bytes]]]
                                                 ) -> None:
    def answer(conn: socket.socket, request: bytes) -> None:
        if request.startswith(b"DELETE /v1/leases/"):  # no length, not chunked: the body ends with the connection
            conn.sendall(b'HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{"released": "holder"}')
        elif request.startswith(b"GET /v1/models/"):
            body = b'{"error": "not_cached", "message": "nothing cached as ab"}'
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
        else:
            body = b'[{"id": "ab"}]'
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))

    client, _ = serve(answer)
    assert client.list() == [{"id": "ab"}]
    client.release("holder")
    with pytest.raises(NotCachedError, match="nothing cached as ab"):
        client.get("ab")


def test_what_no_daemon_answers(serve: Callable[[Answer], tuple[DaemonClient, list[bytes]]]) -> None:
    closed, _ = serve(lambda conn, _: None)  # closes without an answer: a stale socket's or a dying daemon's
    assert not closed.available()
    with pytest.raises(ConnectionResetError):
        closed.list()
    other, _ = serve(lambda conn, _: conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n"))
    with pytest.raises(DaemonError, match="not an HTTP answer"):
        other.list()
    assert not other.available()
