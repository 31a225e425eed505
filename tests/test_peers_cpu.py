"""What a daemon's peer server spends per probe, per slice and per stream: the netns bench's N = 32 fill saturated a
2-core machine with 32 daemons' event loops (docs/peers.md, "Less CPU a byte")."""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import urllib3

from tests.peers_fleet import Fleet
from weightcache.download import PartialFile
from weightcache.fetch import transfer
from weightcache.fetch.items import Item
from weightcache.peers.client import GATHER_S, EagerBody, Helpers, reachable
from weightcache.sources.base import ObjectInfo

TOKEN = b"peer-token-0123456789abcdef"
AUTH = {"Authorization": "Bearer " + TOKEN.decode()}


def test_the_silence_probes_connects_never_reach_the_peer_servers_process(tmp_path: Path) -> None:
    """A silence probe (client.reachable) connects and resets, sending nothing: the kernel answers its handshake, so
    the probe sees a live peer, and the connection never reaches the server's event loop (TCP_DEFER_ACCEPT). Each
    cost the peer an accept and an aiohttp protocol set up and torn down: ~1,100 a fill at N = 32. A request that
    sends its bytes is accepted and answered as before."""
    with Fleet(tmp_path, TOKEN) as fleet:
        node = fleet.node("a")
        site = node.server.site
        assert site is not None
        for _ in range(20):
            assert reachable(("127.0.0.1", node.server.port), 2.0).up
        assert site.stats.accepted == 0
        http = urllib3.PoolManager(retries=False, timeout=10)
        resp = http.request("GET", f"{node.url}/v1/blobs/sha256/{'0' * 64}", headers=AUTH)
        http.clear()
        assert resp.status == 404
        assert site.stats.accepted == 1


def test_an_idle_fetch_worker_waits_for_a_range_to_end_or_to_stall_not_every_50_ms() -> None:
    """A worker with no task left waits for the ranges still being read: it returns when one ends, when the round
    aborts, or when one could have stalled long enough to be halved (SPLIT_STALL without a piece), and otherwise
    looks again only every IDLE_WAIT_S. It looked every 50 ms: a fleet fill at N = 32 has 64 workers a node, most
    of them idle once their ranges are done, ~1,000 wake-ups (GIL hand-offs) a second in each daemon."""
    piece = 256 << 10
    reading = transfer._Reading(piece)
    item = Item(ObjectInfo("k", "w.bin", 64 * piece, None, None, None), "w.bin")

    def waited(act: Callable[[], None] | None = None, after: float = 0.0) -> float:
        if act is not None:
            threading.Timer(after, act).start()
        began = time.monotonic()
        reading.wait_end()
        return time.monotonic() - began

    entry = reading.begin(item, 0, 64 * piece)  # no piece yet: halved after 5 x SPLIT_STALL (10 s)
    assert transfer.IDLE_WAIT_S - 0.05 <= waited() <= transfer.IDLE_WAIT_S + 0.5
    assert waited(lambda: reading.end(entry), after=0.2) < 0.6  # woken by the range's end
    entry = reading.begin(item, 0, 64 * piece)
    assert waited(reading.wake, after=0.2) < 0.6  # the round aborts
    reading.advanced(entry, piece)  # a piece came: it may stall SPLIT_STALL from now, past IDLE_WAIT_S
    assert waited() >= transfer.IDLE_WAIT_S - 0.05
    entry.last = time.monotonic() - transfer.SPLIT_STALL + 0.2  # stalled long enough 0.2 s from now
    assert 0.15 <= waited() < 0.6
    reading.end(entry)
    assert waited() < 0.05  # nothing left to wait for


def test_the_silence_probes_run_on_threads_kept_for_the_next_not_a_thread_each() -> None:
    """The watchdog's probes ran a new thread each (~15 a second a node in a fleet fill at N = 32): one after
    another they now run on one kept thread, and probes at once each get a thread (a probe waits seconds on a
    silent peer: none may queue behind another)."""
    helpers = Helpers("test-probe")
    done = threading.Semaphore(0)
    for _ in range(20):
        helpers.run(done.release)
        assert done.acquire(timeout=5)
        deadline = time.monotonic() + 5
        while helpers._idle == 0 and time.monotonic() < deadline:  # the thread is idle again once its job returned
            time.sleep(0.001)
    assert helpers.started == 1
    release = threading.Event()
    ran: list[int] = []

    def blocked(i: int) -> None:
        ran.append(i)
        release.wait(10)
        done.release()

    for i in range(5):
        helpers.run(blocked, i)
    deadline = time.monotonic() + 5
    while len(ran) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(ran) == [0, 1, 2, 3, 4]  # all at once, none waiting on another
    assert helpers.started == 5
    release.set()
    for _ in range(5):
        assert done.acquire(timeout=5)


