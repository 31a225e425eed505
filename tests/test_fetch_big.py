"""Big files: written, journalled and hashed a piece at a time; bodies read from the socket straight into the
worker's buffer, over connections the pool keeps."""

from __future__ import annotations

import contextlib
import ctypes
import gzip
import hashlib
import http.server
import json
import mmap
import os
import random
import re
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.faultproxy import FaultProxy, QuietHTTPServer
from tests.fixtures_s3 import S3
from tests.grants import admin, granted
from weightcache import download
from weightcache.download import PIECE, PartialFile
from weightcache.errors import FetchCancelledError
from weightcache.fetch import Fetcher
from weightcache.progress import Progress
from weightcache.sources import ObjectInfo, SourceOptions, base
from weightcache.sources.base import body_readinto
from weightcache.sources.http import HttpSource
from weightcache.store import Store
from weightcache.uri import parse_ref

CHUNK = 4 * PIECE  # a chunk (a request's unit) of several pieces: what the defaults have (16 MiB, 1 MiB)


def test_a_big_file_is_journalled_a_piece_at_a_time_and_resumes_from_the_last_piece(
        tmp_path: Path, s3: S3, fault_proxy: FaultProxy) -> None:
    size = 2 * CHUNK + 12_345
    body = random.Random(9).randbytes(size)
    s3.put("models", "big/w.bin", body)
    throttle = fault_proxy.add("throttle", method="GET", ranged_only=True, count=-1, rate=2 * PIECE)
    root = tmp_path / "root"
    f = Fetcher(Store(root), endpoint_url=fault_proxy.endpoint_url, chunk_size=CHUNK, concurrency=3)

    def stop_after_four_pieces(_: Progress) -> None:  # three requests: one of them has written two pieces
        if any(len(j.read_text().splitlines()) >= 5 for j in root.glob("partial/*.journal")):
            f.close()

    with pytest.raises(FetchCancelledError):
        f.ensure(granted("s3://models/big/"), progress=stop_after_four_pieces)
    (journal,) = root.glob("partial/*.journal")
    journalled = [tuple(map(int, line.split())) for line in journal.read_text().splitlines()[1:]]
    assert len(journalled) >= 4 and all(0 < n <= PIECE for _, n in journalled), journalled
    assert any(off % CHUNK for off, _ in journalled), "pieces inside a request are journalled as they are written"

    fault_proxy.faults.remove(throttle)
    fault_proxy.clear()
    snap = Fetcher(Store(root), endpoint_url=fault_proxy.endpoint_url, chunk_size=CHUNK).ensure(admin(
        parse_ref("s3://models/big/")))
    assert (snap.path / "w.bin").read_bytes() == body
    asked = fault_proxy.ranges_for("/models/big/w.bin")
    assert sum(b - a + 1 for a, b in asked) == size - sum(n for _, n in journalled), "journalled pieces refetched"


@pytest.mark.parametrize(("chunks", "concurrency", "ranges"), [
    (32, 8, 8),  # 4 chunks a request (one first-byte wait per 64 MiB by default), one for every worker
    (8, 8, 8),  # smaller requests rather than idle workers
    (64, 2, 4),  # a large model: two requests per worker
])
def test_requests_are_few_and_large(tmp_path: Path, s3: S3, fault_proxy: FaultProxy, chunks: float, concurrency: int,
                                    ranges: int) -> None:
    chunk = 64 << 10
    body = random.Random(ranges).randbytes(int(chunks * chunk))
    s3.put("models", "m/w.bin", body)
    snap = Fetcher(Store(tmp_path / "root"), endpoint_url=fault_proxy.endpoint_url, chunk_size=chunk,
                   concurrency=concurrency).ensure(granted("s3://models/m/"))
    assert (snap.path / "w.bin").read_bytes() == body
    asked = sorted(fault_proxy.ranges_for("/models/m/w.bin"))
    assert len(asked) == ranges, asked
    assert all((b + 1 - a) % chunk == 0 for a, b in asked[:-1]), "requests are whole chunks"


