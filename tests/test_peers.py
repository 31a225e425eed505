"""Fleet fill end to end: nodes with their own roots and real peer servers, one moto origin behind the fault
proxy (which records every ranged GET, so origin bytes are counted where they leave the origin)."""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import itertools
import logging
import os
import shutil
import socket
import struct
import subprocess
import threading
import time
import types
import typing
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing, contextmanager
from pathlib import Path

import pytest

from tests.faultproxy import FaultProxy
from tests.fixtures_daemon import wait_until
from tests.fixtures_s3 import S3
from tests.grants import admin
from tests.peers_fleet import Fleet, FleetNode, HostilePeer
from tests.peers_fleet import origin_bytes as fleet_origin_bytes
from weightcache.download import PartialFile
from weightcache.peers import PeerClient, PeerSet
from weightcache.peers import client as client_module
from weightcache.peers import server as server_module
from weightcache.peers import source as source_module
from weightcache.peers.client import (
    HANDSHAKE_MIN,
    PROBE_GAP_S,
    PROBE_S,
    SLOW_GRACE_S,
    WATCHDOG,
    Link,
    Pace,
    PeerFlow,
    acks_stalled,
    reachable,
)
from weightcache.peers.inflight import InFlight
from weightcache.peers.server import PeerLimits
from weightcache.peers.source import GRACE_S, RELAY_PIECE_MIN, RELAY_PIECES, Later, PeerSource, PeerStats
from weightcache.retry import Retryable
from weightcache.sources import ObjectInfo, open_source
from weightcache.store import Snapshot
from weightcache.uri import parse_ref

TOKEN = b"peer-token-0123456789abcdef"
FILES = {"model-00001.safetensors.bin": os.urandom(3 << 20) + b"a", "model-00002.bin": os.urandom(2 << 20),
         "config.json": b'{"hidden": 64}'}
MODEL_BYTES = sum(len(b) for b in FILES.values())
REF = parse_ref("s3://models/llama/")
OPTIONS = {"chunk_size": 256 << 10, "concurrency": 4}
# a node whose only holder of a blob is one peer judges that peer's first piece by the origin's bytes before it uses
# it (docs/peers.md, "The lying peer"): the origin sends it at most one piece more
JUDGED = OPTIONS["chunk_size"]


def origin_bytes(proxy: FaultProxy) -> int:
    return fleet_origin_bytes(proxy, "/models/llama/")


def assert_model(snap: Snapshot) -> None:
    for name, body in FILES.items():
        assert (snap.path / name).read_bytes() == body


@pytest.fixture
def origin(s3: S3, fault_proxy: FaultProxy) -> FaultProxy:
    for name, body in FILES.items():
        s3.put("models", f"llama/{name}", body, ChecksumAlgorithm="SHA256")
    return fault_proxy


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with Fleet(tmp_path, TOKEN) as f:
        yield f


def ensure(node: FleetNode, proxy: FaultProxy, **options: object) -> Snapshot:
    """`options`: the fetcher's beyond OPTIONS (read_timeout=3.0: a read held at the origin is tried again sooner)."""
    return node.fetcher(endpoint_url=proxy.endpoint_url, **OPTIONS, **options).ensure(admin(REF))


def test_model_fetched_by_one_node_then_three_more_costs_the_origin_one_model(origin: FaultProxy,
                                                                               fleet: Fleet) -> None:
    first = fleet.node("n0")
    assert_model(ensure(first, origin))
    one = origin_bytes(origin)
    assert one == MODEL_BYTES
    others = []
    for i in range(1, 4):  # each later node knows every earlier one
        node = fleet.node(f"n{i}", peers=[n.url for n in fleet.nodes])
        assert_model(ensure(node, origin))
        others.append(node)
    # the origin served the model's bodies once in all, and n1 the one piece it judged n0's first piece by (n0
    # was its only holder); n2 and n3 had two holders or more, each vouching for the other's first piece
    judged = others[0].fetchers[-1].stats["origin_bytes"]
    assert 0 < judged <= JUDGED
    assert origin_bytes(origin) == MODEL_BYTES + judged
    for node in others:
        stats = node.peers.stats
        assert not stats.errors_by_peer
        assert node.fetchers[-1].stats["peer_bytes"] == sum(stats.bytes_by_peer.values())
        assert node.fetchers[-1].stats["peer_bytes"] + node.fetchers[-1].stats["origin_bytes"] == MODEL_BYTES
        assert node.fetchers[-1].stats["origin_bytes"] == (judged if node is others[0] else 0)
    # the last node's pieces came from several peers at once, not one peer at a time
    assert len([p for p, n in others[-1].peers.stats.bytes_by_peer.items() if n]) >= 2


def test_a_peer_that_flips_a_byte_costs_its_piece_and_is_not_asked_again(origin: FaultProxy, fleet: Fleet) -> None:
    good = fleet.node("good")
    assert_model(ensure(good, origin))
    with FaultProxy(good.url) as liar:  # the same peer, one byte of one body flipped on its way
        flip = liar.add("flip", method="GET", path="/v1/blobs/", count=1)
        node = fleet.node("victim", peers=[liar.endpoint_url])
        snap = ensure(node, origin)
        assert flip.fired == 1
        assert_model(snap)
        assert liar.endpoint_url in node.peers.stats.banned
        assert node.peers.stats.errors_by_peer[liar.endpoint_url] >= 1
        # either the flipped byte was in the liar's first piece, judged before use (the origin's bytes were used
        # and the liar, the victim's only peer, was banned at once: the rest came from the origin, nothing
        # twice), or past it: the origin re-sent the blob that failed, not the model
        victim = origin_bytes(origin) - MODEL_BYTES
        assert victim == MODEL_BYTES or victim <= max(len(b) for b in FILES.values()) + JUDGED
        # a banned peer is not asked by the node's next fetch
        asked = len(liar.requests)
        later = fleet.node("later-store", peers=[])
        later.peers = node.peers
        assert_model(ensure(later, origin))
        assert len(liar.requests) == asked


def test_a_peer_killed_mid_transfer_costs_a_retry_elsewhere(origin: FaultProxy, fleet: Fleet) -> None:
    holder = fleet.node("holder")
    assert_model(ensure(holder, origin))
    other = fleet.node("other", peers=[holder.url])
    assert_model(ensure(other, origin))
    with FaultProxy(holder.url) as dying:
        dying.add("reset", method="GET", path="/v1/blobs/", keep=0.5, count=-1)  # every body cut, RST
        node = fleet.node("node", peers=[dying.endpoint_url, other.url])
        assert_model(ensure(node, origin))
        assert node.peers.stats.errors_by_peer[dying.endpoint_url] >= 1
        assert dying.endpoint_url not in node.peers.stats.banned  # dead is not dishonest
    # the healthy peer took over; the origin paid nothing more but, at most, a piece for each of `other` and `node`
    # to judge their first holder by (other's only holder was `holder`; the dying peer, cut mid-answer, could
    # not vouch for `other`)
    assert MODEL_BYTES <= origin_bytes(origin) <= MODEL_BYTES + 2 * JUDGED + len(FILES["config.json"])


def test_a_dead_peer_and_a_stopped_one_leave_the_origin_to_serve(origin: FaultProxy, fleet: Fleet) -> None:
    gone = fleet.node("gone")
    assert_model(ensure(gone, origin))
    fleet.stop(gone)
    node = fleet.node("alone", peers=[gone.url, "http://127.0.0.1:9"])
    assert_model(ensure(node, origin))
    assert origin_bytes(origin) == 2 * MODEL_BYTES
    assert node.fetchers[-1].stats["peer_bytes"] == 0
    # each unreachable peer was asked once by the fetch, not once per blob
    assert node.peers.stats.errors_by_peer == {gone.url: 1, "http://127.0.0.1:9": 1}


def test_a_fetch_over_asks_its_dead_peers_nothing_more(origin: FaultProxy, fleet: Fleet) -> None:
    """A peer whose port refused is asked again by a thread of the fetch (a daemon restarting answers within
    seconds) for MAX_PENDING_S at most; once the fetch is over, that thread stops. Else every fetch left one
    asking a killed node 4 times a second for a minute (in the suite, beside the next tests of its worker)."""
    def reprobes() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "peer-reprobe"}

    before = reprobes()
    node = fleet.node("alone", peers=["http://127.0.0.1:9"])
    assert_model(ensure(node, origin))
    assert node.peers.stats.errors_by_peer == {"http://127.0.0.1:9": 1}
    wait_until(lambda: not reprobes() - before, timeout=2 * source_module.REASK_S + 1.0,
               what="the fetch's thread asking its dead peer to stop")


def test_peers_are_never_asked_for_blobs_known_only_by_claim(s3: S3, fault_proxy: FaultProxy, fleet: Fleet) -> None:
    """Without the store's own SHA-256 (no checksum on upload) a digest is a claim: peers could serve another
    namespace's model for it, so peers are never asked for a digest. They are asked for the origin's identity
    (bucket, key, ETag, size: tests/test_peers_origin.py), which they map to a blob only from their own
    downloads of it, and whose bytes the node checks against the origin's MD5 ETag."""
    for name, body in FILES.items():
        s3.put("models", f"llama/{name}", body)
    holder = fleet.node("holder")
    assert_model(ensure(holder, fault_proxy))
    with FaultProxy(holder.url) as watch:
        node = fleet.node("node", peers=[watch.endpoint_url])
        assert_model(ensure(node, fault_proxy))
        assert watch.requests
        assert all(r.path == "/v1/origin" and "bucket=models" in r.query for r in watch.requests)
    small = len(FILES["config.json"])  # below MIN_PEER_BYTES: from the origin
    judged = node.fetchers[-1].stats["origin_bytes"] - small  # the holder's first piece, judged before use
    assert 0 < judged <= JUDGED
    assert origin_bytes(fault_proxy) == MODEL_BYTES + small + judged



def test_a_node_still_downloading_serves_the_pieces_it_has(origin: FaultProxy, fleet: Fleet) -> None:
    """A's first range of the big file is held at the origin, and so are A's retries of it (its read times out);
    everything else A has journalled is served to B while A is still downloading. B waits on the held range (A is
    fetching it: "not yet", its claim standing through the retry) until A's retry brings it, and reads it from A:
    the origin sends B one judged piece, nothing of the held range. The hold ends once B has everything else (it is
    then waiting on A), not when a read timeout runs out: the test took 10 s, and with a shorter timeout A's
    retry finished while B's ask waited on its claim, which answered "not downloaded yet" (server
    `_still_registered`; tests/test_peers_server.py::
    test_a_download_that_finishes_while_an_ask_waits_on_its_claim_is_served_from_its_blob)."""
    big = "model-00001.safetensors.bin"
    hold = origin.add("hold", method="GET", path=f"/models/llama/{big}", ranged_only=True, one_range=True, count=-1)
    a = fleet.node("a")
    pool = ThreadPoolExecutor(2)
    sha = hashlib.sha256(FILES[big]).hexdigest()
    others = [hashlib.sha256(b).hexdigest() for n, b in FILES.items() if n != big]

    def has_all_but(node: FleetNode, start: int, end: int) -> bool:
        part = node.peers.inflight.get(sha)
        return (part is not None and part.holds(0, start) and part.holds(end + 1, len(FILES[big]))
                and all(node.store.has_blob(d) or ((p := node.peers.inflight.get(d)) is not None
                                                   and p.holds(0, p.obj.size)) for d in others))  # small: a blob

    try:
        a_done = pool.submit(ensure, a, origin, read_timeout=1.0)  # its retries of the held read: every 1 s
        assert hold.arrived.wait(30)
        held = next(r for r in origin.requests_for("GET", f"/models/llama/{big}") if r.range)
        start, end = (int(x) for x in (held.range or "").removeprefix("bytes=").split("-"))
        wait_until(lambda: has_all_but(a, start, end), timeout=30,
                   what="a to journal the ranges it was not held on", every=0.02)
        before = origin_bytes(origin)
        b = fleet.node("b", peers=[a.url])
        b_done = pool.submit(ensure, b, origin)
        wait_until(lambda: has_all_but(b, start, end), timeout=30, what="b to have all but the held range from a",
                   every=0.02)
        wait_until(lambda: hold.fired >= 2, timeout=30, what="a's retry of the held range (held too)")
        assert not b_done.done() and a.peers.inflight.get(sha) is not None  # b waits on a, still downloading
        hold.release.set()  # a's retry brings the held range now
        assert_model(b_done.result(60))
        # the origin sent what a had not read yet (its retry of the held range, when it came after `before`) and
        # one piece more: b judged by the origin's bytes the first piece a sent of a file a holds whole
        extra = origin_bytes(origin) - before
        assert 0 < extra <= JUDGED or 0 < extra - (end - start + 1) <= JUDGED
        # lacking a range is no fault of a's
        assert b.peers.stats.errors_by_peer.get(a.url, 0) == 0
        # b's bytes came from a, but for the judged piece: the held range too, once a's retry brought it
        stats = b.fetchers[-1].stats
        assert stats["peer_bytes"] + stats["origin_bytes"] == MODEL_BYTES
        assert 0 < stats["origin_bytes"] <= JUDGED
    finally:
        hold.release.set()
        assert_model(a_done.result(30))
        pool.shutdown()
    assert a.peers.inflight.get(sha) is None  # published: served as a blob from now on


def fill_at_once(fleet: Fleet, origin: FaultProxy, n: int) -> list[FleetNode]:
    """`n` nodes that list each other fetch the model at once; each gets it whole."""
    nodes = [fleet.node(f"n{i}") for i in range(n)]
    for node in nodes:
        fleet.connect(node, [o.url for o in nodes if o is not node])
    with ThreadPoolExecutor(len(nodes)) as pool:
        for snap in pool.map(lambda node: ensure(node, origin), nodes):
            assert_model(snap)
    return nodes


def test_four_nodes_asked_at_once_cost_the_origin_about_one_model(origin: FaultProxy, fleet: Fleet) -> None:
    """The origin is the bottleneck (each connection throttled): four nodes that list each other and start
    together fetch different ranges first, and wait for a range another node is fetching instead of asking the
    origin again."""
    origin.add("throttle", method="GET", path="/models/llama/", ranged_only=True, rate=4_000_000, count=-1)
    nodes = fill_at_once(fleet, origin, 4)
    ratio = origin_bytes(origin) / MODEL_BYTES
    print(f"4 nodes at once: origin sent {ratio:.3f}x the model")
    assert ratio <= 1.2
    # every node fetched part of the model from the origin itself (its own share), the rest from the others
    assert all(0 < n.fetchers[-1].stats["origin_bytes"] < MODEL_BYTES for n in nodes)
    assert all(not n.peers.stats.banned for n in nodes)


def test_eight_nodes_at_once_behind_one_slow_origin_link_cost_it_about_one_model(origin: FaultProxy,
                                                                                 fleet: Fleet) -> None:
    """Eight nodes fill at once behind ONE origin link that every connection shares (4 MB/s for all: each origin
    connection gets far under 1 MiB/s), as a NAT gateway or a throttled prefix does. A node relaying a range it
    reads from the origin answers "not yet" until its pieces land, then sends them at its own speed, and the
    slow-peer floor is relative to the fetch's own origin rate: before, every relayed range looked like a
    trickler under an absolute 1 MiB/s, every node fell back to the origin and read the model several times."""
    origin.add("throttle", method="GET", path="/models/llama/", ranged_only=True, rate=4_000_000, shared=True,
               count=-1)
    nodes = fill_at_once(fleet, origin, 8)
    ratio = origin_bytes(origin) / MODEL_BYTES
    cuts = sum(sum(n.peers.stats.errors_by_peer.values()) for n in nodes)
    print(f"8 nodes at once behind one 4 MB/s origin link: origin sent {ratio:.3f}x the model, {cuts} peer errors")
    assert ratio <= 1.3
    assert all(not n.peers.stats.banned for n in nodes)


def test_a_peer_killed_while_others_wait_on_it_costs_only_a_fall_back_to_the_origin(origin: FaultProxy,
                                                                                    fleet: Fleet) -> None:
    """B waits on ranges A is fetching; A's peer server dies mid-way: B takes what it lacks from the origin."""
    origin.add("throttle", method="GET", path="/models/llama/", ranged_only=True, rate=1_000_000, count=-1)
    a, b = fleet.node("a"), fleet.node("b")
    fleet.connect(a, [b.url])
    fleet.connect(b, [a.url])
    with ThreadPoolExecutor(2) as pool:
        a_done = pool.submit(ensure, a, origin)
        b_done = pool.submit(ensure, b, origin)
        wait_until(lambda: b.peers.stats.bytes_by_peer.get(a.url), timeout=30, what="b served by a", every=0.01)
        fleet.kill(a)
        assert_model(b_done.result(60))
        assert_model(a_done.result(60))
    assert b.peers.stats.errors_by_peer.get(a.url, 0) >= 1  # its streams were cut
    assert a.url not in b.peers.stats.banned  # dead is not dishonest
    assert origin_bytes(origin) <= 2 * MODEL_BYTES
    assert b.fetchers[-1].stats["origin_bytes"] > 0


