"""The node's serving limit (`bytesPerSecond.serve`): what its peer server sends to every peer together, held
under its uplink so the ACKs of what the node receives are not queued behind it (docs/peers.md, "Serving below
the uplink": on 1 MB/s links the node whose uplink filled first received at 0.02-0.4 MB/s for 15-25 s and was
ready 10-17 s after the others)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import urllib3

from tests.peers_fleet import Fleet
from tests.test_peers_server import AUTH, BODY, SHA, TOKEN, holding_node
from weightcache.peers.server import PeerLimits


def read_at_once(url: str, askers: int) -> float:
    """Seconds until `askers` requests at once (each for the blob's first 150 kB) all got their bytes."""
    http = urllib3.PoolManager(retries=False, timeout=10)
    got: list[bytes] = []

    def ask() -> None:
        got.append(http.request("GET", f"{url}/v1/blobs/sha256/{SHA}",
                                headers={**AUTH, "Range": "bytes=0-149999"}).data)

    began = time.monotonic()
    threads = [threading.Thread(target=ask) for _ in range(askers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - began
    http.clear()
    assert got == [BODY[:150_000]] * askers
    return took


def test_the_serving_limit_paces_what_the_node_sends_to_all_peers_together_and_changes_live(tmp_path: Path) -> None:
    with Fleet(tmp_path, TOKEN, PeerLimits(rate_bytes_s=0)) as fleet:
        node = holding_node(fleet)
        free_s = read_at_once(node.url, 2)
        node.server.bandwidth.configure(serve=200_000)  # as the daemon's bytesPerSecond.serve, live
        capped_s = read_at_once(node.url, 2)
        assert capped_s >= 1.2 > free_s  # 300 kB to two streams at 200 kB/s together (a 0.05 s burst)
        node.server.bandwidth.configure(serve=0)
        assert read_at_once(node.url, 2) < 1.0
        assert node.server.bandwidth.serve.waited_s > 0  # `weightcache status` says the limit bit


def test_streams_sharing_the_serving_limit_take_its_slices_in_turn_and_a_new_one_first(tmp_path: Path) -> None:
    """Sixteen streams on one 600 kB/s limit: each gets a 32 KiB slice every 0.87 s, none waits much longer (each
    polling the bucket on its own, some went 1-3.6 s without a slice, and in a fleet one now and then 10 s: its
    asker's read timed out). A stream asked meanwhile gets its first slice next, not after a round of the others'
    (in the order asked, at N = 32 a new stream waited 2.2 s and its asker cut it as a trickler)."""
    with Fleet(tmp_path, TOKEN, PeerLimits(rate_bytes_s=0, max_streams=20, stream_budget=0)) as fleet:
        node = holding_node(fleet)
        node.server.bandwidth.configure(serve=600_000)
        http = urllib3.PoolManager(retries=False, timeout=30, maxsize=20)
        gaps: list[float] = []

        def ask() -> None:
            resp = http.request("GET", f"{node.url}/v1/blobs/sha256/{SHA}", preload_content=False,
                                headers={**AUTH, "Range": "bytes=0-149999"})
            last, gap = time.monotonic(), 0.0
            for _ in resp.stream(16 << 10):
                if last > started + 1.0:  # once all are streaming (one that began first is ahead: it waits a round)
                    gap = max(gap, time.monotonic() - last)
                last = time.monotonic()
            gaps.append(gap)

        started = time.monotonic()
        threads = [threading.Thread(target=ask) for _ in range(16)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        asked = time.monotonic()
        late = http.request("GET", f"{node.url}/v1/blobs/sha256/{SHA}", preload_content=False,
                            headers={**AUTH, "Range": "bytes=0-99"})
        first_s = time.monotonic() - asked
        assert late.read() == BODY[:100]
        for t in threads:
            t.join()
        http.clear()
        assert len(gaps) == 16 and max(gaps) < 2.0, gaps  # in turn: 0.87 s; the lottery: up to 3.6 s of 12
        assert first_s < 0.6  # in the order asked: a round of the others' slices, 0.87 s
