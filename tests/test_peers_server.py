"""The peer server as an attacker meets it: no token, a wrong one, names that are not digests, traversal, blobs
that are symlinks, FIFOs or sit under a symlinked directory, bad ranges, too many streams."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3

from tests.peers_fleet import Fleet, FleetNode
from weightcache.download import PartialFile
from weightcache.errors import ConfigError
from weightcache.peers import PeerClient, peer_base_url
from weightcache.peers.client import PeerBusy, PeerRangePending, PeerUnreachable
from weightcache.peers.inflight import STALL_S, Claim, InFlight
from weightcache.peers.server import (
    MAX_DIGEST_BYTES,
    MAX_DIGEST_SPANS,
    NOT_YET_WAIT_S,
    PeerLimits,
    PeerServer,
    parse_range,
    parse_spans,
)
from weightcache.sources import ObjectInfo
from weightcache.store import Store

TOKEN = b"peer-token-0123456789abcdef"
BODY = os.urandom(300_000)
SHA = hashlib.sha256(BODY).hexdigest()
AUTH = {"Authorization": "Bearer " + TOKEN.decode()}


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with Fleet(tmp_path, TOKEN, PeerLimits(rate_bytes_s=0, max_streams=1)) as f:
        yield f


def holding_node(fleet: Fleet) -> FleetNode:
    n = fleet.node("n")
    blob = n.store.layout.blob(SHA)
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(BODY)
    return n


@pytest.fixture
def node(fleet: Fleet) -> FleetNode:
    return holding_node(fleet)


@pytest.fixture
def http() -> Iterator[urllib3.PoolManager]:
    pool = urllib3.PoolManager(retries=False, timeout=10)
    yield pool
    pool.clear()


def get(http: urllib3.PoolManager, node: FleetNode, path: str, headers: dict[str, str] | None = None,
        method: str = "GET") -> urllib3.BaseHTTPResponse:
    return http.request(method, node.url + path, headers=headers if headers is not None else AUTH)


def test_requests_without_the_token_are_401(http: urllib3.PoolManager, node: FleetNode) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789abc"},
                    {"Authorization": "Bearer " + TOKEN.decode() + "x"}, {"Authorization": TOKEN.decode()}):
        for method in ("GET", "HEAD"):
            resp = get(http, node, f"/v1/blobs/sha256/{SHA}", headers, method)
            assert resp.status == 401, (headers, method)
            assert BODY[:100] not in resp.data


def test_a_published_blob_is_served_whole_ranged_and_by_head(http: urllib3.PoolManager, node: FleetNode) -> None:
    whole = get(http, node, f"/v1/blobs/sha256/{SHA}")
    assert whole.status == 200 and whole.data == BODY
    part = get(http, node, f"/v1/blobs/sha256/{SHA}", {**AUTH, "Range": "bytes=1000-1999"})
    assert part.status == 206 and part.data == BODY[1000:2000]
    assert part.headers["Content-Range"] == f"bytes 1000-1999/{len(BODY)}"
    tail = get(http, node, f"/v1/blobs/sha256/{SHA}", {**AUTH, "Range": "bytes=-10"})
    assert tail.status == 206 and tail.data == BODY[-10:]
    head = get(http, node, f"/v1/blobs/sha256/{SHA}", method="HEAD")
    assert head.status == 200 and head.headers["Content-Length"] == str(len(BODY))
    beyond = get(http, node, f"/v1/blobs/sha256/{SHA}", {**AUTH, "Range": f"bytes={len(BODY)}-"})
    assert beyond.status == 416 and beyond.headers["Content-Range"] == f"bytes */{len(BODY)}"


def test_a_digest_request_answers_the_sha256_of_each_span(http: urllib3.PoolManager, node: FleetNode) -> None:
    """`?digests=A-B,...`: one SHA-256 per span of a published blob, for an asker to judge a peer's piece by
    (docs/peers.md, "The lying peer"); the same token as a body, and the client reads it back as bytes."""
    url = f"/v1/blobs/sha256/{SHA}?digests=0-99,1000-1999,{len(BODY) - 1}-{len(BODY) - 1}"
    resp = get(http, node, url)
    assert resp.status == 200
    assert resp.json() == {"sha256": [hashlib.sha256(BODY[:100]).hexdigest(),
                                      hashlib.sha256(BODY[1000:2000]).hexdigest(),
                                      hashlib.sha256(BODY[-1:]).hexdigest()]}
    assert get(http, node, url, {}).status == 401
    client = PeerClient(node.url, TOKEN, connect_timeout=2, read_timeout=5)
    try:
        assert client.piece_digests(SHA, [(5, 70_000)]) == [hashlib.sha256(BODY[5:70_000]).digest()]
        assert client.piece_digests("ab" * 32, [(0, 10)]) == [None]  # not held: nothing vouched for
    finally:
        client.close()


@pytest.mark.parametrize("spans", ["", "5", "7-3", f"0-{len(BODY)}", "-5", "0-5,", "٣-5", "1" * 20 + "-2",
                                   ",".join(["0-1"] * (MAX_DIGEST_SPANS + 1))])
def test_malformed_digest_spans_are_400(http: urllib3.PoolManager, node: FleetNode, spans: str) -> None:
    resp = get(http, node, f"/v1/blobs/sha256/{SHA}?digests={spans}")
    assert resp.status == 400 and b"digests=FIRST-LAST" in resp.data


def test_spans_over_the_digest_byte_bound_are_refused() -> None:
    assert parse_spans(f"0-{MAX_DIGEST_BYTES - 1}", MAX_DIGEST_BYTES + 10) == [(0, MAX_DIGEST_BYTES)]
    assert parse_spans(f"0-{MAX_DIGEST_BYTES}", MAX_DIGEST_BYTES + 10) is None
    assert parse_spans(",".join(["0-1"] * MAX_DIGEST_SPANS), 10) == [(0, 2)] * MAX_DIGEST_SPANS


def test_names_that_are_not_digests_are_refused(http: urllib3.PoolManager, node: FleetNode) -> None:
    assert get(http, node, f"/v1/blobs/sha256/{SHA.upper()}").status == 400
    assert get(http, node, f"/v1/blobs/sha256/{SHA[:-1]}").status == 400
    assert get(http, node, f"/v1/blobs/sha256/{SHA}0").status == 400
    assert get(http, node, "/v1/blobs/sha256/..%2F..%2Findex.db").status in (400, 404)
    for path in ("/v1/blobs/sha256/../../index.db", "/v1/blobs/../manifests", "/v1/blobs/sha256/",
                 f"/v1/blobs/sha256/{SHA}/x"):
        resp = get(http, node, path)
        assert resp.status in (400, 404), path
        assert BODY[:100] not in resp.data
    assert get(http, node, f"/v1/blobs/sha256/{SHA}", method="PUT").status == 405  # read-only


def test_symlinks_and_fifos_in_the_store_are_never_followed(http: urllib3.PoolManager, node: FleetNode,
                                                            tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"private bytes of another tenant")
    link_sha = "a" * 64
    link = node.store.layout.blob(link_sha)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(secret)  # a symlinked blob
    outside = tmp_path / "outside"
    outside.mkdir()
    dir_sha = "b" * 64
    (outside / dir_sha).write_bytes(b"private bytes of another tenant")
    node.store.layout.blob(dir_sha).parent.symlink_to(outside)  # a symlinked fan-out directory
    fifo_sha = "c" * 64
    fifo = node.store.layout.blob(fifo_sha)
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    for sha in (link_sha, dir_sha, fifo_sha, "d" * 64):
        for method in ("GET", "HEAD"):
            resp = get(http, node, f"/v1/blobs/sha256/{sha}", method=method)
            assert resp.status == 404, (sha, method)
            assert b"private" not in resp.data


def test_a_paced_stream_holds_its_peers_only_slot_and_a_second_gets_429(http: urllib3.PoolManager,
                                                                       tmp_path: Path) -> None:
    with Fleet(tmp_path, TOKEN, PeerLimits(rate_bytes_s=8 << 10, max_streams=1)) as fleet:
        rate_limited(http, holding_node(fleet))


def rate_limited(http: urllib3.PoolManager, node: FleetNode) -> None:
    slow = http.request("GET", f"{node.url}/v1/blobs/sha256/{SHA}", headers=AUTH, preload_content=False)
    try:
        assert slow.status == 200
        slow.read(1024)  # the stream is open and rate-limited: 8 KiB/s, about 36 s for the whole body
        second = get(http, node, f"/v1/blobs/sha256/{SHA}")
        assert second.status == 429 and second.headers["Retry-After"] == "1"
        assert get(http, node, f"/v1/blobs/sha256/{SHA}", method="HEAD").status == 200  # HEADs cost no stream
        client = PeerClient(node.url, TOKEN, connect_timeout=2, read_timeout=5)
        with pytest.raises(PeerBusy):  # busy is no fault of the peer's: the asker waits or goes elsewhere
            client.open_range(SHA, 0, 10)
        client.close()
    finally:
        slow.release_conn()
        slow.close()


def test_the_client_reads_a_peer_as_holding_only_with_the_listed_size(node: FleetNode) -> None:
    client = PeerClient(node.url, TOKEN, connect_timeout=2, read_timeout=5)
    wrong = PeerClient(node.url, b"another-token-0123456789", connect_timeout=2, read_timeout=5)
    dead = PeerClient("http://127.0.0.1:9", TOKEN, connect_timeout=2, read_timeout=5)
    try:
        assert client.holds(SHA, len(BODY))
        assert not client.holds(SHA, len(BODY) + 1)
        assert not client.holds("e" * 64, 1)
        assert not wrong.holds(SHA, len(BODY))
        with pytest.raises(PeerUnreachable, match=r"127\.0\.0\.1:9\b"):
            dead.holds(SHA, len(BODY))
    finally:
        for c in (client, wrong, dead):
            c.close()


def test_peer_urls_are_host_and_port_only() -> None:
    assert peer_base_url("http://10.0.0.5:9479/") == "http://10.0.0.5:9479"
    assert peer_base_url("https://[fd00::5]:9479") == "https://[fd00::5]:9479"
    for bad in ("ftp://h:1", "http://user:secret@h:1", "http://h:1/v1", "h:1", "http://h:99999", "http://h:1?x"):
        with pytest.raises(ConfigError) as err:
            peer_base_url(bad)
        assert "secret" not in str(err.value)


@pytest.mark.parametrize(("header", "want"), [
    (None, (0, 100, False)), ("bytes=0-9", (0, 10, True)), ("bytes=90-", (90, 100, True)), ("bytes=100-", None),
    ("bytes=-5", (95, 100, True)), ("bytes=50-500", (50, 100, True)), ("bytes=100-", None), ("bytes=-0", None),
    ("bytes=9-1", (0, 100, False)), ("bytes=0-1,5-6", (0, 100, False)), ("items=0-1", (0, 100, False)),
    ("bytes=-", (0, 100, False)),
])
def test_range_headers(header: str | None, want: tuple[int, int, bool] | None) -> None:
    assert parse_range(header, 100) == want


def test_a_download_in_flight_is_served_only_where_it_is_journalled(http: urllib3.PoolManager, fleet: Fleet,
                                                                    tmp_path: Path) -> None:
    n = fleet.node("busy")
    part = PartialFile(tmp_path / "x.part", ObjectInfo("k", "k", len(BODY), "e", None, None), range_size=1 << 16)
    part.open()
    n.server.inflight.add(SHA, part)  # type: ignore[union-attr]
    n.server.inflight.from_origin(SHA, 0, 100_000)  # type: ignore[union-attr]
    part.write(0, memoryview(BODY)[:100_000], memoryview(bytearray(1 << 16)))
    part.write(150_000, memoryview(BODY)[150_000:200_000], memoryview(bytearray(1 << 16)))  # from a peer
    try:
        head = get(http, n, f"/v1/blobs/sha256/{SHA}", method="HEAD")
        assert head.status == 200 and head.headers["X-Weightcache-Partial"] == "1"
        have = get(http, n, f"/v1/blobs/sha256/{SHA}", {**AUTH, "Range": "bytes=10-99999"})
        assert have.status == 206 and have.data == BODY[10:100_000]
        # a range that runs past the journalled bytes gets what there is, as a shorter range
        short = get(http, n, f"/v1/blobs/sha256/{SHA}", {**AUTH, "Range": "bytes=99990-100010"})
        assert short.status == 206 and short.headers["Content-Range"] == f"bytes 99990-99999/{len(BODY)}"
        assert short.data == BODY[99_990:100_000]
        lack = get(http, n, f"/v1/blobs/sha256/{SHA}", {**AUTH, "Range": "bytes=100000-100010"})
        assert lack.status == 404 and lack.headers["X-Weightcache-Partial"] == "1"
        assert BODY[100_000:100_010] not in lack.data
        # journalled bytes this node got from a peer are not relayed before the blob is verified: a hostile
        # peer's piece would reach the asker from this node, and the asker would ban this node for it
        relayed = get(http, n, f"/v1/blobs/sha256/{SHA}", {**AUTH, "Range": "bytes=150000-199999"})
        assert relayed.status == 404 and relayed.headers["X-Weightcache-Partial"] == "1"
        assert BODY[150_000:150_100] not in relayed.data
        whole = get(http, n, f"/v1/blobs/sha256/{SHA}")  # the whole blob is not there yet: what is, as a range
        assert whole.status == 206 and whole.data == BODY[:100_000]
        # digests likewise: of origin bytes journalled here, never of bytes a peer sent (null: not vouched for)
        sums = get(http, n, f"/v1/blobs/sha256/{SHA}?digests=0-99999,0-100000,150000-199999").json()["sha256"]
        assert sums == [hashlib.sha256(BODY[:100_000]).hexdigest(), None, None]
    finally:
        n.server.inflight.remove(SHA, part)  # type: ignore[union-attr]
        part.close()
    assert get(http, n, f"/v1/blobs/sha256/{SHA}", method="HEAD").status == 404


def test_a_whole_small_file_in_its_blob_is_served_while_its_download_is_still_registered(
        http: urllib3.PoolManager, fleet: Fleet, tmp_path: Path) -> None:
    """A file read in one request goes straight to its blob (store/blobwrite.py); its download stays registered
    in flight, with nothing journalled in its part, until the fetch hands it over or ends. A GET meanwhile is
    served the blob, as a HEAD already was, not answered "missing" (the asker read it from the origin again: seen
    in test_rollout's logs)."""
    n = fleet.node("small")
    obj = ObjectInfo("k", "config.json", len(BODY), "e", None, None)
    part = PartialFile(tmp_path / "c.part", obj, range_size=1 << 20, journalled=False)
    part.hash_whole(memoryview(BODY))  # hashed from the worker's buffer, then written to its blob, not the part
    blob = n.store.layout.blob(SHA)
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(BODY)
    inflight = n.server.inflight
    assert inflight is not None
    inflight.add(SHA, part)
    inflight.from_origin(SHA, 0, len(BODY))
    try:
        head = get(http, n, f"/v1/blobs/sha256/{SHA}", method="HEAD")
        assert head.status == 200 and "X-Weightcache-Partial" not in head.headers
        whole = get(http, n, f"/v1/blobs/sha256/{SHA}")
        assert whole.status == 200 and whole.data == BODY
        ranged = get(http, n, f"/v1/blobs/sha256/{SHA}", {**AUTH, "Range": "bytes=10-99"})
        assert ranged.status == 206 and ranged.data == BODY[10:100]
    finally:
        inflight.remove(SHA, part)


def claimed(fleet: Fleet, tmp_path: Path) -> tuple[FleetNode, PartialFile, InFlight, Claim]:
    """A node downloading BODY (a partial file registered in flight) that claims its first 128 KiB."""
    n = fleet.node("fetching")
    part = PartialFile(tmp_path / "y.part", ObjectInfo("k", "k", len(BODY), "e", None, None), range_size=1 << 16)
    part.open()
    inflight = n.server.inflight
    assert inflight is not None
    inflight.add(SHA, part)
    return n, part, inflight, inflight.claim(SHA, 0, 1 << 17)


def test_a_range_the_node_is_fetching_now_is_answered_not_yet_then_with_what_is_journalled(
        http: urllib3.PoolManager, fleet: Fleet, tmp_path: Path) -> None:
    """A claimed range (this node reads it from the origin now) with nothing journalled yet waits up to
    NOT_YET_WAIT_S for its first bytes, then answers 404 "not yet" (X-Weightcache-Not-Yet): the asker comes back
    rather than read it from the origin too, and no silent body makes it look like a trickler. Bytes journalled
    meanwhile are answered at once, as a shorter range. A claim that gained no byte for STALL_S is no longer
    "not yet": the asker goes elsewhere."""
    n, part, inflight, claim = claimed(fleet, tmp_path)
    inflight.from_origin(SHA, 0, 1 << 17)  # as PeerSource records each origin piece before it is written
    scratch = memoryview(bytearray(1 << 16))
    try:
        started = time.monotonic()
        nothing = get(http, n, f"/v1/blobs/sha256/{SHA}", {**AUTH, "Range": "bytes=0-131071"})
        assert nothing.status == 404 and nothing.headers["X-Weightcache-Not-Yet"] == "1"
        # waited for the first journalled bytes, then answered: not held until the claim stalls (STALL_S), the only
        # other end of that wait (a bound between two behaviours, 0.3 s and 10 s apart; not a speed bound)
        assert NOT_YET_WAIT_S <= time.monotonic() - started < STALL_S
        lands = threading.Timer(0.1, part.write, (0, memoryview(BODY)[:1 << 15], scratch))
        lands.start()  # the request waits for a first piece: it lands meanwhile
        resp = http.request("GET", f"{n.url}/v1/blobs/sha256/{SHA}", headers={**AUTH, "Range": "bytes=0-131071"},
                            preload_content=False)
        lands.join()
        assert resp.status == 206 and resp.headers["Content-Range"] == f"bytes 0-32767/{len(BODY)}"
        assert resp.read() == BODY[:1 << 15]
        claim.touched = time.monotonic() - STALL_S - 1  # the origin stopped sending it
        stalled = get(http, n, f"/v1/blobs/sha256/{SHA}", {**AUTH, "Range": "bytes=32768-131071"})
        assert stalled.status == 404 and "X-Weightcache-Not-Yet" not in stalled.headers
        assert stalled.headers["X-Weightcache-Partial"] == "1"
    finally:
        inflight.release(claim)
        inflight.remove(SHA, part)
        part.close()


def test_a_download_that_finishes_while_an_ask_waits_on_its_claim_is_served_from_its_blob(
        http: urllib3.PoolManager, fleet: Fleet, tmp_path: Path) -> None:
    """An ask for a claimed range with nothing journalled waits (NOT_YET_WAIT_S) for its first piece; the download
    lands its last bytes, is verified, published and leaves InFlight meanwhile (its origin read was retried: the
    claim stood without a byte, then the whole range came at once). The ask is answered from the blob, as the next
    one would be. Before, it was answered from the download it had looked up, no longer registered: 404 "not
    downloaded yet" without Not-Yet, and the asker read the range from the origin a second time
    (tests/test_peers.py::test_a_node_still_downloading_serves_the_pieces_it_has with a 2 s read timeout: 1 MiB
    more from the origin in 3 runs of 8)."""
    n, part, inflight, claim = claimed(fleet, tmp_path)
    scratch = memoryview(bytearray(1 << 16))

    def finish() -> None:  # as the fetch does: every piece journalled, the claim released, the blob published
        inflight.from_origin(SHA, 0, len(BODY))
        part.write(0, memoryview(BODY), scratch)
        inflight.release(claim)
        blob = n.store.layout.blob(SHA)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(BODY)
        inflight.remove(SHA, part)

    finishing = threading.Timer(NOT_YET_WAIT_S / 3, finish)  # while the ask waits for the claim's first piece
    try:
        finishing.start()
        resp = get(http, n, f"/v1/blobs/sha256/{SHA}", {**AUTH, "Range": "bytes=0-131071"})
        finishing.join()
        assert resp.status == 206 and resp.data == BODY[:1 << 17], (resp.status, resp.data[:100])
        assert "X-Weightcache-Partial" not in resp.headers  # the published blob's answer
    finally:
        finishing.cancel()
        inflight.remove(SHA, part)
        part.close()


def test_a_download_that_ends_between_the_looks_for_its_blob_and_for_it_in_flight_is_served_from_its_blob(
        http: urllib3.PoolManager, fleet: Fleet, tmp_path: Path) -> None:
    """`_open_held` looks for the published blob, then for its download in flight. A download that publishes its
    blob and leaves InFlight between the two (it leaves only after its blob is published) was in neither, and the
    ask was answered 404 "blob not held": the asker took this node for idle and read its share elsewhere. The
    server's `blob_missed` holds that window, and the download ends in it."""
    store = Store(tmp_path / "racing")
    inflight = InFlight()
    part = PartialFile(tmp_path / "z.part", ObjectInfo("k", "k", len(BODY), "e", None, None), range_size=1 << 16)
    part.open()
    part.write(0, memoryview(BODY), memoryview(bytearray(1 << 16)))  # every byte written: its blob comes next
    inflight.add(SHA, part)
    ended: list[str] = []

    def end_the_download(digest: str) -> None:  # once, as the fetch does: its blob published, then out of InFlight
        if not ended:
            blob = store.layout.blob(digest)
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(BODY)
            inflight.remove(digest, part)
            ended.append(digest)

    server = PeerServer(store.layout.blobs, TOKEN, fleet.limits, inflight, blob_missed=end_the_download)
    port = fleet.run(server.start("127.0.0.1", 0))
    try:
        resp = http.request("GET", f"http://127.0.0.1:{port}/v1/blobs/sha256/{SHA}", headers=AUTH)
        assert ended == [SHA], "the ask found the blob or never looked for it: the window was not crossed"
        assert resp.status == 200 and resp.data == BODY, (resp.status, resp.data[:100])
        assert "X-Weightcache-Partial" not in resp.headers  # the published blob's answer
    finally:
        fleet.run(server.stop())
        inflight.remove(SHA, part)
        part.close()


def test_not_yet_says_when_the_claim_lands_its_next_piece(
        http: urllib3.PoolManager, fleet: Fleet, tmp_path: Path) -> None:
    """A claim that has a rate tells the asker when its next piece should be journalled (X-Weightcache-Retry-Ms),
    and the asking node waits about that long instead of asking again every fraction of a second: a fleet of N
    nodes following each other's ranges asked each owner N^2 times per piece (issue 38: 16 daemons on 1 MB/s
    links spent 4 CPU s each on 32 MB, the machine's 2 cores were the bottleneck, not the links). The estimate
    is the peer's word: the asker bounds it (NOT_YET_MAX_S)."""
    n, part, inflight, claim = claimed(fleet, tmp_path)
    claim.began = time.monotonic() - 10.0
    claim.touch(1 << 14)  # 16 KiB in 10 s; pieces of 64 KiB: the first lands in about 30 s
    claim.piece = 1 << 16
    try:
        first = get(http, n, f"/v1/blobs/sha256/{SHA}", {**AUTH, "Range": "bytes=0-131071"})
        assert first.status == 404 and first.headers["X-Weightcache-Not-Yet"] == "1"
        assert 29_000 <= int(first.headers["X-Weightcache-Retry-Ms"]) <= 34_000
        asker = PeerClient(n.url, TOKEN, connect_timeout=2, read_timeout=5)
        with pytest.raises(PeerRangePending) as pending:
            asker.open_span(SHA, 0, 1 << 17)
        assert pending.value.retry_s is not None and 29 <= pending.value.retry_s <= 34
        claim.touch(1 << 16)  # the first piece came (80 KiB in all): the second is due in about 6 s
        later = get(http, n, f"/v1/blobs/sha256/{SHA}", {**AUTH, "Range": "bytes=65536-131071"})
        assert 5_000 <= int(later.headers["X-Weightcache-Retry-Ms"]) <= 8_000
        fresh = inflight.claim(SHA, 1 << 17, len(BODY))  # no byte yet: no rate, no estimate
        unknown = get(http, n, f"/v1/blobs/sha256/{SHA}", {**AUTH, "Range": "bytes=131072-140000"})
        assert unknown.headers["X-Weightcache-Not-Yet"] == "1" and "X-Weightcache-Retry-Ms" not in unknown.headers
        inflight.release(fresh)
    finally:
        inflight.release(claim)
        inflight.remove(SHA, part)
        part.close()


def test_a_claim_landing_pieces_often_is_streamed_to_one_ask_as_they_land_and_ends_short_if_it_stops(
        http: urllib3.PoolManager, fleet: Fleet, tmp_path: Path) -> None:
    """A claimed range whose pieces land at least every FOLLOW_S is answered with the whole claim in one body, each
    piece sent as it is journalled: one ask per range, and the owner's uplink busy as soon as there is a byte to
    send. Before, an ask got what was journalled as a shorter range, then "not yet" until the next piece, and at
    N = 16 on 1 MB/s links the last pieces of every range were relayed after the origin's last byte. A claim that
    stops (its origin read failed) ends the body short and closes the connection: the asker takes the rest
    elsewhere, never a byte that is not the origin's. A download published meanwhile (the owner finished before
    its askers, whose streams lag behind its journal) is sent on from its blob."""
    n, part, inflight, claim = claimed(fleet, tmp_path)
    scratch = memoryview(bytearray(1 << 16))
    piece = 1 << 14

    def land(claim: Claim, at: int) -> None:  # as PeerSource._from_origin does with each origin piece
        inflight.from_origin(SHA, at, at + piece)
        part.write(at, memoryview(BODY)[at:at + piece], scratch)
        claim.touch(piece)
        claim.piece = piece
        inflight.landed(SHA)

    def ask(at: int) -> urllib3.BaseHTTPResponse:
        return http.request("GET", f"{n.url}/v1/blobs/sha256/{SHA}", headers={**AUTH, "Range": f"bytes={at}-299999"},
                            preload_content=False)

    claim.began = time.monotonic() - 0.5
    land(claim, 0)  # 16 KiB in 0.5 s: a piece every 0.5 s
    landing = threading.Thread(target=lambda: [time.sleep(0.05) or land(claim, at) for at in range(piece, 4 * piece,
                                                                                                    piece)])
    try:
        landing.start()
        resp = ask(0)
        assert resp.status == 206 and resp.headers["Content-Range"] == f"bytes 0-131071/{len(BODY)}"  # the claim
        first = resp.read(4 * piece)
        landing.join()
        assert first == BODY[:4 * piece]
        inflight.release(claim)  # the rest never comes: the body ends short
        with pytest.raises(urllib3.exceptions.ProtocolError):
            resp.read()
        again = inflight.claim(SHA, 4 * piece, 1 << 17)  # read again from where it stopped
        again.began = time.monotonic() - 0.5
        land(again, 4 * piece)
        resp = ask(4 * piece)
        assert resp.headers["Content-Range"] == f"bytes {4 * piece}-131071/{len(BODY)}"
        assert resp.read(piece) == BODY[4 * piece:5 * piece]
        blob = n.store.layout.blob(SHA)  # the download is verified and published: the rest from the blob
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(BODY)
        inflight.release(again)
        inflight.remove(SHA, part)
        assert resp.read() == BODY[5 * piece:1 << 17]
    finally:
        inflight.remove(SHA, part)
        part.close()


def test_many_askers_at_once_get_fewer_streams_each(tmp_path: Path) -> None:
    """A node asked by many peers at once gives each its share of `stream_budget` (at least `min_streams`): 15
    askers with 8 streams each got 1/120 of its link per stream, and every stream looked like a trickler."""
    limits = PeerLimits(rate_bytes_s=8 << 10, max_streams=8, stream_budget=4, min_streams=2)
    with Fleet(tmp_path, TOKEN, limits) as fleet:
        node = holding_node(fleet)
        a = urllib3.PoolManager(retries=False, timeout=10)  # from 127.0.0.1
        b = urllib3.PoolManager(retries=False, timeout=10, source_address=("127.0.0.2", 0))  # another peer
        url = f"{node.url}/v1/blobs/sha256/{SHA}"
        held = []
        try:
            for _ in range(3):  # alone, a peer may have the whole budget (at most max_streams)
                held.append(a.request("GET", url, headers=AUTH, preload_content=False))
                assert held[-1].status == 200
            held.append(b.request("GET", url, headers=AUTH, preload_content=False))
            assert held[-1].status == 200  # a second asker gets its share: 2 of 4
            fourth = a.request("GET", url, headers=AUTH)
            assert fourth.status == 429 and fourth.headers["Retry-After"] == "1"  # a holds more than 2 now
        finally:
            for resp in held:
                resp.close()  # the connection with it: the node stops serving that stream
            a.clear()
            b.clear()
