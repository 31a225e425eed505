"""One request a peer about every blob of a model (`POST /v1/blobs/status`, PeerClient.statuses): what a round of
HEADs, one a peer and blob, said one blob at a time (docs/peers.md, "Session 54"). The answer is untrusted: bounded,
read only for the blobs asked, a size not the one asked reads as not held."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3

from tests.peers_fleet import Fleet, FleetNode
from weightcache.download import PartialFile
from weightcache.peers import PeerClient, PeerSet
from weightcache.peers.client import MAX_STATUS_BLOBS
from weightcache.peers.inflight import InFlight, TcpConnection
from weightcache.sources import ObjectInfo, open_source
from weightcache.uri import parse_ref

TOKEN = b"peer-token-0123456789abcdef"
AUTH = {"Authorization": "Bearer " + TOKEN.decode()}
BODIES = [os.urandom(100_000 + i) for i in range(3)]
SHAS = [hashlib.sha256(b).hexdigest() for b in BODIES]


class CountingInFlight(InFlight):
    """The peer server's InFlight, counting the authorized requests it answers (`asked_by` is told of each)."""

    def __init__(self) -> None:
        super().__init__()
        self.asks = 0

    def asked_by(self, host: str, conn: TcpConnection | None = None) -> None:
        self.asks += 1
        super().asked_by(host, conn)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with Fleet(tmp_path, TOKEN) as f:
        yield f


def publish(node: FleetNode, body: bytes) -> None:
    blob = node.store.layout.blob(hashlib.sha256(body).hexdigest())
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(body)


def test_one_request_says_which_blobs_a_peer_holds_downloads_or_lacks(fleet: Fleet, tmp_path: Path) -> None:
    """Published ("blob"), downloading with origin bytes journalled ("partial") or none yet ("empty"), lacked
    (None; "planning" while a fetch there lists and plans), and a blob asked with another size than the peer's
    (None, as a HEAD with another Content-Length): one POST answers them all, as each one's HEAD would."""
    n = fleet.node("n")
    publish(n, BODIES[0])
    inflight = n.server.inflight
    assert inflight is not None
    parts = []
    for i, sha in ((1, SHAS[1]), (2, SHAS[2])):
        part = PartialFile(tmp_path / f"{i}.part", ObjectInfo("k", "k", len(BODIES[i]), "e", None, None),
                           range_size=1 << 16)
        part.open()
        inflight.add(sha, part)
        parts.append(part)
    inflight.from_origin(SHAS[1], 0, 50_000)  # the first has origin bytes, the second none yet
    lacked = hashlib.sha256(b"not here").hexdigest()
    client = PeerClient(n.url, TOKEN, connect_timeout=2.0, read_timeout=5.0)
    try:
        asked = {**{s: len(b) for s, b in zip(SHAS, BODIES, strict=True)}, lacked: 10}
        assert client.statuses(asked) == {SHAS[0]: "blob", SHAS[1]: "partial", SHAS[2]: "empty", lacked: None}
        for sha, body in zip(SHAS, BODIES, strict=True):  # each as its HEAD says
            assert client.probe(sha, len(body)) == client.statuses({sha: len(body)})[sha]  # type: ignore[index]
        assert client.statuses({SHAS[0]: len(BODIES[0]) + 1}) == {SHAS[0]: None}  # another size: not this blob
        planning = inflight.planning()
        assert client.statuses({lacked: 10, SHAS[0]: len(BODIES[0])}) == {lacked: "planning", SHAS[0]: "blob"}
        planning.done()
        wrong = PeerClient(n.url, b"wrong-token-0123456789abcdef", connect_timeout=2.0, read_timeout=5.0)
        assert wrong.statuses({SHAS[0]: len(BODIES[0])}) == {SHAS[0]: None}  # 401: holds none
        wrong.close()
        http = urllib3.PoolManager(retries=False, timeout=10)
        for body in (b"../../etc/passwd", SHAS[0].upper().encode(), ("\n".join([SHAS[0]] * (MAX_STATUS_BLOBS + 1))
                                                                     ).encode()):
            resp = http.request("POST", n.url + "/v1/blobs/status", body=body, headers=AUTH)
            assert resp.status == 400, body[:80]
        assert http.request("POST", n.url + "/v1/blobs/status", body=SHAS[0].encode()).status == 401
        http.clear()
    finally:
        for sha, part in zip(SHAS[1:], parts, strict=True):
            inflight.remove(sha, part)
            part.close()
        client.close()