def test_workers_hold_a_piece_each_not_a_chunk(tmp_path: Path) -> None:
    """Memory per worker is a piece to read into and one to re-read for hashing, whatever the chunk size."""
    src = tmp_path / "src"
    src.mkdir()
    body = random.Random(3).randbytes(3 * CHUNK)
    (src / "w.bin").write_bytes(body)
    tracemalloc.start()
    try:
        snap = Fetcher(Store(tmp_path / "root"), chunk_size=CHUNK, concurrency=3).ensure(granted(f"file://{src}/"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert hashlib.sha256((snap.path / "w.bin").read_bytes()).digest() == hashlib.sha256(body).digest()
    assert peak < 3 * 2 * PIECE + 2 * PIECE, f"{peak / PIECE:.1f} pieces allocated for 3 workers"


# --- the body read ---------------------------------------------------------------------------------------------

DATA = random.Random(5).randbytes(300_001)


class _Handler(http.server.BaseHTTPRequestHandler):
    """Ranges of DATA; `?gzip` answers the whole body gzip-encoded. Counts the connections it serves."""

    protocol_version = "HTTP/1.1"
    connections: list[int]

    def setup(self) -> None:
        super().setup()
        self.connections.append(1)

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        if self.path.endswith("?gzip"):
            status, data, extra = 200, gzip.compress(DATA), {"Content-Encoding": "gzip"}
        else:
            first, last = (int(x) for x in self.headers["Range"].removeprefix("bytes=").split("-"))
            status, data = 206, DATA[first:last + 1]
            extra = {"Content-Range": f"bytes {first}-{last}/{len(DATA)}", "ETag": '"v1"'}
        self.send_response(status)
        for name, value in extra.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server() -> Iterator[tuple[str, list[int]]]:
    connections: list[int] = []
    httpd = QuietHTTPServer(("127.0.0.1", 0), type("H", (_Handler,), {"connections": connections}))
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", connections
    httpd.shutdown()
    httpd.server_close()


def test_range_bodies_are_exact_and_their_connection_is_reused(server: tuple[str, list[int]]) -> None:
    url, connections = server
    source = HttpSource(parse_ref(f"{url}/m/"), SourceOptions())
    obj = ObjectInfo(f"{url}/m/w.bin", "w.bin", len(DATA), "v1", None, None)
    buf = memoryview(bytearray(64 << 10))
    for offset, length in ((0, 100_000), (100_000, 200_001), (7, 3)):
        got = b"".join(bytes(view) for _, view in source.read_pieces(obj, offset, length, buf))
        assert got == DATA[offset:offset + length]
    assert len(connections) == 1, "a body read to its end must give its connection back to the pool"
    source.close()


def test_a_range_left_at_its_last_piece_gives_its_connection_back(server: tuple[str, list[int]]) -> None:
    """The fetch's workers stop taking a range's pieces at its last one (transfer.py: `_Reading.advanced` says the
    range is done and the loop breaks): its connection was closed as if bytes were left unread, and a daemon's
    fetch of an 88 MB shard in 6 ranges opened 6 new connections to radosgw each time. A range left before its
    end still closes its connection: its unread bytes must never reach the next request."""
    url, connections = server
    source = HttpSource(parse_ref(f"{url}/m/"), SourceOptions())
    obj = ObjectInfo(f"{url}/m/w.bin", "w.bin", len(DATA), "v1", None, None)
    buf = memoryview(bytearray(64 << 10))
    for offset, length in ((0, 100_000), (100_000, 200_001)):
        with contextlib.closing(source.read_pieces(obj, offset, length, buf)) as pieces:
            for pos, view in pieces:
                assert bytes(view) == DATA[pos:pos + len(view)]
                if pos + len(view) == offset + length:
                    break
    assert len(connections) == 1
    with contextlib.closing(source.read_pieces(obj, 0, 300_000, buf)) as pieces:
        next(pieces)  # left with bytes unread
    assert b"".join(bytes(view) for _, view in source.read_pieces(obj, 5, 10, buf)) == DATA[5:15]
    assert len(connections) == 2
    source.close()


def test_a_plain_body_is_read_by_http_client_and_an_encoded_one_decoded_by_urllib3(
        server: tuple[str, list[int]]) -> None:
    url, _ = server
    pool = urllib3.PoolManager(retries=False)
    plain = pool.request("GET", f"{url}/w.bin", headers={"Range": "bytes=0-99"}, preload_content=False)
    assert isinstance(plain, urllib3.HTTPResponse) and plain._fp is not None
    assert body_readinto(plain) == plain._fp.readinto, "no copy through urllib3's read for a plain body"
    plain.close()
    encoded = pool.request("GET", f"{url}/w.bin?gzip", preload_content=False)
    readinto = body_readinto(encoded)
    buf = memoryview(bytearray(len(DATA)))
    done = 0
    while n := readinto(buf[done:]):
        done += n
    assert bytes(buf[:done]) == DATA, "a gzip-encoded body is decoded as urllib3 always did"


class _BigHandler(http.server.BaseHTTPRequestHandler):
    """16 MiB of zeros as fast as loopback goes, (path /slow) 64 KiB every 0.1 s, or (path /steady) 600 KiB at
    300 kB/s, 15 KiB every 0.05 s (a slow origin's stream)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        slow, steady = self.path == "/slow", self.path == "/steady"
        step = (15 << 10) if steady else (64 << 10)
        size = (600 << 10) if steady else (1 << 20) if slow else (16 << 20)
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.end_headers()
        for _ in range(size // step):
            self.wfile.write(bytes(step))
            if slow or steady:
                time.sleep(0.05 if steady else 0.1)


@pytest.fixture
def big_body(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, list[int]]]:
    """A server of _BigHandler's bodies, and the size of every readinto asked of a body (recorded around
    body_readinto)."""
    httpd = QuietHTTPServer(("127.0.0.1", 0), _BigHandler)
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    asked: list[int] = []

    def recording(resp: object) -> object:
        readinto = body_readinto(resp)

        def record(view: memoryview) -> int:
            asked.append(len(view))
            n: int = readinto(view)
            return n
        return record

    monkeypatch.setattr(base, "body_readinto", recording)
    yield f"http://127.0.0.1:{httpd.server_address[1]}", asked
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("path", ["/fast", "/slow"])
def test_reads_grow_on_a_fast_body_and_stay_small_on_a_slow_one(big_body: tuple[str, list[int]], path: str) -> None:
    url, asked = big_body
    resp = urllib3.PoolManager(retries=False).request("GET", f"{url}{path}", preload_content=False)
    size = int(resp.headers["Content-Length"])
    buf = memoryview(bytearray(size))
    assert base.read_body_into(resp, buf) == size and not any(buf)
    assert asked[0] == base.READ_SLICE
    if path == "/fast":  # few Python calls per GB: the size doubles up to the cap
        assert base.READ_SLICE_MAX in asked and len(asked) < 16 * 2, asked
    else:  # 0.64 MB/s: each read waits for all it asked, so progress and a cancel must not wait long
        assert max(asked) == base.READ_SLICE, asked


def test_a_slow_bodys_reads_ask_for_a_tenth_of_a_second_of_it(big_body: tuple[str, list[int]]) -> None:
    """Each read blocks until it has all it asked for: at 128 KiB a 300 kB/s origin's bytes were seen (progress, a
    cancel, and the link a peer's silence probe asks about: a byte within SILENT_S / 2) in bursts 0.44 s apart, and
    the probe's verdicts on a peer cut off fell between them (tests/test_peers.py::test_a_silence_probe_waits_
    twice_what_answers_take_its_connects_going_out_all_through_it, 3-7 runs of 20 under load). After a slow read
    the next asks for what the body brought in SLICE_SLOW_S (about 30 KiB here), READ_SLICE_MIN at the least."""
    url, asked = big_body
    resp = urllib3.PoolManager(retries=False).request("GET", f"{url}/steady", preload_content=False)
    buf = memoryview(bytearray(600 << 10))
    assert base.read_body_into(resp, buf) == len(buf)
    assert asked[0] == base.READ_SLICE
    later = sorted(asked[1:])
    assert later[len(later) // 2] <= 64 << 10, asked  # before: 128 KiB each, five reads in all
    assert min(asked[1:-1]) >= base.READ_SLICE_MIN and len(asked) >= 10, asked  # the last: what the buffer had left


def test_a_fast_body_keeps_its_read_size_from_one_piece_to_the_next(big_body: tuple[str, list[int]]) -> None:
    """A range streamed a piece at a time: reads stay large once the body has shown it is fast. Each piece started
    over at READ_SLICE, so a 1 MiB piece took four reads (128, 256, 512, 128 KiB), 64 for these 16 MiB."""
    url, asked = big_body
    pool = urllib3.PoolManager(retries=False)
    got = sum(len(view) for _, view in base.stream_range(
        lambda pos, end: pool.request("GET", f"{url}/fast", preload_content=False), 0, 16 << 20,
        memoryview(bytearray(PIECE)), SourceOptions().retry("reading /fast")))
    assert got == 16 << 20
    assert len(asked) < 3 * 16, f"{len(asked)} reads for 16 pieces: {asked}"


def test_a_download_nobody_streams_leaves_its_hashed_bytes_out_of_the_page_cache(tmp_path: Path) -> None:
    """drop_behind: the hashed and written bytes leave the page cache as the download goes (a fetch no one
    streams), but for the last DROP_LAG; without it (a stream reads the files as they land) every page stays."""
    probe = tmp_path / "probe"
    probe.write_bytes(bytes(1 << 20))
    fd = os.open(probe, os.O_RDONLY)
    try:
        download.drop_cached(fd, 0, 0)
        if _resident(fd, 1 << 20):
            pytest.skip("this filesystem keeps pages DONTNEED asks to drop (tmpfs)")
    finally:
        os.close(fd)
    size = 4 * download.DROP_LAG + 3 * PIECE
    body = random.Random(4).randbytes(size)
    obj = ObjectInfo("k", "w.bin", size, "e", None, None)
    left = {}
    for drop in (True, False):
        part = PartialFile(tmp_path / f"{drop}.part", obj, range_size=size, drop_behind=drop)
        part.open()
        scratch = memoryview(bytearray(PIECE))
        for off in range(0, size, PIECE):  # in order, as one worker reads a range
            part.write(off, memoryview(body)[off:off + PIECE], scratch)
        assert part.complete and part.sha256.digest() == hashlib.sha256(body).digest()
        left[drop] = _resident(part._fd, size)
        part.close()
        assert (tmp_path / f"{drop}.part").read_bytes() == body
    assert left[False] >= size // download._PAGE - RECLAIMED_PAGES, left
    assert left[True] <= (download.DROP_LAG + download.WRITEBACK_STEP) // download._PAGE, left


def test_a_fetch_under_the_drop_behind_size_keeps_its_pages(tmp_path: Path, s3: S3) -> None:
    """A fetch nobody streams of fewer than DROP_BEHIND_MIN bytes leaves what it wrote in the page cache: its
    first load finds it there, and no drop waits on writeback while the hashing goes on. Before, every fetch
    nobody streamed dropped all but its last DROP_LAG bytes."""
    size = download.DROP_LAG + 2 * download.WRITEBACK_STEP + 12_345
    body = random.Random(5).randbytes(size)
    s3.put("models", "kept/w.bin", body)
    snap = Fetcher(Store(tmp_path / "root"), endpoint_url=s3.endpoint_url, concurrency=1).ensure(
        granted("s3://models/kept/"))
    fd = os.open(snap.path / "w.bin", os.O_RDONLY)
    try:
        assert _resident(fd, size) >= -(-size // download._PAGE) - RECLAIMED_PAGES
    finally:
        os.close(fd)


#: Pages of a kept file the kernel may have reclaimed by the time a test counts them: its bytes are clean once
#: written back (sync_file_range, every WRITEBACK_STEP), and clean page cache is the kernel's to take whatever
#: the code keeps (a cgroup's memory limit, kswapd on one zone; CI once counted 33,280 of 33,536 pages with 20 GiB
#: free: one 1 MiB folio gone). Half a WRITEBACK_STEP: the code drops whole steps (PartialFile._drop_to), so a
#: kept file that dropped anything still fails.
RECLAIMED_PAGES = download.WRITEBACK_STEP // 2 // download._PAGE


def _resident(fd: int, size: int) -> int:
    """Pages of the first `size` bytes of `fd` in the page cache: mincore over a mapping that populates nothing."""
    libc = download._libc
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    assert addr not in (None, download._MAP_FAILED)
    try:
        pages = -(-size // download._PAGE)
        vec = ctypes.create_string_buffer(pages)
        assert libc.mincore(addr, size, vec) == 0
        return sum(b & 1 for b in vec.raw[:pages])
    finally:
        libc.munmap(addr, size)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(st.tuples(st.integers(0, 63), st.integers(1, 5)), max_size=40),
       resumed=st.lists(st.tuples(st.integers(0, 63), st.integers(1, 8)), max_size=4),
       asks=st.lists(st.tuples(st.integers(0, 320), st.integers(0, 320)), min_size=1, max_size=20))
def test_holds_says_exactly_which_bytes_are_written(tmp_path: Path, pieces: list[tuple[int, int]],
                                                    resumed: list[tuple[int, int]],
                                                    asks: list[tuple[int, int]]) -> None:
    """What a peer may be served: every byte of [start, end) journalled (resumed or written), in any order."""
    size, unit = 320, 5
    obj = ObjectInfo("k", "w.bin", size, "e", None, None)
    part = tmp_path / "h.part"
    written = bytearray(size)
    part.write_bytes(bytes(size))
    header = json.dumps({"key": obj.key, "size": obj.size, "etag": obj.etag, "version_id": obj.version_id})
    lines = [f"{o * unit} {min(n * unit, size - o * unit)}" for o, n in resumed]
    part.with_suffix(".journal").write_text("\n".join([header, *lines]) + "\n")
    pf = PartialFile(part, obj, range_size=size)
    pf.open()
    for o, n in resumed:
        written[o * unit:o * unit + n * unit] = b"\1" * len(written[o * unit:o * unit + n * unit])
    scratch = memoryview(bytearray(64))
    try:
        for o, n in pieces:
            start, length = o * unit, min(n * unit, size - o * unit)
            pf.write(start, memoryview(bytes(length)), scratch)
            written[start:start + length] = b"\1" * length
            runs = [(m.start(), m.end()) for m in re.finditer(b"\1+", bytes(written))]  # each written run whole
            for a, b in [*asks, *runs, *((a, b + 1) for a, b in runs), *((a - 1, b) for a, b in runs if a)]:
                assert pf.holds(a, b) == (a >= b or (b <= size and all(written[a:b]))), (a, b)
    finally:
        pf.discard()