def test_a_peer_body_that_comes_a_packet_at_a_time_is_read_a_few_packets_a_receive() -> None:
    """A fleet fill's peer bodies came a packet or two a receive (a slice's burst at the link's rate), each a wake of
    one of 64 reading threads: after a small receive the next waits GATHER_S, so a burst is read in a few receives.
    The bytes wait in the socket's buffer, so the body still ends when its last packet comes."""
    packet, count, gap = 1400, 60, 0.003
    body = bytes(range(256)) * (packet * count // 256) + bytes(packet * count % 256)
    server = socket.create_server(("127.0.0.1", 0))
    sent_at: list[float] = []
    sent = threading.Event()  # the reader can have every byte before the server's thread runs again to say when

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
            for i in range(count):  # a packet every `gap`, as a shaped link delivers a burst
                time.sleep(gap if i else 0)
                conn.sendall(body[i * packet:(i + 1) * packet])
            sent_at.append(time.monotonic())
            sent.set()
            conn.recv(1)

    threading.Thread(target=serve, daemon=True).start()
    http = urllib3.PoolManager(retries=False, timeout=10)
    resp = http.request("GET", f"http://127.0.0.1:{server.getsockname()[1]}/", preload_content=False)
    reader = EagerBody(resp)
    buf = bytearray(1 << 20)
    got, receives = bytearray(), 0
    while n := reader.readinto(memoryview(buf)):
        got += buf[:n]
        receives += 1
    ended = time.monotonic()
    resp.release_conn()
    http.clear()
    server.close()
    assert bytes(got) == body
    assert receives <= count // 4  # a receive a packet before (60 here)
    assert sent.wait(5)
    assert ended - sent_at[0] < GATHER_S + 0.1  # the last bytes read as they came, not a gap later


def test_a_head_of_a_blob_downloading_here_is_answered_without_a_thread(tmp_path: Path) -> None:
    """A HEAD of a blob this node downloads is answered on the event loop from what InFlight holds: no file is
    opened and no thread of the loop's executor is waited for. Each did `_open_held` in a thread; at N = 32 HEADs
    were 6,000 of a fill's 8,200 peer requests, nearly all in its first 12 s, each a GIL hand-off and a wait for an
    executor thread on a saturated machine (docs/peers.md, "N = 32: where the fill's first 20 s go"). Here the
    loop's only executor thread is busy (a disk read that waits): the HEAD is answered all the same, and a blob this
    node lacks still is not."""
    body = b"x" * 4096
    sha = hashlib.sha256(body).hexdigest()
    with Fleet(tmp_path, TOKEN) as fleet:
        node = fleet.node("a")
        assert node.server.inflight is not None
        part = PartialFile(tmp_path / "x.part", ObjectInfo("k", "k", len(body), "e", None, None), range_size=1 << 16)
        part.open()
        node.server.inflight.add(sha, part)
        fleet.loop.set_default_executor(ThreadPoolExecutor(1))
        busy = threading.Event()
        fleet.loop.call_soon_threadsafe(lambda: fleet.loop.run_in_executor(None, busy.wait, 30.0))
        http = urllib3.PoolManager(retries=False, timeout=5)
        try:
            began = time.monotonic()
            head = http.request("HEAD", f"{node.url}/v1/blobs/sha256/{sha}", headers=AUTH)
            took = time.monotonic() - began
            assert head.status == 200 and head.headers["X-Weightcache-Partial"] == "empty"
            assert head.headers["Content-Length"] == str(len(body))
            assert took < 1.0, f"the HEAD waited {took:.1f} s for the loop's executor"
        finally:
            busy.set()
            http.clear()
            node.server.inflight.remove(sha, part)
            part.close()
        lacks = urllib3.PoolManager(retries=False, timeout=5)
        assert lacks.request("HEAD", f"{node.url}/v1/blobs/sha256/{'0' * 64}", headers=AUTH).status == 404
        lacks.clear()