@contextmanager
def asking_owners(origin: FaultProxy, fleet: Fleet, tmp_path: Path, owners: int = 1,
                  read_timeout: float = 5.0, connect_timeout: float = 2.0) -> Iterator[
        tuple[PeerSource, list[FleetNode], str, ObjectInfo]]:
    """Nodes downloading the big file (registered, nothing of it claimed or read yet), and the PeerSource of a
    node that ranks after them ("http://127.0.0.2" sorts after them): the file is cut in `owners` + 1 equal
    shares, the owners' first in rank order, the asker's last. Yields (asker, the owners in rank order, the file's
    sha256, the file)."""
    big = "model-00001.safetensors.bin"
    sha = hashlib.sha256(FILES[big]).hexdigest()
    nodes = sorted((fleet.node(f"owner{i}") for i in range(owners)), key=lambda n: n.url)
    source = open_source(REF, endpoint_url=origin.endpoint_url)
    obj = next(o for o in source.list() if o.relpath == big)
    parts = [PartialFile(tmp_path / f"{n.name}.part", obj, range_size=1 << 16) for n in nodes]
    for node, part in zip(nodes, parts, strict=True):
        part.open()
        node.peers.inflight.add(sha, part)
    peers = PeerSet([PeerClient(n.url, TOKEN, connect_timeout=connect_timeout, read_timeout=read_timeout)
                     for n in nodes], inflight=InFlight(), self_url="http://127.0.0.2:1")
    asker = peers.wrap(source, {obj.key: (sha, obj.size)})
    cuts = [obj.size * i // (owners + 1) for i in range(owners + 2)]
    asker.spread([(obj.key, a, b - a) for a, b in itertools.pairwise(cuts)], key=lambda r: r)
    try:
        yield asker, nodes, sha, obj
    finally:
        for node, part in zip(nodes, parts, strict=True):
            node.peers.inflight.remove(sha, part)
            part.close()
        peers.close()
        source.close()


def test_a_fleets_shares_are_cut_by_bytes_so_no_owner_relays_much_more_than_its_share(tmp_path: Path) -> None:
    """Every owner relays its share to every other node, so the largest share bounds the fill. The bench's model
    (two small files, four shards of 8 MB cut in 1 MiB ranges, the last of each 0.63 MiB: 34 ranges) at N = 16:
    cut by count, two nodes owned 3 ranges (2.6 MiB, 41 MB to relay at 1 MB/s) and one a 23-byte file and a
    range; cut by bytes, no share is over 2 MiB and the small files (1.9 MiB is 1/16 of the model)."""
    urls = [f"http://10.0.0.{i}:9479" for i in range(10, 26)]
    ranges = [("config.json", 0, 23), ("index.json", 0, 260)]
    for shard in range(4):
        ranges += [(f"shard{shard}", at, min(1 << 20, 8_000_000 - at)) for at in range(0, 8_000_000, 1 << 20)]
    source = open_source(parse_ref(f"file://{tmp_path}/"))
    shares: dict[str, int] = {}
    for me in urls:
        peers = PeerSet([PeerClient(u, TOKEN, connect_timeout=1.0, read_timeout=1.0) for u in urls if u != me],
                        self_url=me)
        node = peers.wrap(source, {})
        mine = node.spread(ranges, key=lambda r: r)
        first = mine[0]
        owned = [r for r in ranges if node._owner(r[0], r[1]) == ""]
        assert owned and first == owned[0]  # a node starts on its own share
        shares[me] = sum(n for _, _, n in owned)
        peers.close()
    total = sum(n for _, _, n in ranges)
    assert sum(shares.values()) == total  # every range has exactly one owner
    assert max(shares.values()) < (2 << 20) + 4096  # two 1 MiB ranges and the small files at most


def test_a_range_whose_owner_has_not_started_it_is_asked_again_less_and_less_often(origin: FaultProxy, fleet: Fleet,
                                                                                   tmp_path: Path) -> None:
    """The owner of a range downloads the blob but has not started that range ("missing"): the asker comes back
    after UNSTARTED_S, then twice as long each time up to UNSTARTED_MAX_S, instead of every 0.2 s (16 daemons
    starting seconds apart asked each other about 150 times a second each). Once the owner reads the range
    ("not yet") the count starts over."""
    buf = memoryview(bytearray(256 << 10))
    with asking_owners(origin, fleet, tmp_path) as (asker, (owner,), sha, obj):
        inflight, half = owner.peers.inflight, obj.size // 2
        asker.defer_while(lambda: True)  # other ranges wait: a range waiting on its owner is put back (Later)

        def ask() -> float | None:
            with pytest.raises(Later) as later:
                next(asker.read_pieces(obj, 0, half, buf))
            return later.value.delay

        assert [ask() for _ in range(6)] == [0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
        claim = inflight.claim(sha, 0, half)  # the owner reads it now: "not yet", no rate to say when yet
        assert ask() is None
        inflight.release(claim)
        assert ask() == 0.2


def test_a_node_still_listing_the_model_is_waited_for_not_its_share_read_from_the_origin(
        origin: FaultProxy, fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """B is asked for the model with A1 and A2, but its listing is held at the origin past GRACE_S (a busy daemon,
    an origin answering 503, a slow HEAD). B's peer server answers the blobs it lacks "planning" meanwhile (an idle
    node answers plain "no"), so A1 and A2 wait for B's share rather than each read it from the origin once their
    grace is over (before: 1.3x the model at N = 16 where one node started late, 1.75x with the origin down 10 s),
    nor once PENDING_S is over: a node still planning is waited for up to MAX_PENDING_S (nodes came out of a 503
    listing's backoff up to 16 s apart)."""
    # shorter than B's listing is held (GRACE_S + 2.5 s past A1's and A2's registering), and twice a second: at
    # load 50-70 B's first origin byte after its plan came over 1 s late and the waits ran out
    monkeypatch.setattr(source_module, "PENDING_S", 2.0)
    big = "model-00001.safetensors.bin"
    sha, size = hashlib.sha256(FILES[big]).hexdigest(), len(FILES[big])
    nodes = [fleet.node(name) for name in ("a1", "a2", "b")]
    for node in nodes:
        fleet.connect(node, [o.url for o in nodes if o is not node])
    a1, a2, b = nodes
    look = PeerClient(b.url, TOKEN, connect_timeout=2.0, read_timeout=5.0)
    hold = origin.add("hold", method="GET", path="/models", count=1)  # B's first GET: its listing
    pool = ThreadPoolExecutor(3)
    try:
        assert look.probe(sha, size) is None  # idle: nothing to wait for
        b_done = pool.submit(ensure, b, origin)
        assert hold.arrived.wait(30)
        assert "list-type=2" in origin.requests_for("GET", "/models")[0].query
        assert look.probe(sha, size) == "planning"
        a_done = [pool.submit(ensure, a, origin) for a in (a1, a2)]
        # both ask B for its share and are told "planning" past their grace (GRACE_S from their first ask)
        wait_until(lambda: all(a.peers.inflight.get(sha) is not None for a in (a1, a2)), timeout=30,
                   what="a1 and a2 to register their downloads", every=0.02)
        time.sleep(GRACE_S + 2.5)
        assert not b_done.done()
        hold.release.set()
        for done in (b_done, *a_done):
            assert_model(done.result(60))
    finally:
        hold.release.set()
        pool.shutdown()
        look.close()
    ratio = origin_bytes(origin) / MODEL_BYTES
    print(f"B listed {GRACE_S + 2.5:.1f} s late: origin sent {ratio:.3f}x the model")
    # B read its own share itself and served it (before: A1 and A2 each read it from the origin once their grace
    # was over, about 1.6x the model, and B took it from them); one of them may take it from the other instead,
    # once that one holds the blob whole: in one CI run one of them took none of it from B (origin 1.000x)
    assert any(a.peers.stats.bytes_by_peer.get(b.url, 0) > 0 for a in (a1, a2))
    # the origin sent the model once, and at most a piece for each node to judge each complete holder's first
    # piece by (A1 and A2 publish the blobs their two shares make whole before B starts: "The lying peer")
    assert origin_bytes(origin) <= MODEL_BYTES + 4 * JUDGED


def test_a_node_finishing_a_blob_never_answers_that_it_neither_holds_nor_downloads_it(origin: FaultProxy,
                                                                                       fleet: Fleet) -> None:
    """A node's HEAD of a blob of the model it fetches goes from "planning" to "empty"/"partial" to "blob", never
    back to a plain 404 ("neither holds, downloads nor plans it": idle): once the fetch's grace is over an idle
    owner's share goes to the next node in rank. A file finished early in a fetch (a few files: fetch/publish.py
    `durable`) left InFlight before its part became the blob, fsyncs between: an asker's HEAD then found the
    owner idle and read the share it had just finished from the origin (1 run in 4 of the test above, origin
    1.2-1.4x the model)."""
    node = fleet.node("b")
    look = PeerClient(node.url, TOKEN, connect_timeout=2.0, read_timeout=5.0)
    blobs = {hashlib.sha256(body).hexdigest(): len(body) for body in FILES.values()}
    seen: dict[str, list[str | None]] = {sha: [] for sha in blobs}
    pool = ThreadPoolExecutor(1)
    try:
        done = pool.submit(ensure, node, origin)
        while not done.done():  # every blob asked in turn, as peers waiting on it do
            for sha, size in blobs.items():
                answer = look.probe(sha, size)
                if answer is not None or seen[sha][-1:] != [None]:
                    seen[sha].append(answer)
        assert_model(done.result())
    finally:
        pool.shutdown()
        look.close()
    for sha, answers in seen.items():
        started = next((i for i, a in enumerate(answers) if a is not None), len(answers))
        assert None not in answers[started:], f"blob {sha[:12]}: {answers}"
        assert answers[-1] == "blob"


def test_a_range_waits_on_its_owner_as_long_as_pieces_take_from_the_origin(origin: FaultProxy, fleet: Fleet,
                                                                           tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner reads its range from the origin ("not yet") no faster than this node's own origin connections:
    a range waits on it without a byte for PENDING_PIECES pieces at this fetch's own origin rate, not PENDING_S
    alone (behind one 1 MB/s origin link shared by 11 nodes a piece took 9 s, owners' relays went 15 s without a
    byte, and every node handed the live owners' ranges on: 0.6x the model more), and then gives up on it."""
    monkeypatch.setattr(source_module, "PENDING_S", 0.5)  # the floor, short; the fetch's rate makes it 2.6 s
    origin.add("throttle", method="GET", path="/models/llama/", ranged_only=True, rate=400_000, count=-1)
    piece = 256 << 10
    buf = memoryview(bytearray(piece))
    with asking_owners(origin, fleet, tmp_path) as (asker, (owner,), sha, obj):
        inflight, half = owner.peers.inflight, obj.size // 2
        claim = inflight.claim(sha, 0, half)  # the owner reads its share now, and no piece of it has landed yet
        try:
            with closing(asker.read_pieces(obj, half, piece, buf)) as own:  # this node's share: its origin rate
                assert sum(len(view) for _, view in own) == piece
            asker.defer_while(lambda: True)
            started = time.monotonic()

            def waits() -> bool:
                try:
                    with closing(asker.read_pieces(obj, 0, half, buf)) as pieces:
                        next(pieces)
                    return False  # a piece from the origin: it gave up on the owner
                except Later:
                    return True

            while time.monotonic() - started < 1.5:  # three times PENDING_S: still waiting on the owner
                assert waits(), f"gave up on the owner after {time.monotonic() - started:.1f} s"
                time.sleep(0.1)
            wait_until(lambda: not waits(), timeout=10, what="the asker to give up on the owner", every=0.1)
            assert time.monotonic() - started < 8  # 4 pieces at about 400 kB/s, not for ever
        finally:
            inflight.release(claim)


def test_a_range_whose_owner_fails_goes_to_the_next_node_in_rank_not_the_origin(origin: FaultProxy, fleet: Fleet,
                                                                                tmp_path: Path) -> None:
    """The owner of a range dies after this node's grace is over: asked for the range, it fails, and the range
    goes to the next node in rank, which this node then waits on, not to the origin (the round had chosen the
    owner before it failed; with a third of a fleet killed, nodes read dead owners' ranges from the origin as
    well as the node that took them over)."""
    buf = memoryview(bytearray(256 << 10))
    with asking_owners(origin, fleet, tmp_path, owners=2) as (asker, (dead, _), _, obj):
        third = obj.size // 3
        with closing(asker.read_pieces(obj, 2 * third, 256 << 10, buf)) as own:  # its own share: the HEADs
            assert sum(len(view) for _, view in own) == 256 << 10
        time.sleep(GRACE_S + 0.2)  # the fetch's grace is over
        fleet.kill(dead)
        asker.defer_while(lambda: True)
        before = len(origin.requests_for("GET", "/models/llama/"))
        with pytest.raises(Later):  # the next node in rank has not started the range ("missing"): waited for
            next(asker.read_pieces(obj, 0, third, buf))
        assert len(origin.requests_for("GET", "/models/llama/")) == before  # nothing of it from the origin


def test_a_failed_owner_stays_down_until_it_answers_and_asking_it_holds_no_range(origin: FaultProxy, fleet: Fleet,
                                                                                 tmp_path: Path) -> None:
    """The owner of a range is cut off (its requests go unanswered: connected, never answered). Its GET times out,
    and its range goes to the next node in rank until the owner answers again, not for DOWN_S: before, once that
    ran out the range went back to it, and, dropped from the blob's holders, it was no longer waited on and the
    range went to the origin (--faults: the cut node's share, and the killed node's it had taken over, read by
    two to four nodes). Asking the down owner again (a HEAD) holds no range meanwhile: a round's HEAD to it held
    every range of the fetch until its read timeout."""
    buf = memoryview(bytearray(256 << 10))
    with asking_owners(origin, fleet, tmp_path, owners=2, read_timeout=1.2) as (asker, (cut, _), _, obj):
        third = obj.size // 3
        with closing(asker.read_pieces(obj, 2 * third, 256 << 10, buf)) as own:  # its own share: the HEADs
            assert sum(len(view) for _, view in own) == 256 << 10
        port = int(cut.url.rsplit(":", 1)[1])
        fleet.kill(cut)
        with socket.create_server(("127.0.0.1", port)):  # never accepted: connects, and nothing is answered
            asker.defer_while(lambda: True)
            before = len(origin.requests_for("GET", "/models/llama/"))
            with pytest.raises(Later):  # its GET timed out; the next node in rank has not started the range
                next(asker.read_pieces(obj, 0, third, buf))
            time.sleep(source_module.DOWN_S + 0.5)  # still silent
            started = time.monotonic()
            with pytest.raises(Later):  # still the next node's: not handed back to it, nor read from the origin
                next(asker.read_pieces(obj, 0, third, buf))
            assert time.monotonic() - started < 1.0
            assert len(origin.requests_for("GET", "/models/llama/")) == before


@contextmanager
def relay_beside_origin(origin: FaultProxy, mode: str, elsewhere_bytes: int = 1 << 20, connect_timeout: float = 2.0,
                        inflight: InFlight | None = None, second: HostilePeer | None = None,
                        **hostile: float) -> Iterator[tuple[HostilePeer, PeerSource, ObjectInfo, bytes, PeerStats]]:
    """A HostilePeer in `mode` owning (relaying) the first half of a model file, an asker ranked after it, and
    bytes from elsewhere all along (up to `elsewhere_bytes` of a file peers are not asked for, from the origin at
    300 kB/s, until the test is over): what tells a silent peer from this node's own link gone. `connect_timeout`:
    the asker's configured one (its connects wait at most that); `inflight`: the asker's (its peer server's
    registry); `second`: another peer, ranked after the asker (it owns no share asked). Yields (owner, asker, the
    file, its body, the asker's peer counters)."""
    big, other = "model-00001.safetensors.bin", "model-00002.bin"
    body = FILES[big]
    sha = hashlib.sha256(body).hexdigest()
    origin.add("throttle", method="GET", path="/models/llama/", ranged_only=True, rate=300_000, count=-1)
    source = open_source(REF, endpoint_url=origin.endpoint_url)
    objs = {o.relpath: o for o in source.list()}
    obj = objs[big]
    half = obj.size // 2
    done = threading.Event()  # the test is over: the bytes from elsewhere may stop at their next piece

    def from_elsewhere() -> int:
        got = 0
        with closing(asker.read_pieces(objs[other], 0, elsewhere_bytes, memoryview(bytearray(256 << 10)))) as pieces:
            for at, view in pieces:
                assert at == got and bytes(view) == FILES[other][at:at + len(view)]
                got += len(view)
                if done.is_set():
                    break
        return got

    with HostilePeer({sha: obj.size}, {sha: body}, mode, **hostile) as owner, ThreadPoolExecutor(1) as pool:
        urls = [owner.url] + ([second.url.replace("127.0.0.1", "localhost")] if second is not None else [])
        peers = PeerSet([PeerClient(u, TOKEN, connect_timeout=connect_timeout, read_timeout=10.0) for u in urls],
                        inflight=inflight, self_url="http://127.0.0.2:1")  # after the owner: the first half is its
        asker = peers.wrap(source, {obj.key: (sha, obj.size)})
        asker.spread([(obj.key, 0, half), (obj.key, half, obj.size - half)], key=lambda r: r)
        elsewhere = pool.submit(from_elsewhere)
        yield owner, asker, obj, body, peers.stats
        # still coming when the test ended, or all of them came: not waited for to their end (at 300 kB/s, they
        # were 3-7 s of each test)
        coming = not elsewhere.done()
        done.set()
        got = elsewhere.result(30)
        assert 0 < got <= elsewhere_bytes and (coming or got == elsewhere_bytes)
        peers.close()
    source.close()


@pytest.mark.parametrize("closes", [False, True])
def test_a_relay_cut_off_mid_stream_has_its_range_go_elsewhere_within_a_second(origin: FaultProxy,
                                                                                closes: bool) -> None:
    """The owner relaying a range is cut off mid-stream: its stream goes silent and no connect to it completes,
    while this node still receives from elsewhere (the origin). Silent for SILENT_S on every stream, probed and
    not answering a connect, it is down, and its range is read again from the origin (this node is next in rank)
    within about a second: before, a relay got RELAY_GRACE_S and a rate floor averaged since it was asked, and
    a stream that had sent 256 KiB waited its read timeout (the netns bench's cut node: 2.6-10 s). `closes`: its
    answer says Connection: close, as PeerServer._stream's of a claim it follows does; http.client gives such an
    answer its connection's socket, and the probe's cut found none to shut: the range went on at the read timeout
    (15 s here; the --faults bench: relay streams of the cut node's own share handed on at 8.3-10 s)."""
    with relay_beside_origin(origin, "relay-then-cut", closes=closes) as (owner, asker, obj, body, _):
        cut_at, gap = None, None
        with closing(asker.read_pieces(obj, 0, obj.size // 2, memoryview(bytearray(256 << 10)))) as pieces:
            for at, view in pieces:
                assert bytes(view) == body[at:at + len(view)]
                if cut_at is not None:
                    gap = time.monotonic() - cut_at
                    break
                owner.cut()  # after its first 256 KiB
                cut_at = time.monotonic()
    print(f"the cut owner's range went on {gap:.2f} s after the cut")
    assert gap is not None and gap < 2.0, f"the cut owner's range went on after {gap} s"


def test_a_range_taken_over_from_a_cut_relay_yields_each_of_its_bytes_once(origin: FaultProxy) -> None:
    """The owner relaying a range is cut off after its first 256 KiB, and this node, next in rank, reads the rest
    of the range from the origin. Each byte of the range is yielded once, in order: before, the relayed bytes were
    read from the origin again and yielded a second time (a 1,572,864-byte range yielded 1,835,008 bytes, one piece
    twice: CI's flake of the full-link test, whose owner stalled until this node took its range over), and the
    fetch engine's progress counted them twice."""
    with relay_beside_origin(origin, "relay-then-cut") as (owner, asker, obj, body, _):
        half, pos = obj.size // 2, 0
        with closing(asker.read_pieces(obj, 0, half, memoryview(bytearray(256 << 10)))) as pieces:
            for at, view in pieces:
                assert at == pos, f"a piece at {at} where the range stood at {pos}"
                assert bytes(view) == body[at:at + len(view)]
                pos += len(view)
                owner.cut()  # after its first 256 KiB
    assert pos == half
    assert len(origin.requests_for("GET", f"/models/llama/{obj.relpath}")) == 1, "the relayed bytes read again"


@pytest.mark.parametrize("closes", [False, True])  # True: as a relay of its claim answers, a stream cut can shut
def test_a_live_relay_behind_a_full_link_is_waited_for_not_taken_for_cut(origin: FaultProxy, closes: bool) -> None:
    """The owner relaying a range is alive behind a full link: its answers take 0.5 s, and its stream goes silent
    for 1.2 s while no connect to it completes (its queue drops every SYN), as this node still receives from
    elsewhere. The silence probe waits as long as answers take here (3 x 0.5 s), which spans the kernel's SYN
    resend: the owner answers it, and the whole range comes from the owner's one stream. Before, the probe gave up
    after 0.5 s and the stream was cut as unreachable, the range asked again once the owner answered (the netns
    bench at N = 32 on 0.25 MB/s links: 4,985 streams of live peers cut, much of them read from the origin again)."""
    with relay_beside_origin(origin, "relay-full-link", every_s=0.5, silent_s=1.2, closes=closes) as (
            owner, asker, obj, body, _):
        got = 0
        with closing(asker.read_pieces(obj, 0, obj.size // 2, memoryview(bytearray(256 << 10)))) as pieces:
            for at, view in pieces:
                assert bytes(view) == body[at:at + len(view)]
                got += len(view)
    assert got == obj.size // 2
    assert owner.requests == 1, "the live owner's stream was cut, and its range asked again"
    assert origin.requests_for("GET", f"/models/llama/{obj.relpath}") == [], "the owner's range read from the origin"


def test_an_owner_the_silence_probe_finds_unreachable_has_its_range_taken_over_at_once(
        origin: FaultProxy, caplog: pytest.LogCaptureFixture) -> None:
    """The owner relaying a range is cut off for 6 s after its first 256 KiB (no handshake completes: its queue
    drops every SYN, nothing refused), while this node, next in rank, still receives from elsewhere. Silent for
    SILENT_S and answering no connect within the probe's wait (as long as its answers take, ab38ba6), it is down,
    and this node takes its range over at once (reads it from the origin). Before, the node next in rank waited
    DOWN_S (2 s) more to confirm the owner down, a rule (5a6f39b) from before the probe waited as long as answers
    take: the --faults bench's n15 handed the cut node's ranges on 3-4.4 s after the cut, the others within 1-2 s."""
    caplog.set_level(logging.INFO, logger="weightcache.peers.source")
    with relay_beside_origin(origin, "relay-full-link", every_s=0.1, silent_s=6.0) as (owner, asker, obj, body, _):
        silent_at = None
        with closing(asker.read_pieces(obj, 0, obj.size // 2, memoryview(bytearray(256 << 10)))) as pieces:
            for at, view in pieces:
                assert bytes(view) == body[at:at + len(view)]
                if silent_at is not None:
                    break
                silent_at = time.time()  # its first 256 KiB: its silence and its full queue begin
    assert silent_at is not None
    found = [r.created for r in caplog.records if "answered no connect" in r.getMessage()]  # the probe's verdict
    taken = [r.created for r in caplog.records if "is not there for them" in r.getMessage()]
    assert found and taken, "the owner never found unreachable, or its range never taken over"
    # from the probe's verdict: its wait (SILENT_S, then a connect its full queue may yet take: probed again once
    # its silence doubled) is the probe's, not this rule's
    print(f"the unreachable owner's range taken over {taken[0] - silent_at:.2f} s into its silence, "
          f"{taken[0] - found[0]:.2f} s after the probe found it unreachable")
    assert taken[0] - found[0] < 1.0, f"taken over {taken[0] - found[0]:.2f} s after the probe's verdict"
    assert owner.requests == 1


@contextmanager
def served_to_peer(inflight: InFlight) -> Iterator[None]:
    """A connection of this node's peer server from the peer's host (127.0.0.1), registered as a peer's request
    registers it (InFlight.asked_by), with a KiB sent on it every 50 ms all along, as the server streams this node's
    share to that peer (whose kernel acknowledges it)."""
    stop = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as listener, \
            socket.create_connection(listener.getsockname()[:2]):
        served, _ = listener.accept()

        def stream() -> None:
            with contextlib.suppress(OSError):
                while not stop.wait(0.05):
                    served.send(b"x" * 1024)

        inflight.asked_by("127.0.0.1", served)
        sending = threading.Thread(target=stream, daemon=True)
        sending.start()
        try:
            yield
        finally:
            stop.set()
            sending.join(2.0)
            served.close()


@contextmanager
def syns_dropped(port: int) -> Iterator[None]:
    """Every SYN to this local TCP port dropped (iptables, root): a full link's queue dropping each new connection's,
    the streams open flowing (their packets, and the peer's kernel's acknowledgements, go through)."""
    rule = ["-p", "tcp", "--syn", "--dport", str(port), "-j", "DROP"]
    subprocess.run(["iptables", "-w", "-I", "INPUT", *rule], check=True, capture_output=True)
    try:
        yield
    finally:
        subprocess.run(["iptables", "-w", "-D", "INPUT", *rule], check=False, capture_output=True)


def _can_drop() -> bool:
    if os.geteuid() != 0 or shutil.which("iptables") is None:
        return False
    return subprocess.run(["iptables", "-w", "-L", "INPUT", "-n"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_drop(), reason="drops packets with iptables: root")
def test_a_live_relay_whose_kernel_acknowledges_what_this_node_sends_it_is_not_taken_for_cut(
        origin: FaultProxy) -> None:
    """The owner relaying a range is alive behind a full link: its stream goes silent for 1.5 s (it waits on its
    origin pieces) while every SYN to it is dropped (a full queue), and its answers are quick (the probe waits
    PROBE_S). This node's peer server streams to it meanwhile, and its kernel acknowledges those bytes: the probe
    asks the server's connections first and takes it for live without a connect, and the whole range comes from
    its one stream. Before, the probe's connects got no answer in 0.5 s and the live owner's stream was cut as
    unreachable (--faults bench: 0-9 streams of live peers a run; 20 in a fill without faults with a 0.5 s probe)."""
    inflight = InFlight()
    with served_to_peer(inflight), relay_beside_origin(origin, "relay-pause", elsewhere_bytes=2 << 20, silent_s=1.5,
                                                       inflight=inflight) as (owner, asker, obj, body, _):
        got = 0
        owner_port = int(owner.url.rsplit(":", 1)[1])
        with contextlib.ExitStack() as full, \
                closing(asker.read_pieces(obj, 0, obj.size // 2, memoryview(bytearray(256 << 10)))) as pieces:
            for at, view in pieces:
                assert bytes(view) == body[at:at + len(view)]
                got += len(view)
                if got == len(view):  # its first 256 KiB: its silence begins, and its SYNs are dropped
                    full.enter_context(syns_dropped(owner_port))
    assert got == obj.size // 2
    assert owner.requests == 1, "the live owner's stream was cut, and its range asked again"
    assert origin.requests_for("GET", f"/models/llama/{obj.relpath}") == [], "the owner's range read from the origin"


def test_a_range_whose_owner_goes_down_mid_round_is_handed_on_before_the_rounds_other_holders_are_asked(
        origin: FaultProxy, caplog: pytest.LogCaptureFixture) -> None:
    """The owner relaying a range is cut off after its first 256 KiB (its listener refuses: the probe's verdict
    comes at once), and the round's other holder, a relay that started before this node, answers "missing" only
    after 1 s. The range is handed on (this node, next in rank, reads it) right after the verdict: the round asks
    no other holder once the node reading the range went down. Before, the round asked the other holder first (the
    --faults bench: the cut node's ranges handed on 0.3-1.1 s after the probe's verdict, where the first went at
    once: a killed owner's connect, a peer's "not yet" after its long poll)."""
    caplog.set_level(logging.INFO, logger="weightcache.peers.source")
    big = FILES["model-00001.safetensors.bin"]  # the file relay_beside_origin's owner relays
    with HostilePeer({hashlib.sha256(big).hexdigest(): len(big)}, {}, "relay-slow-missing", every_s=1.0) as slow, \
            relay_beside_origin(origin, "relay-then-cut", second=slow) as (owner, asker, obj, body, _):
        assert len(asker.ranked) == 3 and asker.ranked[1] == ""  # the owner, this node, the slow relay
        with closing(asker.read_pieces(obj, 0, obj.size // 2, memoryview(bytearray(256 << 10)))) as pieces:
            for at, view in pieces:
                assert bytes(view) == body[at:at + len(view)]
                if at > 0:  # the range's first piece after the cut: handed on (the rest, from the origin at 300
                    break  # kB/s, would take 4 s more)
                owner.cut()  # after its first 256 KiB: new connections refused, its stream silent
    found = [r.created for r in caplog.records if "answered no connect" in r.getMessage()]
    taken = [r.created for r in caplog.records if "is not there for them" in r.getMessage()]
    assert found and taken, "the owner never found unreachable, or its range never handed on"
    print(f"handed on {taken[0] - found[0]:.2f} s after the verdict; the slow relay asked {slow.requests} times")
    assert taken[0] - found[0] < 0.5, f"handed on {taken[0] - found[0]:.2f} s after the probe's verdict"


def test_a_range_is_asked_of_its_owner_alone_not_after_its_blobs_round_of_every_peer(origin: FaultProxy) -> None:
    """A range's owner relays it (its HEAD: downloading the blob), and another peer answers nothing (a HEAD to it
    waits its 3 s read timeout). The range's first byte comes from its owner at once: its owner is asked alone, and
    the range waits on no round of every peer's HEAD. Before, a range waited for its blob's round (one peer after
    another, under the fetch's one prober lock): at N = 32 the owners of a node's last blobs' ranges were asked
    10-26 s into the fill (docs/peers.md, "N = 32: where the fill's first 20 s go")."""
    big = "model-00001.safetensors.bin"
    body, sha = FILES[big], hashlib.sha256(FILES[big]).hexdigest()
    source = open_source(REF, endpoint_url=origin.endpoint_url)
    obj = next(o for o in source.list() if o.relpath == big)
    with socket.create_server(("127.0.0.1", 0)) as silent, \
            HostilePeer({sha: obj.size}, {sha: body}, "relay-pause") as owner:  # its listener's queue: never read
        # the silent peer first in the round, as the peers a round asks before a range's owner
        peers = PeerSet([PeerClient(u, TOKEN, connect_timeout=2.0, read_timeout=3.0)
                         for u in (f"http://127.0.0.1:{silent.getsockname()[1]}", owner.url)],
                        inflight=InFlight(), self_url="http://127.0.0.2:1")  # ranked after both
        asker = peers.wrap(source, {obj.key: (sha, obj.size)})
        third = obj.size // 3
        ranges = [(obj.key, 0, third), (obj.key, third, third), (obj.key, 2 * third, obj.size - 2 * third)]
        asker.spread(ranges, key=lambda r: r)
        _, offset, length = ranges[asker.ranked.index(owner.url)]  # the owner's share: the range of its rank
        started = time.monotonic()
        with closing(asker.read_pieces(obj, offset, length, memoryview(bytearray(256 << 10)))) as pieces:
            at, view = next(pieces)
            first_byte = time.monotonic() - started
        assert bytes(view) == body[at:at + len(view)]
        peers.close()
    source.close()
    print(f"the owner's first byte {first_byte:.2f} s after the ask")
    assert first_byte < 1.5, f"the owner's range waited {first_byte:.2f} s for its blob's round"
    assert origin.requests_for("GET", f"/models/llama/{big}") == [], "the owner's range read from the origin"


@pytest.mark.parametrize("deferred", [True, False])  # False: no other range to take, it waits in its round
def test_a_range_waiting_on_its_owners_not_yet_is_handed_on_at_the_owners_verdict_not_at_its_waits_end(
        origin: FaultProxy, caplog: pytest.LogCaptureFixture, deferred: bool) -> None:
    """The owner relays the first quarter of a file and answers "not yet, in 3 s" for the second (it reads those
    bytes from the origin now); then it is cut off after the first quarter's first 256 KiB (its listener refuses:
    the probe's verdict comes once its stream is silent). The range waiting on its "not yet" is handed on (this
    node, next in rank, reads it) at that verdict: deferred (Later, on the owner), the fetch engine's wake is told
    at once and the range, taken again, walks on; waiting in its round, its wait ends. Before, it waited the
    owner's word, up to NOT_YET_MAX_S (3 s): the --faults bench's cut node's ranges not streaming at the cut went
    on 1.0-8.1 s after it."""
    caplog.set_level(logging.INFO, logger="weightcache.peers.source")
    quarter = len(FILES["model-00001.safetensors.bin"]) // 4
    with relay_beside_origin(origin, "relay-then-cut", not_yet_from=quarter) as (owner, asker, obj, body, _), \
            ThreadPoolExecutor(1) as pool:
        # the owner's share is the first two quarters (shares by bytes, two nodes)
        asker.spread([(obj.key, at, quarter) for at in range(0, 4 * quarter, quarter)], key=lambda r: r)
        woken: list[tuple[float, str]] = []
        if deferred:
            asker.defer_while(lambda: True, lambda url: woken.append((time.time(), url)))
            with pytest.raises(Later) as later:
                next(asker.read_pieces(obj, quarter, quarter, memoryview(bytearray(256 << 10))))
            assert later.value.on == owner.url and later.value.delay == 3.0
            waiting = None
        else:
            asker.defer_while(lambda: False)

            def second() -> int:
                return sum(len(v) for _, v in asker.read_pieces(obj, quarter, quarter,
                                                                memoryview(bytearray(256 << 10))))
            waiting = pool.submit(second)
            wait_until(lambda: owner.requests >= 1, timeout=5)  # its "not yet": it waits 3 s on it
        with closing(asker.read_pieces(obj, 0, quarter, memoryview(bytearray(256 << 10)))) as pieces:
            for at, view in pieces:
                assert bytes(view) == body[at:at + len(view)]
                if at > 0:
                    break
                owner.cut()  # after its first 256 KiB: new connections refused, its stream silent
        if waiting is not None:
            assert waiting.result(30) == quarter
        else:  # taken again as the engine takes it at its wake
            assert woken and woken[0][1] == owner.url, "the engine never told the owner went down"
            assert sum(len(v) for _, v in asker.read_pieces(obj, quarter, quarter,
                                                            memoryview(bytearray(256 << 10)))) == quarter
    found = [r.created for r in caplog.records if "answered no connect" in r.getMessage()]
    taken = [r.created for r in caplog.records if f"bytes {quarter}-" in r.getMessage()
             and "is not there for them" in r.getMessage()]
    assert found and taken, "the owner never found unreachable, or the range waiting on it never handed on"
    went_on = woken[0][0] if deferred else taken[0]
    print(f"the range waiting on the owner's not yet went on {went_on - found[0]:.2f} s after the verdict")
    assert went_on - found[0] < 0.5, f"went on {went_on - found[0]:.2f} s after the owner's verdict"


def test_a_silent_relays_owner_failing_another_request_is_probed_at_once_not_when_its_silence_doubled(
        origin: FaultProxy, caplog: pytest.LogCaptureFixture) -> None:
    """The owner relays the first quarter of a file, sends its first 256 KiB and goes silent (it waits on its
    origin pieces): probed, it answers, and is looked at again only once its silence has doubled. 2.3 s into the
    silence it is cut off (its listener refuses), and this node's ask of its second quarter fails. That failure
    makes the silent stream due for a probe at once: its verdict comes within about half a second, and the first
    quarter goes on. Before, the stream waited for the look once its silence had doubled (up to
    PROBE_EVERY_MAX_S, 2 s, then the probe's wait): the --faults bench's relays of the cut node silent before its
    cut went on at 2.9 s, its HEAD failed at 1.3 s."""
    caplog.set_level(logging.INFO, logger="weightcache.peers.source")
    quarter = len(FILES["model-00001.safetensors.bin"]) // 4
    with relay_beside_origin(origin, "relay-then-cut", elsewhere_bytes=2 << 20) as (owner, asker, obj, body, _), \
            ThreadPoolExecutor(1) as pool:
        asker.spread([(obj.key, at, quarter) for at in range(0, 4 * quarter, quarter)], key=lambda r: r)
        def cut_then_ask() -> None:
            time.sleep(2.3)  # its silence probed and answered at 0.5, 1 and 2 s: looked at again at 4 s
            owner.cut()
            asker.defer_while(lambda: True)
            with contextlib.suppress(Later):  # refused: the owner down, this node (next in rank) reads it or waits
                next(asker.read_pieces(obj, quarter, quarter, memoryview(bytearray(256 << 10))))

        with closing(asker.read_pieces(obj, 0, quarter, memoryview(bytearray(256 << 10)))) as pieces:
            for at, view in pieces:
                assert bytes(view) == body[at:at + len(view)]
                if at > 0:
                    break
                asking = pool.submit(cut_then_ask)  # after its first 256 KiB: its silence begins
        asking.result(10)
    failed = [r.created for r in caplog.records if f" failed at byte {quarter} " in r.getMessage()]
    found = [r.created for r in caplog.records if "answered no connect" in r.getMessage()]
    assert failed and found, "the owner's other request never failed, or its silent stream never found cut"
    print(f"the silent stream's verdict {found[0] - failed[0]:.2f} s after the owner's other request failed")
    # (a probe of refused connects: 0.2-0.3 s; the look at its doubled silence: 1.7 s later, then the probe)
    assert found[0] - failed[0] < 1.2, f"its verdict {found[0] - failed[0]:.2f} s after the other request failed"


def test_a_head_in_flight_to_a_peer_found_down_ends_at_the_verdict_not_at_its_timeout(
        origin: FaultProxy, caplog: pytest.LogCaptureFixture) -> None:
    """The owner relays a range (its first 256 KiB, then silence) and answers HEADs after 1 s; then its link is cut
    (new connections refused, nothing answered on the open ones) while a HEAD of another blob is asked of it on a
    pooled connection: that HEAD waits 3x what HEADs took (3 s). The silence probe's verdict on the owner ends the
    HEAD at once. Before, a HEAD had no Pace and went on to its timeout: a round's HEAD of the --faults cut node
    held the fetch's prober lock, and every round and lone HEAD behind it, past the node's verdict."""
    caplog.set_level(logging.INFO, logger="weightcache.peers.source")
    other = FILES["model-00002.bin"]
    with relay_beside_origin(origin, "relay-then-cut", elsewhere_bytes=2 << 20, head_s=1.0) as (
            owner, asker, obj, body, _), ThreadPoolExecutor(1) as pool:
        peer = asker._peers[0]

        def head() -> tuple[bool, float]:
            asked = asker._asks(peer, hashlib.sha256(other).hexdigest(), len(other))
            return asked, time.time()

        asking = None
        with closing(asker.read_pieces(obj, 0, obj.size // 2, memoryview(bytearray(256 << 10)))) as pieces:
            for at, view in pieces:
                assert bytes(view) == body[at:at + len(view)]
                if asking is not None:
                    break  # the rest from the origin: the owner is down
                head()  # while the owner relays: a second connection to it, pooled (answered after 1 s)
                owner.cut(mute=True)
                asking = pool.submit(head)  # on that pooled connection: never answered
        assert asking is not None
        asked, ended = asking.result(10)
    found = [r.created for r in caplog.records if "answered no connect" in r.getMessage()]
    assert found, "the owner never found unreachable"
    print(f"the HEAD in flight ended {ended - found[0]:.2f} s after the owner's verdict")
    assert not asked
    assert ended - found[0] < 0.5, f"the HEAD ended {ended - found[0]:.2f} s after the verdict"


def test_a_silence_probe_connects_again_all_through_its_wait_not_only_at_its_start() -> None:
    """A live peer's listener queue is full for 0.35 s (every SYN dropped, as a full link's queue drops a burst),
    then it accepts again. The probe sends a new connect every PROBE_GAP_S all through its wait, and one completes
    well within its 0.9 s. Before, its three connects went out in its first 0.2 s and, all dropped, waited on the
    kernel's SYN resend (1 s): the live peer was taken for unreachable (the netns bench's --faults runs: one probe
    in five lost its first SYN, and 3-5 streams of live peers a run were cut as unreachable)."""
    stop = threading.Event()
    with socket.create_server(("127.0.0.1", 0), backlog=0) as listener:
        address = listener.getsockname()[:2]
        filler = socket.create_connection(address)  # the queue's one slot: every SYN after it is dropped

        def drain() -> None:
            time.sleep(0.35)
            listener.settimeout(0.02)
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    listener.accept()[0].close()

        draining = threading.Thread(target=drain, daemon=True)
        draining.start()
        try:
            started = time.monotonic()
            up = reachable(address, 0.9).up
            took = time.monotonic() - started
        finally:
            stop.set()
            draining.join(2.0)
            filler.close()
    print(f"the probe's handshake completed after {took:.2f} s" if up else "no handshake")
    assert up, "a live peer whose queue drained after 0.35 s was taken for unreachable"
    assert took < 0.35 + 4 * PROBE_GAP_S


def test_a_silence_probe_waits_twice_what_answers_take_its_connects_going_out_all_through_it(
        origin: FaultProxy, caplog: pytest.LogCaptureFixture) -> None:
    """The owner relaying a range is cut off after its first 256 KiB (no handshake completes), and its answers
    took 0.5 s. The silence probe waits PROBE_SLACK (2) times what answers take, its connects going out all
    through the wait, so the owner is found unreachable after about 1 s of probing: before, 3 times (1.5 s),
    a span meant for the kernel's SYN resend after the probe's three connects of its first 0.2 s, and the
    --faults bench's nodes whose answers took 0.43 s probed the cut node for 1.3 s and handed its ranges on 2 s
    after the cut."""
    caplog.set_level(logging.INFO, logger="weightcache.peers.source")
    with relay_beside_origin(origin, "relay-full-link", every_s=0.5, silent_s=6.0) as (_, asker, obj, body, _), \
            closing(asker.read_pieces(obj, 0, obj.size // 2, memoryview(bytearray(256 << 10)))) as pieces:
        for at, view in pieces:
            assert bytes(view) == body[at:at + len(view)]
    found = [r.getMessage() for r in caplog.records if "answered no connect" in r.getMessage()]
    assert found, "the owner never found unreachable"
    waited = float(found[0].rsplit("within ", 1)[1].split(" s")[0])
    took = float(found[0].rsplit("answers took ", 1)[1].split(" s")[0])
    print(f"the probe waited {waited:.2f} s, answers took {took:.2f} s")
    # twice what answers took here (at least the owner's 0.5 s), not three times: measured, not assumed to be
    # 0.5 s (a loaded machine's answers took 0.65 s and more, and a bound of 1.3 s failed now and then)
    assert took >= 0.5
    assert waited == pytest.approx(max(PROBE_S, 2 * took), abs=0.02), found[0]


def test_the_full_link_fixture_accepts_again_after_its_silence_though_a_probe_filled_its_queue() -> None:
    """The fixture of the full-link tests: a connect of the asker's (its silence probe, reset at once) lands in the
    owner's one-slot queue after its listener stopped accepting and before the fixture's own connection. The
    queue is full all the same, and after `silent_s` the owner accepts again. Before, the fixture's own connect
    waited on the kernel's SYN resends behind the queued probe, and the owner never accepted again: on a loaded
    CI machine its connects timed out for 17 s and its range was taken over (the full-link test's flake)."""
    with HostilePeer({}, {}, "relay-full-link", silent_s=0.3) as owner:
        address = owner._listener.getsockname()[:2]
        owner._accepting.clear()  # as _full_link begins
        assert owner._parked.wait(5.0)
        with socket.create_connection(address) as probe:  # queued (the listener accepts nothing now), then reset
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        silence = threading.Thread(target=owner._full_link, daemon=True)
        silence.start()
        silence.join(5.0)
        assert not silence.is_alive(), "the full link outlasted its silent_s"
        socket.create_connection(address, timeout=2.0).close()  # accepted again: the queue drains


def test_a_connect_to_a_live_peer_behind_a_full_link_waits_as_long_as_its_answers_take(
        origin: FaultProxy, caplog: pytest.LogCaptureFixture) -> None:
    """The owner relaying its range is alive behind a full link: its answers take 1.4 s, and after its first
    256 KiB its listener's queue is full for 2.5 s (every SYN dropped) while this node still receives from
    elsewhere. A second range of its share is asked meanwhile, on a new connection: its connect waits as long as
    answers take here (3 x 1.4 s, under the configured 5 s), which spans the kernel's SYN resend at 3 s, and both
    ranges come from the owner, no failure on the way. Before, a peer heard from was connected to within
    KNOWN_CONNECT_S (1 s) whatever its answers took: the owner was taken for down and its share read from the
    origin (at N = 32 on 0.25 MB/s links answers took over a second). The test's connects were capped at 2 s
    (the fixture's connect timeout) before the SYN resend: the connect failed, and the test passed only when the
    failure was taken for this node's link, and failed now and then on a busy machine."""
    caplog.set_level(logging.WARNING, logger="weightcache.peers.source")
    with relay_beside_origin(origin, "relay-full-link", every_s=1.4, silent_s=2.5, connect_timeout=5.0) as (
            _, asker, obj, body, stats), \
            ThreadPoolExecutor(1) as pool:
        quarter = obj.size // 4

        def read(pos: int, end: int) -> int:
            got = 0
            with closing(asker.read_pieces(obj, pos, end - pos, memoryview(bytearray(256 << 10)))) as pieces:
                for at, view in pieces:
                    assert bytes(view) == body[at:at + len(view)]
                    got += len(view)
                    if not started and got >= 256 << 10:  # its first 256 KiB came: its queue is full now
                        time.sleep(0.1)
                        started.append(pool.submit(read, quarter, obj.size // 2))
            return got

        started: list[Future[int]] = []
        assert read(0, quarter) == quarter
        assert started and started[0].result(30) == obj.size // 2 - quarter
    assert stats.errors_by_peer == {}, "the live owner was taken for failed"
    failed = [r.getMessage() for r in caplog.records if " failed at byte " in r.getMessage()]
    assert not failed, f"a request to the live owner failed: {failed}"
    assert origin.requests_for("GET", f"/models/llama/{obj.relpath}") == [], "the owner's range read from the origin"


def test_a_connect_in_flight_to_a_peer_the_silence_probe_finds_unreachable_ends_at_the_verdict() -> None:
    """A range is asked of a peer whose listener's queue is full (every SYN dropped: a node cut off), on a new
    connection with a 5 s connect timeout. Its rate floor does not end the connect (its timeout bounds that), the
    silence probe's verdict does (Pace.cut, unreachable: as the watchdog cuts the waiting streams of a peer that
    answered no connect), at once. Before, a connect in flight had no socket the verdict could shut: it went on to
    its timeout (the --faults bench: ranges asked of the cut node just after its cut were handed on at their
    connect's timeout, 0.3-1.7 s after the verdict)."""
    with socket.create_server(("127.0.0.1", 0), backlog=0) as listener, \
            socket.create_connection(listener.getsockname()[:2]):  # its queue full: the next SYN is dropped
        client = PeerClient(f"http://127.0.0.1:{listener.getsockname()[1]}", TOKEN, connect_timeout=5.0,
                            read_timeout=5.0)
        pace = Pace(1 << 20)
        verdict = threading.Timer(0.5, lambda: pace.cut(unreachable=True))
        began = time.monotonic()
        verdict.start()
        with ThreadPoolExecutor(1) as pool:
            floor = pool.submit(lambda: time.sleep(0.2) or pace.cut())  # below the floor while it connects
            with pytest.raises(Retryable):
                client.open_span("ab" * 32, 0, 1 << 20, pace)
            assert floor.result() is False, "the rate floor cut a connect in flight"
        took = time.monotonic() - began
        verdict.join()
        client.close()
    print(f"the connect ended {took:.2f} s after it began, the verdict at 0.5 s")
    assert pace.unreachable and took < 1.5, f"the connect ended after {took:.2f} s"


def test_a_silent_live_relay_is_probed_every_silent_s_and_kept(origin: FaultProxy) -> None:
    """The owner relaying a range is alive and silent for 4 s (it waits on its origin pieces) while this node
    receives from elsewhere: the silence probe finds it up each time, and probes it again PROBE_AGAIN_S (0.4 s)
    after, not once its silence has doubled (0.4, 0.8, 1.6, 3.2 s: a relay cut just after a look was found up to
    2 s late, and the --faults bench's N = 32 live nodes handed the cut node's ranges on up to 1.8 s after its cut).
    Its stream is kept all through: one request."""
    with relay_beside_origin(origin, "relay-pause", elsewhere_bytes=2 << 20, silent_s=4.0) as (owner, asker, obj,
                                                                                                 body, _):
        got, before = 0, None
        with closing(asker.read_pieces(obj, 0, obj.size // 2, memoryview(bytearray(256 << 10)))) as pieces:
            for at, view in pieces:
                assert bytes(view) == body[at:at + len(view)]
                got += len(view)
                before = owner.connections if before is None else before  # the first 256 KiB: the silence begins
        assert before is not None
        probes = owner.connections - before
    assert got == obj.size // 2 and owner.requests == 1
    print(f"{probes} connections to the silent owner in 4 s")
    # 0.3 s of silence, then one each 0.4 s and what a probe takes: 8-9 in 4 s; doubling made 4
    assert 6 <= probes <= 11, f"{probes} probes of a live peer silent for 4 s"


class _Acknowledged:
    """A connection of this node's peer server to a peer as TCP_INFO tells it: segments in flight, which the peer's
    kernel acknowledges as they go until `cut()` (its link cut off: nothing acknowledged after)."""

    def __init__(self) -> None:
        self.cut_at: float | None = None

    def cut(self) -> None:
        self.cut_at = time.monotonic()

    def fileno(self) -> int:
        return 1_000_000

    def getsockopt(self, level: int, option: int, size: int) -> bytes:
        assert (level, option) == (socket.IPPROTO_TCP, socket.TCP_INFO)
        info = bytearray(size)
        struct.pack_into("=I", info, 24, 4)  # tcpi_unacked: segments in flight
        ago = 0.0 if self.cut_at is None else time.monotonic() - self.cut_at
        struct.pack_into("=I", info, 56, int(ago * 1000))  # tcpi_last_ack_recv, ms
        return bytes(info)


def test_a_silent_relay_found_up_then_cut_off_is_probed_when_its_acks_stop_not_at_its_backoffs_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A relay silent (it waits on its owner's origin pieces) while bytes come from elsewhere, its kernel
    acknowledging what this node's peer server sends it all along: found up without a connect at each look, next
    looked at after a backoff, here 2 s (as it was once its silence had doubled; PROBE_AGAIN_S is 0.4 s now, and a
    backoff that long shows the stall alone). Just after such a look it is cut off: its acknowledgements stop and
    its queue drops every SYN. It is probed once they have stopped ACK_STALE_S, and, nothing acknowledged all
    through, found unreachable after PROBE_S of connects: its stream is cut about 0.8 s after the cut (0.80-0.82 s
    here). Before, the probe came at the backoff's end, its verdict 2.2-2.3 s after the cut (the --faults bench: the
    cut node's relays silent before its cut, found unreachable up to 2.2 s after it)."""
    monkeypatch.setattr(client_module, "PROBE_AGAIN_S", 2.0)
    link, acked, stop = Link(), _Acknowledged(), threading.Event()

    def elsewhere() -> None:  # bytes from the origin and other peers all along
        while not stop.wait(0.05):
            link.touch()

    ours, theirs = socket.socketpair()  # the stream's socket, which the verdict shuts down
    with socket.create_server(("127.0.0.1", 0), backlog=0) as listener, \
            socket.create_connection(listener.getsockname()[:2]), ours, theirs:
        # the listener's one queue slot taken: every SYN after it is dropped, as by the cut link
        flow = PeerFlow(listener.getsockname()[:2], link, lambda: [acked])
        pace = Pace(1 << 20, 0, flow=flow)
        pace.attach(typing.cast(typing.Any, types.SimpleNamespace(sock=ours, connecting=None)))
        touching = threading.Thread(target=elsewhere, daemon=True)
        touching.start()
        WATCHDOG.watch(pace)
        try:
            # silent, found up by its acknowledgements at each look: cut off just after the look that put its next
            # a second or more ahead
            wait_until(lambda: flow.probe_after > time.monotonic() + 1.0, timeout=5.0, every=0.01,
                       what="a look that found it up, its next a second ahead")
            assert not pace.was_cut, "a silent relay acknowledging what this node sends it was cut"
            acked.cut()
            cut_at = time.monotonic()
            while not pace.was_cut and time.monotonic() < cut_at + 5.0:
                time.sleep(0.01)
            verdict = time.monotonic() - cut_at
        finally:
            WATCHDOG.unwatch(pace)
            stop.set()
            touching.join(2.0)
    print(f"the relay cut off found unreachable {verdict:.2f} s after the cut")
    assert pace.was_cut and pace.unreachable, "the relay cut off never found unreachable"
    assert verdict < 1.3, f"the relay cut off found unreachable {verdict:.2f} s after the cut"


def test_a_silence_probe_waits_as_long_as_handshakes_take_where_its_connects_were_answered_not_as_answers_do(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two peers silent while bytes come from elsewhere, cut off (their queues drop every SYN), their answers having
    taken 0.6 s (a busy daemon's: the probe's wait by answers, 1.2 s). One had its last probe's connect answered in
    0.02 s, as had this process's other probes lately: the handshakes, the queues' time without its daemon's, say a
    live peer answers within PROBE_S, and its probe ends there: found unreachable about 0.85 s into its silence.
    Before, the probe waited 1.2 s (the netns bench at N = 32 with faults: the cut node found 1.0-2.5 s after its
    cut, 0 of 20 live nodes within 1 s in a run of main). The other had no probe answered: its wait is still what
    answers take (a live relay behind a full link is waited for:
    ::test_a_live_relay_behind_a_full_link_is_waited_for_not_taken_for_cut)."""
    link, stop = Link(), threading.Event()

    def elsewhere() -> None:  # bytes from the origin and other peers all along
        while not stop.wait(0.05):
            link.touch()

    with contextlib.ExitStack() as stack:
        paces, flows = [], []
        for _ in range(2):
            listener = stack.enter_context(socket.create_server(("127.0.0.1", 0), backlog=0))
            # the listener's one queue slot taken: every SYN after it is dropped, as by a cut link
            stack.enter_context(socket.create_connection(listener.getsockname()[:2]))
            ours, theirs = socket.socketpair()  # the stream's socket, which the verdict shuts down
            stack.enter_context(ours)
            stack.enter_context(theirs)
            flow = PeerFlow(listener.getsockname()[:2], link)
            flow.took(0.6)
            pace = Pace(1 << 20, 0, flow=flow)
            pace.attach(typing.cast(typing.Any, types.SimpleNamespace(sock=ours, connecting=None)))
            paces.append(pace)
            flows.append(flow)
        # this process's recent probes are the test's alone: an earlier test's slow handshakes (a peer behind
        # dropped SYNs, answered after a second) would rightly lengthen the wait for 2 s
        monkeypatch.setattr(WATCHDOG, "_handshakes", collections.deque())
        WATCHDOG.handshake(flows[0], 0.02)  # the first peer's last probe: a connect answered in 0.02 s
        for _ in range(HANDSHAKE_MIN):  # this process's other probes lately, each answered in 0.02 s
            WATCHDOG.handshake(PeerFlow(), 0.02)
        touching = threading.Thread(target=elsewhere, daemon=True)
        touching.start()
        silent_at = min(p.asked for p in paces)
        cut: dict[int, float] = {}
        for pace in paces:
            WATCHDOG.watch(pace)
        try:
            while len(cut) < 2 and time.monotonic() < silent_at + 5.0:
                for i, pace in enumerate(paces):
                    if pace.was_cut and i not in cut:
                        cut[i] = time.monotonic() - silent_at
                time.sleep(0.01)
        finally:
            for pace in paces:
                WATCHDOG.unwatch(pace)
            stop.set()
            touching.join(2.0)
    print(f"found unreachable {cut.get(0, -1):.2f} s into its silence (handshakes answered before), "
          f"{cut.get(1, -1):.2f} s (none answered)")
    assert all(p.was_cut and p.unreachable for p in paces), "a peer cut off never found unreachable"
    assert cut[0] < 1.1, f"a peer whose handshakes were quick found unreachable {cut[0]:.2f} s into its silence"
    assert cut[1] > 1.3, f"a peer with no handshake answered found unreachable {cut[1]:.2f} s into its silence"


class _TcpInfo:
    """A server connection as TCP_INFO tells it: `unacked` segments in flight, the last acknowledgement `ago` s ago."""

    def __init__(self, unacked: int, ago: float) -> None:
        self.unacked, self.ago = unacked, ago

    def getsockopt(self, level: int, option: int, size: int) -> bytes:
        info = bytearray(size)
        struct.pack_into("=I", info, 24, self.unacked)
        struct.pack_into("=I", info, 56, int(self.ago * 1000))
        return bytes(info)


def test_an_acknowledgements_stall_after_a_look_that_found_the_peer_up_by_another_connection_is_probed() -> None:
    """A look found the peer up by an acknowledgement 0.25 s ago on a connection that has sent its last bytes; the
    connection still sending was last acknowledged 0.35 s ago, before that look, and nothing was acknowledged since:
    a stall begun after the peer was last found up, probed. Before, only the stalled connection's own acknowledgement
    counted, older than the look: never probed (the --faults bench's n2 in run 4 of 33c360a: its verdict at the
    backoff's end, 1.06 s after the cut). A stall older than every acknowledgement of the look, or a peer sent
    nothing, is not."""
    now = time.monotonic()
    finished, sending = _TcpInfo(0, 0.25), _TcpInfo(4, 0.35)
    assert acks_stalled(typing.cast(typing.Any, [finished, sending]), found_up=now - 0.22, now=now)
    assert not acks_stalled(typing.cast(typing.Any, [finished, sending]), found_up=now - 0.1, now=now)
    assert not acks_stalled(typing.cast(typing.Any, [finished, _TcpInfo(0, 0.35)]), found_up=now - 0.22, now=now)
    assert not acks_stalled(typing.cast(typing.Any, [_TcpInfo(4, 0.1), sending]), found_up=now - 0.22, now=now)


def test_the_next_node_in_rank_reads_a_down_owners_range_only_once_it_is_confirmed(
        origin: FaultProxy, fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner's answer comes later than this node's read timeout (a live node whose link is full missed it, or
    missed the silence probe): it is down, but this node, next in rank, would read its range from the origin, so
    it waits until the owner is confirmed down (dead, or silent for DOWN_S); the owner answers its HEAD at once
    and keeps its range. Before, this node read the range from the origin right after the failure (--faults: a
    live owner taken for cut by the probe, its range read twice)."""
    monkeypatch.setattr(server_module, "NOT_YET_WAIT_S", 3.0)  # the owner answers "not yet" after 3 s
    buf = memoryview(bytearray(256 << 10))
    with asking_owners(origin, fleet, tmp_path, read_timeout=1.0) as (asker, (owner,), sha, obj):
        half = obj.size // 2
        with closing(asker.read_pieces(obj, half, 256 << 10, buf)) as own:  # its own share: the HEADs
            assert sum(len(view) for _, view in own) == 256 << 10
        claim = owner.peers.inflight.claim(sha, 0, half)  # it reads its share now, nothing journalled yet
        try:
            asker.defer_while(lambda: True)
            before = len(origin.requests_for("GET", "/models/llama/"))
            with pytest.raises(Later):  # its answer timed out: down, and not confirmed, so waited for
                next(asker.read_pieces(obj, 0, half, buf))
            assert len(origin.requests_for("GET", "/models/llama/")) == before  # nothing of it from the origin
        finally:
            owner.peers.inflight.release(claim)


@contextmanager
def streaming_its_first_range(origin: FaultProxy, tmp_path: Path,
                              holding: str) -> Iterator[tuple[PeerSource, ObjectInfo]]:
    """A node filling a model file from the origin, holding its share (the first half: `holding` "its share") or
    the whole blob ("the whole blob"), that serves one stream to each asker, paced at 150 kB/s (a second's worth
    at a time); and an asker ranked after it, streaming the first quarter from it (5 s), its ranges deferred
    from then on. Yields (the asker, the file); the first quarter must have come whole when the block ends."""
    big = "model-00001.safetensors.bin"
    body = FILES[big]
    sha = hashlib.sha256(body).hexdigest()
    source = open_source(REF, endpoint_url=origin.endpoint_url)
    obj = next(o for o in source.list() if o.relpath == big)
    half, quarter = obj.size // 2, obj.size // 4
    held = {"its share": half, "the whole blob": obj.size}[holding]
    with Fleet(tmp_path / "fleet", TOKEN, PeerLimits(rate_bytes_s=150_000, max_streams=1, stream_budget=0)) as fleet, \
            ThreadPoolExecutor(1) as pool:
        node = fleet.node("filling")
        part = PartialFile(tmp_path / "filling.part", obj, range_size=1 << 16)
        part.open()
        node.peers.inflight.add(sha, part)
        part.write(0, memoryview(body[:held]), memoryview(bytearray(1 << 16)))  # read from the origin
        node.peers.inflight.from_origin(sha, 0, held)
        peers = PeerSet([PeerClient(node.url, TOKEN, connect_timeout=2.0, read_timeout=5.0)],
                        self_url="http://127.0.0.2:1")  # ranks after it: the first half is its share
        asker = peers.wrap(source, {obj.key: (sha, obj.size)})
        asker.spread([(obj.key, 0, quarter), (obj.key, quarter, half - quarter), (obj.key, half, obj.size - half)],
                     key=lambda r: r)
        first = pool.submit(lambda: sum(len(v) for _, v in asker.read_pieces(
            obj, 0, quarter, memoryview(bytearray(64 << 10)))))
        wait_until(lambda: asker.peer_bytes > 0, timeout=10, what="the first range's stream", every=0.02)
        asker.defer_while(lambda: True)
        yield asker, obj
        assert first.result(30) == quarter
        node.peers.inflight.remove(sha, part)
        part.close()
        peers.close()
    source.close()


def test_a_range_of_an_owner_busy_serving_this_node_its_other_ranges_waits_its_turn(
        origin: FaultProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner serves this node as many streams as it allows (429 beyond) and they flow: its other range waits
    its turn past PENDING_S rather than go to the origin. Before, it counted as a range with no byte for
    PENDING_S, given up on: the --faults node that took over the cut and the killed nodes' shares (four ranges)
    answered 429 to the nodes behind on them, and they read three of those ranges from the origin again."""
    monkeypatch.setattr(source_module, "PENDING_S", 2.0)
    with streaming_its_first_range(origin, tmp_path, holding="its share") as (asker, obj):
        half, quarter = obj.size // 2, obj.size // 4
        before = len(origin.requests_for("GET", "/models/llama/"))
        started = time.monotonic()
        while time.monotonic() - started < 3.0:  # past PENDING_S: the owner still busy with the first
            with pytest.raises(Later):
                next(asker.read_pieces(obj, quarter, half - quarter, memoryview(bytearray(64 << 10))))
            time.sleep(0.1)
        assert len(origin.requests_for("GET", "/models/llama/")) == before  # nothing of it from the origin


def test_an_owner_moving_its_download_to_its_blob_is_asked_again_not_the_origin(origin: FaultProxy, fleet: Fleet,
                                                                                tmp_path: Path) -> None:
    """The owner answers a plain 404 for a blob it said it was downloading: it is moving the finished download
    to its blob (or evicted it). The range waits for the owner's next HEAD rather than go to the origin."""
    buf = memoryview(bytearray(256 << 10))
    with asking_owners(origin, fleet, tmp_path) as (asker, (owner,), sha, obj):
        half = obj.size // 2
        with closing(asker.read_pieces(obj, half, 256 << 10, buf)) as own:  # its own share: the HEADs
            assert sum(len(view) for _, view in own) == 256 << 10
        asker.defer_while(lambda: True)
        claim = owner.peers.inflight.claim(sha, 0, half)
        with pytest.raises(Later):  # "not yet": the owner reads it
            next(asker.read_pieces(obj, 0, half, buf))
        owner.peers.inflight.release(claim)
        time.sleep(GRACE_S + 0.2)  # the range's grace and the fetch's are over
        owner.peers.inflight.remove(sha, owner.peers.inflight.get(sha))  # type: ignore[arg-type]
        before = len(origin.requests_for("GET", "/models/llama/"))
        with pytest.raises(Later):
            next(asker.read_pieces(obj, 0, half, buf))
        assert len(origin.requests_for("GET", "/models/llama/")) == before  # nothing of it from the origin


def test_a_node_takes_the_share_before_its_own_second_the_one_it_takes_over(tmp_path: Path) -> None:
    """A share whose owner is not there (killed, cut off) goes to the next node in rank: each node asks for its own
    share first and for the one before it in rank second, so it takes a dead owner's share at the start of the
    fill, not after every other share (with a third of 16 nodes killed it took them 15-55 s in)."""
    urls = [f"http://10.0.0.{i}:9479" for i in range(10, 14)]
    ranges = [("shard", at, 1 << 20) for at in range(0, 8 << 20, 1 << 20)]  # two ranges a node
    source = open_source(parse_ref(f"file://{tmp_path}/"))
    for place, me in enumerate(urls):
        peers = PeerSet([PeerClient(u, TOKEN, connect_timeout=1.0, read_timeout=1.0) for u in urls if u != me],
                        self_url=me)
        node = peers.wrap(source, {})
        order = node.spread(ranges, key=lambda r: r)
        owners = [urls.index(node._owner(k, at) or me) for k, at, _ in order]
        before = (place - 1) % len(urls)
        assert owners[:4] == [place, place, before, before]  # its own share, then the one it would take over
        peers.close()


def test_a_down_owners_ranges_go_to_as_many_nodes_as_its_share_has_ranges(tmp_path: Path) -> None:
    """Every node agrees on who reads a down owner's ranges: the first to the next node in rank, the second to the
    node after, so no node relays two shares to the fleet alone; and when the node after is down too, its range
    goes on to the node two after it (the first range's next), not to the next one up (the second range's next).
    Before, the next node in rank took the whole share (in --faults, the node after the cut one took the cut
    node's share and a killed node's: all ready 2.15-2.82x)."""
    urls = [f"http://10.0.0.{i}:9479" for i in range(10, 16)]
    ranges = [("shard", at, 1 << 20) for at in range(0, 12 << 20, 1 << 20)]  # two ranges a node
    source = open_source(parse_ref(f"file://{tmp_path}/"))
    down = [urls[2]]  # its HEAD refused: dead for the fetch
    for down_too, first, second in ((None, urls[3], urls[4]), (urls[4], urls[3], urls[0])):
        down += [down_too] if down_too else []
        for me in urls:
            if me in down:
                continue
            peers = PeerSet([PeerClient(u, TOKEN, connect_timeout=1.0, read_timeout=1.0) for u in urls if u != me],
                            self_url=me)
            node = peers.wrap(source, {})
            node.spread(ranges, key=lambda r: r)
            node._dead.update(down)
            readers = [node._serving_owner("shard", at, at + (1 << 20), "sha") or me for at in (4 << 20, 5 << 20)]
            assert readers == [first, second], me
            peers.close()
    source.close()


def test_a_fleet_node_reads_its_share_from_the_origin_in_small_pieces_that_its_peers_can_follow(
        origin: FaultProxy, fleet: Fleet) -> None:
    """In a fleet each origin piece of a node's share is journalled, then relayed to every other node as it lands
    (docs/peers.md, "Downloads in flight"): the range is read in RELAY_PIECES pieces of at least RELAY_PIECE_MIN,
    not in the fetch's pieces (256 KiB took 8 s to land behind a 1 MB/s origin shared by 16 nodes, and the last
    ones of every range were relayed after the origin's last byte). Alone, a node reads in its own pieces."""
    big = "model-00001.safetensors.bin"
    sha = hashlib.sha256(FILES[big]).hexdigest()
    other = fleet.node("other")  # lists the model's blob nowhere: the range is this node's, from the origin
    source = open_source(REF, endpoint_url=origin.endpoint_url)
    obj = next(o for o in source.list() if o.relpath == big)
    buf = memoryview(bytearray(256 << 10))
    sizes = {}
    for nodes in ([other.url], []):
        peers = PeerSet([PeerClient(u, TOKEN, connect_timeout=2.0, read_timeout=5.0) for u in nodes],
                        self_url="http://127.0.0.1:1")  # ranks before the other node: the first half is its own
        node = peers.wrap(source, {obj.key: (sha, obj.size)})
        half = obj.size // 2
        node.spread([(obj.key, 0, half), (obj.key, half, obj.size - half)], key=lambda r: r)
        sizes[len(nodes) + 1] = {len(view) for _, view in node.read_pieces(obj, 0, 1 << 21, buf)}
        peers.close()
    source.close()
    assert sizes == {2: {max(RELAY_PIECE_MIN, (2 << 20) // RELAY_PIECES)}, 1: {256 << 10}}



def test_a_fleet_node_reads_a_file_of_one_chunk_from_the_origin_in_relay_pieces_and_publishes_it(
        origin: FaultProxy, fleet: Fleet) -> None:
    """A file of one chunk or less has no journal (nothing to resume): its part is written in one go from the
    whole body. In a fleet its range is read from the origin in relay pieces all the same (the test above), so
    the part takes them one at a time. Before, the part had no descriptor until a whole body came, every piece
    failed with EBADF and so did the fetch (test_rollout: gpu-2, knowing gpu-1, read its one 2 MiB file from the
    origin in 32 KiB pieces; its ModelCache stayed Failed until the next pass, past the test's 30 s)."""
    other = fleet.node("other")  # fetches nothing: its share is this node's too once the grace is over
    node = fleet.node("node", peers=[other.url])
    options = {**OPTIONS, "chunk_size": 4 << 20}  # every file is one chunk: none journalled
    assert all(len(body) <= options["chunk_size"] for body in FILES.values())
    snap = node.fetcher(endpoint_url=origin.endpoint_url, **options).ensure(admin(REF))
    assert_model(snap)
    assert origin_bytes(origin) == MODEL_BYTES


def test_a_range_taken_over_asks_the_node_after_this_one_first_not_the_origin(origin: FaultProxy, fleet: Fleet,
                                                                               tmp_path: Path) -> None:
    """This node is next in rank after a dead owner, and the node after it took the range over first (this node
    was cut off meanwhile, or saw the owner later). The range is asked of that node, which reads it now ("not
    yet"), before this node reads it from the origin too: before, the cut node of the netns bench's --faults
    came back and read a killed node's share (2 MiB) that the node after it was reading already."""
    buf = memoryview(bytearray(256 << 10))
    with asking_owners(origin, fleet, tmp_path, owners=2) as (asker, (after, dead), sha, obj):
        third = obj.size // 3
        with closing(asker.read_pieces(obj, 2 * third, 256 << 10, buf)) as own:  # its own share: the HEADs
            assert sum(len(view) for _, view in own) == 256 << 10
        fleet.kill(dead)
        claim = after.peers.inflight.claim(sha, third, 2 * third)  # the node after this one reads it now
        try:
            asker.defer_while(lambda: True)
            before = len(origin.requests_for("GET", "/models/llama/"))
            with pytest.raises(Later):  # found dead, then "not yet" from the node after this one: waited for
                next(asker.read_pieces(obj, third, third, buf))
            assert len(origin.requests_for("GET", "/models/llama/")) == before  # nothing of it from the origin
        finally:
            after.peers.inflight.release(claim)



def test_an_owner_idle_past_the_grace_is_walked_past_to_the_next_node_in_rank(origin: FaultProxy, fleet: Fleet,
                                                                              tmp_path: Path) -> None:
    """The owner of a range answers a plain "no" (not "planning"): its fetch failed (the --faults cut node's
    listing timed out while its link was down), or it was never asked for the model. Once the fetch's grace is
    over its range goes to the next node in rank, which this node waits on, rather than every node reading it
    from the origin."""
    buf = memoryview(bytearray(256 << 10))
    with asking_owners(origin, fleet, tmp_path, owners=2) as (asker, (idle, _), sha, obj):
        idle.peers.inflight.remove(sha, idle.peers.inflight.get(sha))  # type: ignore[arg-type]
        third = obj.size // 3
        with closing(asker.read_pieces(obj, 2 * third, 256 << 10, buf)) as own:  # its own share: the HEADs
            assert sum(len(view) for _, view in own) == 256 << 10
        time.sleep(GRACE_S + 0.2)  # the fetch's grace is over
        asker.defer_while(lambda: True)
        before = len(origin.requests_for("GET", "/models/llama/"))
        for _ in range(2):  # and past the range's own grace (GRACE_S from its first ask, a peer downloading)
            with pytest.raises(Later):  # the next node in rank has not started it ("missing"): waited for
                next(asker.read_pieces(obj, 0, third, buf))
            time.sleep(GRACE_S + 0.2)
        assert len(origin.requests_for("GET", "/models/llama/")) == before  # nothing of it from the origin


def test_every_peer_silent_then_failing_is_this_nodes_link_not_theirs(origin: FaultProxy, fleet: Fleet,
                                                                      tmp_path: Path) -> None:
    """No peer has answered this node or sent it a byte for DOWN_S, then a peer fails: that is what this node
    sees when its own link goes (the netns bench's --faults cut node: its streams' read timeouts ended together
    10 s into the cut). The owner keeps its range (asked again, not the origin); before, the cut node took every
    live owner it waited on for down, walked past them all to itself and read 0.3x the model from the origin."""
    buf = memoryview(bytearray(256 << 10))
    with asking_owners(origin, fleet, tmp_path, owners=2) as (asker, (_, owner), _, obj):
        third = obj.size // 3
        with closing(asker.read_pieces(obj, 2 * third, 256 << 10, buf)) as own:  # its own share: the HEADs
            assert sum(len(view) for _, view in own) == 256 << 10
        time.sleep(source_module.DOWN_S + 0.2)  # nothing heard from any peer since
        port = int(owner.url.rsplit(":", 1)[1])
        fleet.kill(owner)  # its range's next node in rank is this one
        # its port's queue full: connects time out, as on a link gone (a refusal is the peer's, never this node's link)
        with socket.create_server(("127.0.0.1", port), backlog=0) as full, \
                socket.create_connection(("127.0.0.1", port)):
            asker.defer_while(lambda: True)
            before = len(origin.requests_for("GET", "/models/llama/"))
            with pytest.raises(Later):  # its failure is taken for this node's link: asked again later
                next(asker.read_pieces(obj, third, third, buf))
            assert len(origin.requests_for("GET", "/models/llama/")) == before  # nothing of it from the origin
            full.close()


@pytest.mark.parametrize("right", [True, False])
def test_a_range_taken_over_from_a_dead_relay_is_read_again_from_its_relayed_start_under_one_claim(
        origin: FaultProxy, fleet: Fleet, tmp_path: Path, right: bool) -> None:
    """The owner relayed the start of its range to this node, then died; this node is next in rank and takes the
    range over. It reads the relayed bytes from the origin again, under the claim of the rest, and its download
    holding the same bytes serves them as origin bytes, so the nodes behind it on the dead owner's relay follow
    this node for them: a node relays origin bytes only, and before, it answered them "not held" for those
    bytes, and each read the range, or its own gap, from the origin (--faults: "taken over" 0.45-0.55x the model
    where the killed nodes' shares are 0.31x). The bytes read again are not yielded again: the range goes on
    from where the relay stopped (before, they were yielded twice). Not `right`: the owner relayed other bytes
    than the origin's, and this node does not serve them (the blob's sha256 decides)."""
    buf = memoryview(bytearray(256 << 10))
    with asking_owners(origin, fleet, tmp_path) as (asker, (owner,), sha, obj):
        mine = PartialFile(tmp_path / "asker.part", obj, range_size=1 << 16)  # the asker's own download, as a
        mine.open()  # fetch registers it (written by the test as the fetch engine writes what it is yielded)
        asker._inflight.add(sha, mine)
        scratch = memoryview(bytearray(1 << 16))
        half = obj.size // 2
        with closing(asker.read_pieces(obj, half, 256 << 10, buf)) as own:  # its own share: the HEADs
            for at, view in own:
                mine.write(at, view, scratch)
        relayed = 512 << 10  # what the owner read from the origin before it died
        big = FILES["model-00001.safetensors.bin"]
        part = owner.peers.inflight.get(sha)
        assert part is not None
        sent = big[:relayed] if right else bytes(b ^ 1 for b in big[:relayed])
        part.write(0, memoryview(sent), memoryview(bytearray(1 << 16)))
        owner.peers.inflight.from_origin(sha, 0, relayed)
        asker.defer_while(lambda: True)
        got = 0
        with pytest.raises(Later):  # the owner's bytes, then "missing" past them: its own next piece, waited for
            for at, view in asker.read_pieces(obj, 0, half, buf):
                assert bytes(view) == sent[at:at + len(view)]
                mine.write(at, view, scratch)
                got = at + len(view)
        assert got == relayed
        assert asker._inflight.origin_end(sha, mine, 0, half) == 0  # a peer's bytes: not served by this node
        fleet.kill(owner)
        asker.defer_while(lambda: False)  # waits the moment until the owner is found dead (refused), not Later
        seen = []
        with closing(asker.read_pieces(obj, got, half - got, buf)) as rest:
            for at, view in rest:
                assert at == (seen[-1][0] if seen else got), "a piece yielded twice, or skipped"
                assert bytes(view) == big[at:at + len(view)]
                mine.write(at, view, scratch)
                # the claim covers the relayed bytes while the range comes, and they are served as origin bytes
                seen.append((at + len(view), asker._inflight.pending(sha, 0),
                             asker._inflight.origin_end(sha, mine, 0, half)))
        asker._inflight.remove(sha, mine)
        mine.close()
    assert seen[-1][0] == half
    if right:
        assert seen[0][1:] == (True, seen[0][0])  # from byte 0: the relayed bytes too, with the range's first piece
        assert seen[-1][2] == half  # every byte of the range: servable as origin bytes
    else:
        assert [s[2] for s in seen] == [0] * len(seen)  # none of the bytes the origin contradicts


@contextmanager
def cut_off(fleet: Fleet, node: FleetNode) -> Iterator[None]:
    """`node`'s link is cut: its peer server gone and every SYN to its port dropped (a listener whose one-slot queue
    is full), so a connect to it times out unanswered, as across a cut link. A killed node alone refuses: its
    host answers, which is the peer down, never the asker's link (source.PeerSource._not_theirs)."""
    port = int(node.url.rsplit(":", 1)[1])
    fleet.kill(node)
    with socket.create_server(("127.0.0.1", port), backlog=0), socket.create_connection(("127.0.0.1", port)):
        yield


@contextmanager
def unanswering(port: int, held: list[socket.socket], host: str = "127.0.0.1") -> Iterator[None]:
    """`host`:`port` accepts connections into `held` and answers nothing on them (a node whose link is cut, as an
    asker with pooled connections sees it: its requests time out). On leaving it stops accepting; what it accepted
    stays open and silent until the caller closes it (a link back resets nothing)."""
    listener = socket.create_server((host, port))
    listener.settimeout(0.1)
    done = False

    def accept() -> None:
        while not done:
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    with ThreadPoolExecutor(1) as pool:
        pool.submit(accept)
        try:
            yield
        finally:
            done = True
    listener.close()


def test_a_peer_whose_ask_timed_out_is_down_until_it_answers_not_dead_for_the_fetch(
        origin: FaultProxy, fleet: Fleet, tmp_path: Path) -> None:
    """An owner's HEAD times out (its link cut: no refusal, no reset), then its link comes back and it answers:
    its share is its own again, waited for, not read from the origin by this node, next in rank. Before, a peer
    whose HEAD timed out was dead for the rest of the fetch: a HEAD begun while the --faults node was cut off
    timed out a second after its link was back, and the node after it in rank read the cut node's share and the
    share it had taken over (4 MiB) from the origin while the cut node read them too."""
    buf = memoryview(bytearray(256 << 10))
    held: list[socket.socket] = []
    with asking_owners(origin, fleet, tmp_path, owners=2, read_timeout=1.0) as (asker, (_, cut), _, obj), \
            contextlib.ExitStack() as closed:
        closed.callback(lambda: [s.close() for s in held])
        third = obj.size // 3
        port = int(cut.url.rsplit(":", 1)[1])
        fleet.stop(cut)
        with unanswering(port, held), closing(asker.read_pieces(obj, 2 * third, 256 << 10, buf)) as own:
            assert sum(len(view) for _, view in own) == 256 << 10  # its own share: the HEADs
        fleet.restart(cut)  # its link is back: it answers
        time.sleep(source_module.REASK_S + 1.5)  # asked again meanwhile (a HEAD every REASK_S)
        _its_own_range_waited_for(asker, origin, obj, third, buf)


def _its_own_range_waited_for(asker: PeerSource, origin: FaultProxy, obj: ObjectInfo, third: int,
                              buf: memoryview) -> None:
    """The owner back asked for its own range (the middle third): it has not started it ("missing"), so it is
    waited for (Later), and not a byte of it comes from the origin."""
    asker.defer_while(lambda: True)
    before = len(origin.requests_for("GET", "/models/llama/"))
    with pytest.raises(Later):
        next(asker.read_pieces(obj, third, third, buf))
    assert len(origin.requests_for("GET", "/models/llama/")) == before


def test_an_owner_whose_port_refused_while_its_daemon_restarted_is_its_shares_reader_again_once_it_answers(
        origin: FaultProxy, fleet: Fleet, tmp_path: Path) -> None:
    """An owner's port refuses (its daemon restarting on its node): it is dead, and this node, next in rank, would
    read its range. Then its daemon listens on the same port again and answers: its share is its own again,
    waited for, not read from the origin by this node. Before, a peer refused once was dead for the rest of the
    fetch: a restarted daemon served none of its blobs to that fetch and its share was read twice (by it and by
    the node after it); and a peer cut off whose thread's HEAD came in the moment its port was closed stayed dead
    though it answered a moment later (tests whose cut node restarts on its port failed that way under load)."""
    buf = memoryview(bytearray(256 << 10))
    with asking_owners(origin, fleet, tmp_path, owners=2, read_timeout=1.0) as (asker, (_, restarted), sha, obj):
        third = obj.size // 3
        fleet.stop(restarted)  # its port refuses
        with closing(asker.read_pieces(obj, 2 * third, 256 << 10, buf)) as own:  # its own share: the HEADs
            assert sum(len(view) for _, view in own) == 256 << 10
        assert asker._serving_owner(obj.key, third, 2 * third, sha) == ""  # dead: its range is this node's
        fleet.restart(restarted)  # its daemon is back: it answers
        wait_until(lambda: asker._serving_owner(obj.key, third, 2 * third, sha) == restarted.url, timeout=10,
                   what="the restarted owner reading its share again", every=0.05)
        _its_own_range_waited_for(asker, origin, obj, third, buf)


def test_a_dead_owner_is_asked_again_less_often_the_longer_it_stays_dead(
        origin: FaultProxy, fleet: Fleet, tmp_path: Path) -> None:
    """An owner whose port refuses (here: hangs up on every connect, counted) is asked again by its thread, every
    REASK_S at first, then doubled per refusal up to DEAD_REASK_MAX_S (2 s): a daemon restarting on its node is
    still found within 2 s, and a fill with a third of its nodes killed does not send every live node's threads 4
    HEADs a second per dead node for MAX_PENDING_S (60 s; 0.4 ms CPU each)."""
    buf = memoryview(bytearray(256 << 10))
    with asking_owners(origin, fleet, tmp_path, owners=2, read_timeout=1.0) as (asker, (_, dead), sha, obj):
        port = int(dead.url.rsplit(":", 1)[1])
        fleet.stop(dead)
        listener = socket.create_server(("127.0.0.1", port))  # accepts and hangs up: nothing answers HTTP there
        connects: list[float] = []

        def hang_up() -> None:
            with contextlib.suppress(OSError):
                while True:
                    conn, _ = listener.accept()
                    connects.append(time.monotonic())
                    conn.close()

        threading.Thread(target=hang_up, daemon=True).start()
        try:
            third = obj.size // 3
            with closing(asker.read_pieces(obj, 2 * third, 256 << 10, buf)) as own:  # its own share: the HEADs
                assert sum(len(view) for _, view in own) == 256 << 10
            assert asker._serving_owner(obj.key, third, 2 * third, sha) == ""  # dead: its range is this node's
            time.sleep(4.0)
            # every 0.25 s: 16 asks in these 4 s; doubled from 0.25 s (0.25, 0.5, 1, 2, 2): about 5
            asks = list(connects)
            assert 3 <= len(asks) <= 8, asks
            assert all(b - a <= source_module.DEAD_REASK_MAX_S + 0.5 for a, b in itertools.pairwise(asks))
        finally:
            listener.close()


def test_a_peer_failing_while_only_the_origin_sends_is_the_peers_fault_not_this_nodes_link(
        origin: FaultProxy, fleet: Fleet, tmp_path: Path) -> None:
    """No peer has answered this node for DOWN_S, but the origin sends it bytes all along (it reads its own share):
    its link works, so a peer failing now is down, and its range, which falls to this node, is read at once.
    Before, only peers counted: the failure was taken for this node's link and the peer asked again until the
    range's wait ran out (PENDING_S); in a --faults run a node whose asks all waited on connects to the node cut
    off took a killed node's share over 17 s late, after the node behind it had given up and read it too."""
    buf = memoryview(bytearray(256 << 10))
    with asking_owners(origin, fleet, tmp_path, owners=2) as (asker, (_, owner), _, obj), \
            ThreadPoolExecutor(1) as pool:
        third = obj.size // 3
        with closing(asker.read_pieces(obj, 2 * third, 256 << 10, buf)) as own:  # its own share: the HEADs
            assert sum(len(view) for _, view in own) == 256 << 10
        other = next(o for o in asker.list() if o.relpath == "model-00002.bin")  # not asked of peers
        reading = time.monotonic() + source_module.DOWN_S + 0.5

        def from_origin() -> None:  # a piece every 0.2 s: bytes from elsewhere, no peer heard from
            while time.monotonic() < reading:
                assert sum(len(v) for _, v in asker.read_pieces(other, 0, 16 << 10, memoryview(bytearray(16 << 10))))
                time.sleep(0.2)

        pool.submit(from_origin).result(30)
        fleet.kill(owner)  # its range's next node in rank is this one
        started = time.monotonic()
        with closing(asker.read_pieces(obj, third, third, buf)) as pieces:
            next(pieces)
        took = time.monotonic() - started
        assert took < source_module.PENDING_S / 3, f"the failed owner's range began after {took:.1f} s"


@contextmanager
def link_works(asker: PeerSource) -> Iterator[None]:
    """Bytes come to `asker` from elsewhere all along: a piece of a file peers are not asked for, from the origin,
    every 0.05 s (this node's link works: a peer's failure is the peer's, PeerSource._not_theirs)."""
    other = next(o for o in asker.list() if o.relpath == "model-00002.bin")
    stop = threading.Event()

    def from_origin() -> None:
        while not stop.wait(0.05):
            assert sum(len(v) for _, v in asker.read_pieces(other, 0, 4 << 10, memoryview(bytearray(4 << 10))))

    with ThreadPoolExecutor(1) as pool:
        reading = pool.submit(from_origin)
        try:
            yield
        finally:
            stop.set()
            reading.result(30)


def test_a_peer_heard_from_that_completes_no_connect_within_a_second_is_down(origin: FaultProxy, fleet: Fleet,
                                                                            tmp_path: Path) -> None:
    """The owner answered this fetch, then its link is cut (its connects complete no handshake: here a listener
    whose queue is full drops every SYN) while bytes still come to this node from elsewhere. A request to it that
    is still connecting fails after KNOWN_CONNECT_S, not the configured connect timeout (8 s here), and the owner
    is down: its range, which falls to this node, is read from the origin once that is confirmed (DOWN_S). The
    silence probe cuts a socket, and a connect has none yet (--faults: the streams still connecting when the node
    was cut off held its ranges 5 s). Without bytes from elsewhere the same failure is this node's link."""
    buf = memoryview(bytearray(256 << 10))
    with asking_owners(origin, fleet, tmp_path, connect_timeout=8.0) as (asker, (owner,), _, obj):
        half = obj.size // 2
        with closing(asker.read_pieces(obj, half, 256 << 10, buf)) as own:  # its own share: the HEADs
            assert sum(len(view) for _, view in own) == 256 << 10
        with cut_off(fleet, owner), link_works(asker):
            started = time.monotonic()
            with closing(asker.read_pieces(obj, 0, half, buf)) as pieces:
                next(pieces)
            took = time.monotonic() - started
        limit = source_module.DOWN_S + 3.0
        assert took < limit, f"the cut owner's range began {took:.1f} s after it was asked (at most {limit} s)"


def test_an_owner_whose_head_timed_out_is_probed_at_once_and_its_range_taken_over_at_the_verdict_not_down_s_after(
        origin: FaultProxy, fleet: Fleet, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The owner's link is cut (a listener whose queue is full drops every SYN) while bytes come to this node from
    elsewhere, and the round of this node's own share asks it: the HEAD's connect times out, and the owner is down.
    A HEAD is no stream the silence probe could look at, so the owner is probed at once: no connect answered within
    the probe's wait, it is down, confirmed, and its range, which falls to this node (next in rank), is read within
    about that wait of the failure. Before, the node next in rank waited DOWN_S (2 s) from the failure for a
    confirmation (--faults: a node whose only sign of the cut node was a HEAD's timeout handed its ranges on late)."""
    caplog.set_level(logging.INFO, logger="weightcache.peers.source")
    buf = memoryview(bytearray(256 << 10))
    with asking_owners(origin, fleet, tmp_path) as (asker, (owner,), _, obj):
        half = obj.size // 2
        with cut_off(fleet, owner), link_works(asker):
            with closing(asker.read_pieces(obj, half, 256 << 10, buf)) as own:  # its own share: the HEAD
                assert sum(len(view) for _, view in own) == 256 << 10
            with closing(asker.read_pieces(obj, 0, half, buf)) as pieces:  # the owner's: this node next
                next(pieces)
    failed = [r.created for r in caplog.records if "down until it answers" in r.getMessage()]
    taken = [r.created for r in caplog.records if "is not there for them" in r.getMessage()]
    assert failed and taken, "the owner's HEAD never timed out, or its range never taken over"
    print(f"the owner's range taken over {taken[0] - failed[0]:.2f} s after its HEAD timed out")
    assert taken[0] - failed[0] < 1.2, f"taken over {taken[0] - failed[0]:.2f} s after the owner's HEAD timed out"


def test_an_owner_up_again_whose_head_of_the_blob_was_skipped_is_asked_before_the_origin(
        origin: FaultProxy, fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner's link is cut: its HEAD of one blob times out, it is down, and the round of another blob skips it
    (its own thread asks it, of the first blob). Its link back, it answers that thread: up again, but no round
    has asked it about the second blob yet, and its range of that blob waits for one, not the origin. Before, an
    owner up again and not among the blob's holders was taken for not fetching it (--faults: two nodes read the
    cut node's share, 3 MiB, from the origin while it read it itself)."""
    monkeypatch.setattr(source_module, "REASK_S", 3.0)  # the skipping round's answer stands this long
    big, small = "model-00001.safetensors.bin", "model-00002.bin"
    owner = fleet.node("owner")  # 127.0.0.1: ranks before the asker
    source = open_source(REF, endpoint_url=origin.endpoint_url)
    objs = {o.relpath: o for o in source.list()}
    shas = {name: hashlib.sha256(FILES[name]).hexdigest() for name in (big, small)}
    parts = [PartialFile(tmp_path / f"{name}.part", objs[name], range_size=1 << 16) for name in (big, small)]
    for name, part in zip((big, small), parts, strict=True):
        part.open()
        owner.peers.inflight.add(shas[name], part)  # it downloads both
    peers = PeerSet([PeerClient(owner.url, TOKEN, connect_timeout=2.0, read_timeout=0.5)], inflight=InFlight(),
                    self_url="http://127.0.0.2:1")
    asker = peers.wrap(source, {objs[n].key: (shas[n], objs[n].size) for n in (big, small)})
    asker.spread([(objs[big].key, 0, objs[big].size), (objs[small].key, 0, objs[small].size)], key=lambda r: r)
    buf = memoryview(bytearray(256 << 10))
    port = int(owner.url.rsplit(":", 1)[1])
    held: list[socket.socket] = []
    try:
        fleet.stop(owner)
        with unanswering(port, held):
            with closing(asker.read_pieces(objs[small], 0, 256 << 10, buf)) as own:  # its own share
                next(own)  # the HEAD of the small blob timed out: down, asked again by its own thread
            down_at = time.monotonic()
            # that thread's first HEAD timed out too (its next comes REASK_S after it), and the owner is down
            # under DOWN_S: not confirmed, so waited for
            time.sleep(source_module.DOWN_S - 0.4)
            asker.defer_while(lambda: True)
            with pytest.raises(Later):  # the big blob's round skips it; down under DOWN_S: waited for
                next(asker.read_pieces(objs[big], 0, 256 << 10, buf))
        fleet.restart(owner)  # its link is back
        time.sleep(max(0.0, down_at + 0.5 + source_module.REASK_S + 0.5 - time.monotonic()))  # it answered
        before = len(origin.requests_for("GET", "/models/llama/"))
        with pytest.raises(Later):  # its range: waited for until a round asks it, not read from the origin
            next(asker.read_pieces(objs[big], 0, 256 << 10, buf))
        assert len(origin.requests_for("GET", "/models/llama/")) == before
    finally:
        for s in held:
            s.close()
        for name, part in zip((big, small), parts, strict=True):
            owner.peers.inflight.remove(shas[name], part)
            part.close()
        peers.close()
        source.close()


def test_a_head_to_a_peer_that_stops_answering_waits_as_long_as_answers_take_not_the_read_timeout(
        origin: FaultProxy, fleet: Fleet, tmp_path: Path) -> None:
    """The owner answered this fetch in milliseconds, then stops answering (its link cut, as an asker with pooled
    connections sees it: the connect is done, the answer never comes). A HEAD to it fails once it has waited as
    long as a GET waits for its headers (SLOW_GRACE_S here), not the configured read timeout (8 s here), and the
    range goes on. Before, the HEAD waited the read timeout while every round of the fetch waited on it (one
    prober at a time): the --faults cut node's ranges were handed on 8.7-10 s into its cut."""
    big, small = "model-00001.safetensors.bin", "model-00002.bin"
    owner = fleet.node("owner")
    source = open_source(REF, endpoint_url=origin.endpoint_url)
    objs = {o.relpath: o for o in source.list()}
    shas = {name: hashlib.sha256(FILES[name]).hexdigest() for name in (big, small)}
    part = PartialFile(tmp_path / "small.part", objs[small], range_size=1 << 16)
    part.open()
    owner.peers.inflight.add(shas[small], part)  # it downloads the small blob only: the big one's HEAD comes later
    peers = PeerSet([PeerClient(owner.url, TOKEN, connect_timeout=2.0, read_timeout=8.0)], inflight=InFlight(),
                    self_url="http://127.0.0.2:1")
    asker = peers.wrap(source, {objs[n].key: (shas[n], objs[n].size) for n in (big, small)})
    buf = memoryview(bytearray(256 << 10))
    port = int(owner.url.rsplit(":", 1)[1])
    held: list[socket.socket] = []
    try:
        with closing(asker.read_pieces(objs[small], 0, 256 << 10, buf)) as pieces:  # asked of it: its answers timed
            assert sum(len(view) for _, view in pieces) == 256 << 10
        fleet.stop(owner)
        with unanswering(port, held):
            started = time.monotonic()
            with closing(asker.read_pieces(objs[big], 0, 256 << 10, buf)) as pieces:  # its HEAD of the big blob
                next(pieces)
            took = time.monotonic() - started
        limit = SLOW_GRACE_S + 2.0
        assert took < limit, f"the range began {took:.1f} s after it was asked (at most {limit} s)"
    finally:
        for s in held:
            s.close()
        owner.peers.inflight.remove(shas[small], part)
        part.close()
        peers.close()
        source.close()


def test_a_connect_timing_out_while_nothing_comes_to_this_node_is_its_own_link(origin: FaultProxy, fleet: Fleet,
                                                                              tmp_path: Path) -> None:
    """A connect to a peer this fetch has heard from times out (KNOWN_CONNECT_S) while no byte came to this node
    from anywhere lately: that is this node's own link going (under DOWN_S, so the rule of nothing heard for
    DOWN_S cannot tell yet), and the owner keeps its range, asked again, not read from the origin once the owner
    is confirmed down (the --faults node cut off took 14 live peers for down 1 s into its cut)."""
    buf = memoryview(bytearray(256 << 10))
    with asking_owners(origin, fleet, tmp_path, connect_timeout=8.0) as (asker, (owner,), _, obj):
        half = obj.size // 2
        with closing(asker.read_pieces(obj, half, 256 << 10, buf)) as own:  # its own share: the HEADs
            assert sum(len(view) for _, view in own) == 256 << 10
        with cut_off(fleet, owner):
            asker.defer_while(lambda: True)
            before = len(origin.requests_for("GET", "/models/llama/"))
            until = time.monotonic() + source_module.DOWN_S + 2.0
            while time.monotonic() < until:
                with pytest.raises(Later):  # asked again: its range is not taken from it
                    next(asker.read_pieces(obj, 0, half, buf))
        assert len(origin.requests_for("GET", "/models/llama/")) == before  # nothing of it from the origin


def test_a_range_waiting_on_its_owner_through_this_nodes_own_cut_is_not_given_up_on_for_it(
        origin: FaultProxy, fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A range waits on its owner for a byte at most PENDING_S, then the next node in rank takes it: but not while
    this node's own link is cut (nothing from anyone for DOWN_S), and after its link is back the wait counts from
    then. Counted through the --faults cut, a live owner relaying its range was given up on 9 s into the cut node's
    cut, the range handed to nodes that never read it, and the cut node, its link back, waited on them until another
    node published the blob (the last node ready). Here PENDING_S is DOWN_S + 0.5 s and the owner is cut off for
    longer: the range stays its owner's, asked again, nothing of it read from the origin."""
    monkeypatch.setattr(source_module, "PENDING_S", source_module.DOWN_S + 0.5)
    buf = memoryview(bytearray(256 << 10))
    with asking_owners(origin, fleet, tmp_path, connect_timeout=8.0) as (asker, (owner,), sha, obj):
        half = obj.size // 2
        with closing(asker.read_pieces(obj, half, 256 << 10, buf)) as own:  # its own share: the HEADs
            assert sum(len(view) for _, view in own) == 256 << 10
        before = len(origin.requests_for("GET", "/models/llama/"))
        asker.defer_while(lambda: True)
        with cut_off(fleet, owner):
            until = time.monotonic() + source_module.PENDING_S + 1.5
            while time.monotonic() < until:
                with pytest.raises(Later):  # asked again: its range is not taken from it
                    next(asker.read_pieces(obj, 0, half, buf))
        fleet.restart(owner)  # its link back: it answers ("missing": nothing read yet), so this node's link is too
        with pytest.raises(Later):  # waited for: its wait counts from the link's return, not from its last byte
            next(asker.read_pieces(obj, 0, half, buf))
        assert asker._serving_owner(obj.key, 0, half, sha) == owner.url
        assert len(origin.requests_for("GET", "/models/llama/")) == before  # nothing of it from the origin


def test_a_refusal_while_nothing_comes_to_this_node_is_the_peer_down_not_its_own_link(
        origin: FaultProxy, fleet: Fleet, tmp_path: Path) -> None:
    """Nothing came to this node from anywhere for DOWN_S, then the owner refuses (its daemon is gone): a refusal is
    its host answering, so this node's link is up and the owner is down. Its range, which falls to this node, is
    read from the origin at once and whole, the failure counts against the owner, and this node is not marked cut
    off (Link.cut_back: a claimed read hands its rest on after a cut). Before, after DOWN_S of quiet every failure
    was taken for this node's link, refusals too: the dead owner was asked again, never found down, until the
    range's wait ran out (PENDING_S, 15 s), and this node was taken for cut off."""
    buf = memoryview(bytearray(256 << 10))
    big = FILES["model-00001.safetensors.bin"]
    with asking_owners(origin, fleet, tmp_path) as (asker, (owner,), _, obj):
        half = obj.size // 2
        with closing(asker.read_pieces(obj, half, 256 << 10, buf)) as own:  # its own share: the HEADs
            assert sum(len(view) for _, view in own) == 256 << 10
        time.sleep(source_module.DOWN_S + 0.2)  # nothing from anyone
        fleet.kill(owner)  # its port refuses
        started, got = time.monotonic(), 0
        with closing(asker.read_pieces(obj, 0, half, buf)) as pieces:
            for at, view in pieces:
                if not got:
                    took = time.monotonic() - started
                assert at == got and bytes(view) == big[at:at + len(view)]
                got = at + len(view)
        assert got == half
        print(f"the refusing owner's range began {took:.2f} s after it was asked")
        assert took < source_module.DOWN_S, f"the refusing owner's range began {took:.1f} s after it was asked"
        assert asker._stats.errors_by_peer.get(owner.url, 0) >= 1
        assert asker._link.cut_back == 0.0, "this node was taken for cut off"


def test_a_claimed_origin_read_cut_off_with_its_node_asks_the_node_after_it_before_reading_on(
        origin: FaultProxy, fleet: Fleet, tmp_path: Path) -> None:
    """This node reads its own share from the origin under a claim; its link is cut (nothing from anyone for
    DOWN_S, and a peer's failure meanwhile is taken for its link), the origin's connection outlives the cut, and
    the node after it in rank took the share over meanwhile. Its link back, the claimed read stops at the next
    piece, exactly where the caller's bytes end (Later), and the rest comes from that node, not the origin again.
    Before, it read on from the origin (--faults: the cut node and the next one in rank both read the cut node's
    claimed ranges, 3-4 MiB, 0.09-0.13x the model). An origin read merely held past DOWN_S, no failure taken for
    this node's link, reads on: b9d98fb stopped there too, and a node whose read was held read 0.75 MiB again."""
    buf = memoryview(bytearray(256 << 10))
    big = FILES["model-00001.safetensors.bin"]
    with asking_owners(origin, fleet, tmp_path, owners=2) as (asker, (after, dead), sha, obj), \
            contextlib.ExitStack() as cuts:
        third = obj.size // 3
        asker.defer_while(lambda: True)
        with closing(asker.read_pieces(obj, 2 * third, obj.size - 2 * third, buf)) as own:
            at, view = next(own)  # a first piece from the origin, under this node's claim
            got = at + len(view)
            time.sleep(source_module.DOWN_S + 0.2)  # the origin's bytes held, no peer asked: no cut
            at, view = next(own)
            assert at == got
            got = at + len(view)
            at, view = next(own)  # read on past the hold
            assert at == got
            got = at + len(view)
            part = after.peers.inflight.get(sha)  # the node after this one in rank took the share over
            assert part is not None
            part.write(got, memoryview(big[got:]), memoryview(bytearray(1 << 16)))
            after.peers.inflight.from_origin(sha, got, obj.size)
            time.sleep(source_module.DOWN_S + 0.2)  # nothing from anyone
            cuts.enter_context(cut_off(fleet, dead))
            with pytest.raises(Later):  # its failure is taken for this node's link: cut off
                next(asker.read_pieces(obj, third, third, buf))
            origin_before = len(origin.requests_for("GET", "/models/llama/"))
            with pytest.raises(Later) as handed:
                for at, view in own:  # the origin's next piece comes: the link is back
                    assert at == got and bytes(view) == big[at:at + len(view)]
                    got = at + len(view)
        assert handed.value.pos == got < obj.size - (256 << 10)  # nothing skipped, nothing read twice
        peer_before = asker.peer_bytes
        with closing(asker.read_pieces(obj, got, obj.size - got, buf)) as rest:
            for at, view in rest:
                assert at == got and bytes(view) == big[at:at + len(view)]
                got = at + len(view)
        assert got == obj.size
        assert asker.peer_bytes - peer_before == obj.size - handed.value.pos  # all of it from the node after
        assert len(origin.requests_for("GET", "/models/llama/")) == origin_before


def test_a_filling_peer_busy_with_this_nodes_other_streams_is_waited_for_not_the_origin(
        origin: FaultProxy, tmp_path: Path) -> None:
    """The node after this one in rank took this node's share over and holds it, and serves this node as many
    streams as it allows (429 beyond). This node's own range waits its turn (asked again every BUSY_S), not the
    origin. Before, a busy answer from a peer not the range's owner sent the range to the origin at once: in a
    --faults run the cut node, its link back, was told busy by the node after it and read the ranges that node
    had taken over again (4.2 MB, 0.13x the model)."""
    with streaming_its_first_range(origin, tmp_path, holding="the whole blob") as (asker, obj):
        half = obj.size // 2
        before = len(origin.requests_for("GET", "/models/llama/"))
        with pytest.raises(Later) as later:  # "busy": its turn waited for
            next(asker.read_pieces(obj, half, obj.size - half, memoryview(bytearray(64 << 10))))
        assert later.value.pos == half and later.value.delay == source_module.BUSY_S
        assert len(origin.requests_for("GET", "/models/llama/")) == before  # nothing of it from the origin


def test_a_filling_peer_busy_past_the_ranges_wait_while_it_serves_this_node_is_still_waited_for(
        origin: FaultProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, and the busy answers last past the range's wait without a byte (PENDING_S) while the peer's other
    stream to this node flows: the wait counts from the peer's last byte to this node, as for an owner busy serving
    it, so the range still waits its turn. Before, it counted from the range's own last byte and the range went to
    the origin: the --faults cut node, its link back, whose slots at the node after it held streams following that
    node's own slow claims, was told busy for 16-27 s and read the ranges that node had taken over again (0.08x)."""
    monkeypatch.setattr(source_module, "PENDING_S", 2.0)
    with streaming_its_first_range(origin, tmp_path, holding="the whole blob") as (asker, obj):
        half = obj.size // 2
        before = len(origin.requests_for("GET", "/models/llama/"))
        started = time.monotonic()
        while time.monotonic() - started < 3.0:  # past PENDING_S: the peer still busy with the first range
            with pytest.raises(Later):
                next(asker.read_pieces(obj, half, obj.size - half, memoryview(bytearray(64 << 10))))
            time.sleep(0.1)
        assert len(origin.requests_for("GET", "/models/llama/")) == before  # nothing of it from the origin


def test_an_owner_down_that_asks_this_nodes_peer_server_is_up_and_its_range_is_not_taken_over(
        origin: FaultProxy, fleet: Fleet, tmp_path: Path) -> None:
    """The owner's link was cut: its HEAD timed out and it is confirmed down, so this node, next in rank, would take
    its range over. Then the owner's link is back and it asks this node's peer server (for the range it handed on)
    before this node heard from it otherwise (its HEADs still wait their timeouts): it is up, and its range is its
    own again, asked of it, not read from the origin. Before, its asks did not count: the --faults cut node, its
    link back, was told "missing" by the node after it in rank and read on, while that node, not having heard from
    it, took the share over and read it too (0.16x the model, handback38's run 2)."""
    buf = memoryview(bytearray(256 << 10))
    held: list[socket.socket] = []
    big = "model-00001.safetensors.bin"
    sha = hashlib.sha256(FILES[big]).hexdigest()
    taker = fleet.node("taker")  # its peer server hears the owner's asks
    source = open_source(REF, endpoint_url=origin.endpoint_url)
    obj = next(o for o in source.list() if o.relpath == big)
    half = obj.size // 2
    with socket.socket() as free:  # a port for the owner on its own address (one peer per host)
        free.bind(("127.0.0.3", 0))
        port = free.getsockname()[1]
    owner_url = f"http://127.0.0.3:{port}"
    peers = PeerSet([PeerClient(owner_url, TOKEN, connect_timeout=1.0, read_timeout=1.0)],
                    inflight=taker.peers.inflight, self_url="http://127.0.0.4:1")  # ranks after the owner
    asker = peers.wrap(source, {obj.key: (sha, obj.size)})
    asker.spread([(obj.key, 0, half), (obj.key, half, obj.size - half)], key=lambda r: r)
    with contextlib.ExitStack() as closed:
        closed.callback(source.close)
        closed.callback(peers.close)
        closed.callback(lambda: [s.close() for s in held])
        with unanswering(port, held, "127.0.0.3"):  # cut off: its HEADs time out
            with closing(asker.read_pieces(obj, half, 256 << 10, buf)) as own:  # its own share: the HEADs
                assert sum(len(view) for _, view in own) == 256 << 10
            time.sleep(source_module.DOWN_S + 0.2)  # confirmed down: its range is this node's to read
            assert asker._serving_owner(obj.key, 0, half, sha) == ""
            with socket.create_connection(("127.0.0.1", int(taker.url.rsplit(":", 1)[1])),
                                          source_address=("127.0.0.3", 0)) as ask:  # the owner asks, link back
                ask.sendall(f"HEAD /v1/blobs/sha256/{sha} HTTP/1.1\r\nHost: taker\r\nAuthorization: Bearer "
                            f"{TOKEN.decode()}\r\nConnection: close\r\n\r\n".encode())
                assert ask.recv(1024).startswith(b"HTTP/1.1 404")  # it lacks the blob: answered all the same
            assert asker._serving_owner(obj.key, 0, half, sha) == owner_url
            asker.defer_while(lambda: True)
            before = len(origin.requests_for("GET", "/models/llama/"))
            with pytest.raises(Later):  # asked of the owner (its answer times out: down again, not confirmed)
                next(asker.read_pieces(obj, 0, half, buf))
            assert len(origin.requests_for("GET", "/models/llama/")) == before  # nothing of it from the origin


def test_an_owner_cut_off_while_still_planning_has_its_range_handed_on_within_about_a_second(
        origin: FaultProxy, fleet: Fleet, tmp_path: Path) -> None:
    """The owner is still listing and planning (its HEAD says "planning"), and so is the node after it: no peer
    holds the blob and no GET of this fetch was answered. The owner's link is cut: its HEAD waits as long as HEADs
    take to be answered (SLOW_GRACE_S here), not the read timeout, so it is found down and its range goes to the
    node after it in rank within about a second, as for an owner cut mid-transfer. Before, the HEAD waited the read
    timeout (5 s here, 10 s in the daemon) while every round's HEADs waited on it (and a failure after 2 s without
    an answer from anyone is taken for this node's own link): a --faults node cut off while the fleet was still
    listing had its share handed on 8 s after the cut."""
    buf = memoryview(bytearray(256 << 10))
    held: list[socket.socket] = []
    with asking_owners(origin, fleet, tmp_path, owners=2) as (asker, (planner, after), sha, obj), \
            contextlib.ExitStack() as closed:
        closed.callback(lambda: [s.close() for s in held])
        third = obj.size // 3
        for node in (planner, after):  # they have yet to register their downloads: still planning
            part = node.peers.inflight.get(sha)
            assert part is not None
            node.peers.inflight.remove(sha, part)
            closed.callback(functools.partial(node.peers.inflight.add, sha, part))  # as asking_owners left it
            closed.callback(node.peers.inflight.planning().done)
        with closing(asker.read_pieces(obj, 2 * third, 256 << 10, buf)) as own:  # its own share: the HEADs
            assert sum(len(view) for _, view in own) == 256 << 10
        assert asker._about_to_fetch(sha, planner.url)
        asker.defer_while(lambda: True)
        before = len(origin.requests_for("GET", "/models/llama/"))
        port = int(planner.url.rsplit(":", 1)[1])
        fleet.stop(planner)
        with unanswering(port, held):  # cut off: its HEADs time out
            cut_at = time.monotonic()
            while asker._serving_owner(obj.key, 0, third, sha) != after.url:
                assert time.monotonic() - cut_at < 2.5, "the planning owner's range not handed on"
                with pytest.raises(Later):  # waited for: the planning owner, then the node after it
                    next(asker.read_pieces(obj, 0, third, buf))
        assert len(origin.requests_for("GET", "/models/llama/")) == before  # nothing of it from the origin


def test_a_connect_timing_out_just_after_this_nodes_link_came_back_from_a_cut_is_its_own_link(
        origin: FaultProxy, fleet: Fleet, tmp_path: Path) -> None:
    """This node was cut off (nothing from anyone for DOWN_S, a peer's failure taken for its link) and its link is
    back: bytes come again. A connect to a peer it has heard from, begun then, times out (KNOWN_CONNECT_S) within
    DOWN_S of the link's return: that is still this node's link (what every node resends fills the queues), and
    the owner keeps its range, asked again. Before, it counted against the peer, down: a silence probe failing a
    second after the --faults cut node's link was back took the node after it in rank for down, and the cut node
    read the ranges that node had taken over again. A refused connect stays the peer's."""
    buf = memoryview(bytearray(256 << 10))
    with asking_owners(origin, fleet, tmp_path, owners=2, connect_timeout=8.0) as (asker, (owner, dead), _, obj), \
            ThreadPoolExecutor(1) as pool:
        third = obj.size // 3
        with closing(asker.read_pieces(obj, 2 * third, 256 << 10, buf)) as own:  # its own share: the HEADs
            assert sum(len(view) for _, view in own) == 256 << 10
        other = next(o for o in asker.list() if o.relpath == "model-00002.bin")  # not asked of peers
        stop, back = False, threading.Event()

        def from_origin() -> None:  # a piece every 0.05 s: this node's link works again
            while not stop:
                assert sum(len(v) for _, v in asker.read_pieces(other, 0, 4 << 10, memoryview(bytearray(4 << 10))))
                back.set()
                time.sleep(0.05)

        with cut_off(fleet, owner), contextlib.ExitStack() as cuts:
            time.sleep(source_module.DOWN_S + 0.2)  # nothing from anyone
            cuts.enter_context(cut_off(fleet, dead))
            asker.defer_while(lambda: True)
            with pytest.raises(Later):  # its failure is taken for this node's link: cut off
                next(asker.read_pieces(obj, third, third, buf))
            reading = pool.submit(from_origin)  # the link is back
            try:
                assert back.wait(5)
                back_at = time.monotonic()
                before = len(origin.requests_for("GET", f"/models/llama/{obj.relpath}"))
                with pytest.raises(Later):  # its owner's connect timed out: asked again, not down
                    next(asker.read_pieces(obj, 0, third, buf))
                assert time.monotonic() - back_at < source_module.DOWN_S
            finally:
                stop = True
                reading.result(30)
        assert asker._stats.errors_by_peer.get(owner.url, 0) == 0
        assert len(origin.requests_for("GET", f"/models/llama/{obj.relpath}")) == before  # none of it from the origin


def test_a_taken_over_range_handed_back_after_a_cut_reads_on_from_where_it_stopped_not_its_relayed_start(
        origin: FaultProxy, fleet: Fleet, tmp_path: Path) -> None:
    """This node took a dead owner's range over and read it from the origin from the first byte the owner relayed
    to it (the relayed bytes again, under its claim, not yielded again), then was cut off and handed the rest back
    to the rounds. The node after it in rank lacks it: the rest is read from the origin from where the claim
    stopped, not from the relayed start a second time (the relayed bytes were read again under the first claim
    already)."""
    buf = memoryview(bytearray(256 << 10))
    big = FILES["model-00001.safetensors.bin"]
    with asking_owners(origin, fleet, tmp_path, owners=3) as (asker, (_, dead, relay), sha, obj), \
            contextlib.ExitStack() as cuts:
        mine = PartialFile(tmp_path / "asker.part", obj, range_size=1 << 16)  # the asker's download (_reread)
        mine.open()
        asker._inflight.add(sha, mine)
        scratch = memoryview(bytearray(1 << 16))
        q = obj.size // 4
        with closing(asker.read_pieces(obj, 3 * q, 256 << 10, buf)) as own:  # its own share: the HEADs
            for at, view in own:
                mine.write(at, view, scratch)
        relayed = 256 << 10  # what the owner read from the origin and relayed before it died
        part = relay.peers.inflight.get(sha)
        assert part is not None
        part.write(2 * q, memoryview(big[2 * q:2 * q + relayed]), memoryview(bytearray(1 << 16)))
        relay.peers.inflight.from_origin(sha, 2 * q, 2 * q + relayed)
        asker.defer_while(lambda: True)
        got = 2 * q
        with pytest.raises(Later):  # the owner's bytes, then "missing" past them: its own next piece, waited for
            for at, view in asker.read_pieces(obj, 2 * q, q, buf):
                mine.write(at, view, scratch)
                got = at + len(view)
        assert got == 2 * q + relayed
        fleet.kill(relay)
        asker.defer_while(lambda: False)  # waits until the owner is found down and confirmed, not Later
        path = f"/models/llama/{obj.relpath}"
        with closing(asker.read_pieces(obj, got, 3 * q - got, buf)) as rest:
            at, view = next(rest)  # the relayed bytes read again under the claim of the rest, not yielded
            assert at == got and asker._inflight.pending(sha, 2 * q)
            mine.write(at, view, scratch)
            got = at + len(view)
            assert asker._inflight.origin_end(sha, mine, 2 * q, 3 * q) == got
            time.sleep(source_module.DOWN_S + 0.2)  # nothing from anyone
            cuts.enter_context(cut_off(fleet, dead))
            asker.defer_while(lambda: True)
            with pytest.raises(Later):  # its failure is taken for this node's link: cut off
                next(asker.read_pieces(obj, q, q, buf))
            with pytest.raises(Later) as handed:
                for at, view in rest:  # the link is back: handed on at the next piece
                    assert at == got
                    mine.write(at, view, scratch)
                    got = at + len(view)
        assert handed.value.pos == got < 3 * q
        before = len(origin.requests_for("GET", path))
        asker.defer_while(lambda: False)
        with closing(asker.read_pieces(obj, got, 3 * q - got, buf)) as again:
            for at, view in again:  # the node after this one lacks it: the origin, from where it stopped
                assert at == got and bytes(view) == big[at:at + len(view)]
                got = at + len(view)
        assert got == 3 * q
        ranges = [r.range for r in origin.requests_for("GET", path)[before:]]
        assert ranges == [f"bytes={handed.value.pos}-{3 * q - 1}"]
        asker._inflight.remove(sha, mine)
        mine.close()


def _owner_cut_its_share_taken(fleet: Fleet, cut: FleetNode, taker: FleetNode, sha: str,
                               obj: ObjectInfo) -> tuple[int, int]:
    """The node after the owner in rank took the owner's share (the blob's first third) over and holds it from the
    origin; the owner is stopped. (the third, the owner's port: a test holds it unanswering, its link cut)."""
    third = obj.size // 3
    part = taker.peers.inflight.get(sha)
    assert part is not None
    part.write(0, memoryview(FILES["model-00001.safetensors.bin"][:third]), memoryview(bytearray(1 << 16)))
    taker.peers.inflight.from_origin(sha, 0, third)
    port = int(cut.url.rsplit(":", 1)[1])
    fleet.stop(cut)
    return third, port


def test_a_range_of_an_owner_back_after_a_cut_is_asked_of_its_taker_first_though_this_node_never_was(
        origin: FaultProxy, fleet: Fleet, tmp_path: Path) -> None:
    """The owner's link is cut (its HEAD times out: down) and the node after it in rank takes its range over; this
    node asks nothing of that range meanwhile, and the owner answers again ("missing": it handed the range on).
    The range is asked of the node that took it over first, and comes from it. Before, this node went back to the
    owner and waited on it, "missing" (the --faults cut node back: 37 s, until every node gave up on it)."""
    buf = memoryview(bytearray(256 << 10))
    big = FILES["model-00001.safetensors.bin"]
    held: list[socket.socket] = []
    with asking_owners(origin, fleet, tmp_path, owners=2, read_timeout=1.0) as (asker, (cut, taker), sha, obj), \
            contextlib.ExitStack() as closed:
        closed.callback(lambda: [s.close() for s in held])
        third, port = _owner_cut_its_share_taken(fleet, cut, taker, sha, obj)
        with unanswering(port, held), closing(asker.read_pieces(obj, 2 * third, 256 << 10, buf)) as own:
            assert sum(len(view) for _, view in own) == 256 << 10  # its own share: the HEADs, the owner's timed out
        assert asker._is_down(cut.url)
        fleet.restart(cut)  # its link is back: it answers
        wait_until(lambda: cut.url in asker._heard and not asker._is_down(cut.url), timeout=10,
                   what="the owner up again", every=0.05)
        asker.defer_while(lambda: True)
        got = 0
        with closing(asker.read_pieces(obj, 0, third, buf)) as pieces:
            for at, view in pieces:  # from the taker (the owner back would answer "missing": Later)
                assert at == got and bytes(view) == big[at:at + len(view)]
                got = at + len(view)
        assert got == third
        assert asker._stats.bytes_by_peer.get(taker.url) == third


def test_a_dead_owners_range_whose_taker_was_cut_off_and_is_back_is_asked_of_the_next_taker_first(
        origin: FaultProxy, fleet: Fleet, tmp_path: Path) -> None:
    """The owner is dead; the node after it took its range over and answered "not yet" (its taker, here); that node
    is cut off (its answer times out: down) and the node after it takes the range on; this node asks nothing of it
    meanwhile, and the cut node answers again ("missing": it handed the range on). The range is asked of the node
    that took it on first, and comes from it. Before, this node went back to the cut node, its taker on record,
    and waited on it, "missing" (--faults: 30 s, for the range of the killed node before the cut one)."""
    buf = memoryview(bytearray(256 << 10))
    big = FILES["model-00001.safetensors.bin"]
    held: list[socket.socket] = []
    with asking_owners(origin, fleet, tmp_path, owners=3, read_timeout=1.0) as (asker, (dead, cut, on), sha, obj), \
            contextlib.ExitStack() as closed:
        closed.callback(lambda: [s.close() for s in held])
        quarter = obj.size // 4
        fleet.stop(dead)  # its port refuses: dead for the fetch
        claim = cut.peers.inflight.claim(sha, 0, quarter)  # it took the dead owner's range over: "not yet"
        with closing(asker.read_pieces(obj, 3 * quarter, 256 << 10, buf)) as own:  # its own share: the HEADs
            assert sum(len(view) for _, view in own) == 256 << 10
        asker.defer_while(lambda: True)
        with pytest.raises(Later):  # "not yet" from the node after the dead owner: its taker on record
            next(asker.read_pieces(obj, 0, quarter, buf))
        assert asker._takers.get((obj.key, quarter)) == cut.url
        cut.peers.inflight.release(claim)
        port = int(cut.url.rsplit(":", 1)[1])
        fleet.stop(cut)
        with unanswering(port, held):
            with pytest.raises(Later):  # its answer times out: down, not confirmed, waited for
                next(asker.read_pieces(obj, 0, quarter, buf))
            assert asker._is_down(cut.url)
        fleet.restart(cut)  # its link is back: it answers ("missing")
        wait_until(lambda: not asker._is_down(cut.url), timeout=10, what="the cut node up again", every=0.05)
        part = on.peers.inflight.get(sha)  # the node after the cut one took the range on meanwhile
        assert part is not None
        part.write(0, memoryview(big[:quarter]), memoryview(bytearray(1 << 16)))
        on.peers.inflight.from_origin(sha, 0, quarter)
        got = 0
        with closing(asker.read_pieces(obj, 0, quarter, buf)) as pieces:
            for at, view in pieces:  # from the node that took it on (the cut node would answer "missing": Later)
                assert at == got and bytes(view) == big[at:at + len(view)]
                got = at + len(view)
        assert got == quarter
        assert asker._stats.bytes_by_peer.get(on.url) == quarter


def test_a_range_taken_over_while_its_owner_was_down_stays_with_its_taker_when_the_owner_is_back(
        origin: FaultProxy, fleet: Fleet, tmp_path: Path) -> None:
    """The owner's link is cut (its HEAD times out: down), its range goes to the node after it in rank, which
    serves it; then the owner answers again. The rest of the range is still asked of that node, not of the owner
    back. Before, the range went back to the owner: the --faults cut node, its link back, hands its claims on to
    the node after it in rank (_hand_back) and cannot relay that node's bytes, and the others, back on it, waited
    "missing" until it published (44 s; all ready 2.67x)."""
    buf = memoryview(bytearray(256 << 10))
    big = FILES["model-00001.safetensors.bin"]
    held: list[socket.socket] = []
    with asking_owners(origin, fleet, tmp_path, owners=2, read_timeout=1.0) as (asker, (cut, taker), sha, obj), \
            contextlib.ExitStack() as closed:
        closed.callback(lambda: [s.close() for s in held])
        third, port = _owner_cut_its_share_taken(fleet, cut, taker, sha, obj)
        with unanswering(port, held):
            with closing(asker.read_pieces(obj, 2 * third, 256 << 10, buf)) as own:  # its own share: the HEADs
                assert sum(len(view) for _, view in own) == 256 << 10  # the owner's timed out: down
            with closing(asker.read_pieces(obj, 0, third, buf)) as pieces:
                at, view = next(pieces)  # from the node after it in rank
                assert at == 0 and bytes(view) == big[:len(view)]
                got = len(view)
        assert asker._stats.bytes_by_peer.get(taker.url) == got
        fleet.restart(cut)  # its link is back: it answers
        wait_until(lambda: cut.url in asker._heard and not asker._is_down(cut.url), timeout=10,
                   what="the owner up again", every=0.05)
        asker.defer_while(lambda: True)
        with closing(asker.read_pieces(obj, got, third - got, buf)) as rest:
            for at, view in rest:  # from the taker still (the owner back would answer "missing": Later)
                assert at == got and bytes(view) == big[at:at + len(view)]
                got = at + len(view)
        assert got == third
        assert asker._stats.bytes_by_peer.get(taker.url) == third