@contextlib.contextmanager
def hostile_statuses(answer: bytes | None) -> Iterator[str]:
    """A peer answering every statuses request 200 application/json with `answer`; None: 404 to it, as a daemon
    of a release before it does. Every HEAD: 404 (it lacks the blob)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as reader, contextlib.suppress(OSError):  # the asker may close it on us
            while line := reader.readline():
                length = 0
                while (h := reader.readline()) not in (b"\r\n", b""):
                    if h.lower().startswith(b"content-length:"):
                        length = int(h.split(b":")[1])
                reader.read(length)
                if line.startswith(b"POST /v1/blobs/status ") and answer is not None:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n" % len(answer) + answer)
                else:
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()


@pytest.mark.parametrize(("answer", "said"), [
    # blobs never asked about, a size that is not the one asked, a kind of no HEAD's: read as not held
    (b'{"planning": false, "blobs": {"%s": ["blob", 10], "%s": ["blob", 11], "%s": ["stolen", 12]}}'
     % (("f" * 64).encode(), SHAS[0].encode(), SHAS[1].encode()), {SHAS[0]: None, SHAS[1]: None}),
    (b'{"planning": "yes", "blobs": {}}', {SHAS[0]: None, SHAS[1]: None}),  # not of its shape
    (b'[' * 100_000, {SHAS[0]: None, SHAS[1]: None}),  # over its bound (about 100 bytes a blob asked)
    (b'{"planning": true, "blobs": {"%s": ["partial", 12]}}' % SHAS[1].encode(),
     {SHAS[0]: "planning", SHAS[1]: "partial"}),  # a well-formed answer, for the contrast
])
def test_a_statuses_answer_is_read_only_for_the_blobs_asked_within_its_bound(answer: bytes,
                                                                             said: dict[str, str | None]) -> None:
    with hostile_statuses(answer) as url:
        client = PeerClient(url, TOKEN, connect_timeout=2.0, read_timeout=5.0)
        assert client.statuses({SHAS[0]: 11, SHAS[1]: 12}) == said
        client.close()


def test_a_round_asks_each_peer_once_about_every_blob_of_the_fetch(fleet: Fleet, tmp_path: Path) -> None:
    """The rounds of a fetch of three blobs ask each peer one request in all, not a HEAD per blob: after the first
    blob's round the others' know their holders (the peer holds two of them, downloads the third). Before,
    each blob's round asked every peer one after another, under the fetch's one prober lock (N = 32: readers asked
    alone waited on it a median 4.3 s, up to 25 s). A peer of a release before the statuses request (404 to it)
    is asked by HEAD, one blob at a time, as before."""
    holder = fleet.node("holder")
    counting = CountingInFlight()
    holder.server.inflight = counting
    for body in BODIES[:2]:
        publish(holder, body)
    part = PartialFile(tmp_path / "2.part", ObjectInfo("k", "k", len(BODIES[2]), "e", None, None), range_size=1 << 16)
    part.open()
    counting.add(SHAS[2], part)
    source = open_source(parse_ref(f"file://{tmp_path}/"))
    with hostile_statuses(None) as hostile:  # serves no statuses request: a daemon of a release before it
        peers = PeerSet([PeerClient(u, TOKEN, connect_timeout=2.0, read_timeout=5.0) for u in (holder.url, hostile)],
                        inflight=InFlight(), self_url="http://127.0.0.3:1")
        asker = peers.wrap(source, {f"f{i}": (sha, len(b)) for i, (sha, b) in enumerate(zip(SHAS, BODIES,
                                                                                           strict=True))})
        holders = [[p.url for p in asker._holders_in_turn(sha, len(body))] for sha, body in zip(SHAS, BODIES,
                                                                                                 strict=True)]
        assert holders == [[holder.url]] * 3
        assert counting.asks == 1, f"{counting.asks} requests to the holder for three blobs' rounds"
        peers.close()
    source.close()
    counting.remove(SHAS[2], part)
    part.close()

