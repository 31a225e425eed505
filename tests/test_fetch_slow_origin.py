"""Slow origins are not failures: a range's first byte may take longer than the per-read timeout (the deadline
grows with the range's size: retry.first_byte_timeout), while every read once the body flows keeps the per-read
timeout."""

from __future__ import annotations

import hashlib
import http.server
import random
import threading
from collections.abc import Iterator
from contextlib import closing, suppress
from pathlib import Path

import pytest

from tests.faultproxy import FaultProxy, QuietHTTPServer
from tests.fixtures_daemon import wait_until
from tests.fixtures_s3 import S3
from tests.grants import granted
from weightcache import retry
from weightcache.download import PIECE
from weightcache.errors import RetriesExceededError
from weightcache.fetch import Fetcher
from weightcache.sources import ObjectInfo, SourceOptions
from weightcache.sources.http import HttpSource
from weightcache.store import Store
from weightcache.uri import parse_ref

DATA = random.Random(26).randbytes(3 * PIECE + 777)
READ_TIMEOUT = 0.4
SLOW_START = 2 * READ_TIMEOUT  # the origin's wait before its first byte


@pytest.fixture(autouse=True)
def _allowance(monkeypatch: pytest.MonkeyPatch) -> None:
    """1 MB/s of first-byte allowance: a 1 MiB range may wait 1.05 s beyond the read timeout, twice the delay
    the tests' origin takes, so a loaded machine does not decide them."""
    monkeypatch.setattr(retry, "FIRST_BYTE_RATE", 1_000_000)


class _Ranges(http.server.BaseHTTPRequestHandler):
    """Ranges of DATA; under /stall/ the body stops halfway until `resume` is set (a held gate: the test sets it
    once the client has given up)."""

    protocol_version = "HTTP/1.1"
    resume = threading.Event()

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        first, last = (int(x) for x in self.headers["Range"].removeprefix("bytes=").split("-"))
        data = DATA[first:last + 1]
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {first}-{last}/{len(DATA)}")
        self.send_header("ETag", '"v1"')
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.path.startswith("/stall/"):
            self.wfile.write(data[:len(data) // 2])
            self.wfile.flush()
            self.resume.wait(60)
            data = data[len(data) // 2:]
        with suppress(OSError):
            self.wfile.write(data)


@pytest.fixture
def origin() -> Iterator[str]:
    httpd = QuietHTTPServer(("127.0.0.1", 0), _Ranges)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _read(url: str, path: str, attempts: int = 1) -> bytes:
    source = HttpSource(parse_ref(f"{url}/{path.split('/')[1]}/"),
                        SourceOptions(read_timeout=READ_TIMEOUT, max_attempts=attempts, backoff=0.01))
    obj = ObjectInfo(f"{url}{path}", path.rsplit("/", 1)[1], len(DATA), "v1", None, None)
    out = bytearray()
    with closing(source.read_pieces(obj, 0, len(DATA), memoryview(bytearray(PIECE)))) as pieces:
        for _, view in pieces:
            out += view
    return bytes(out)


def test_a_first_byte_later_than_the_read_timeout_is_no_failure(origin: str) -> None:
    with FaultProxy(origin) as proxy:
        proxy.add("delay", method="GET", seconds=SLOW_START, count=-1)
        assert _read(proxy.endpoint_url, "/m/w.bin") == DATA
        assert len(proxy.requests_for("GET")) == 1, "one request: no attempt timed out"


def test_without_the_allowance_the_same_slow_start_times_out(origin: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: with a first-byte deadline of the bare read timeout, the proxy's delay does trip it."""
    monkeypatch.setattr(retry, "FIRST_BYTE_RATE", 10**18)
    with FaultProxy(origin) as proxy:
        proxy.add("delay", method="GET", seconds=SLOW_START, count=-1)
        with pytest.raises(RetriesExceededError, match=r"Timeout"):
            _read(proxy.endpoint_url, "/m/w.bin")


def test_a_body_that_stalls_after_its_first_byte_still_times_out_per_read(origin: str) -> None:
    """The first-byte allowance is not a longer per-read timeout: a body that stops after its first bytes is a
    failed attempt (and the next attempt resumes it; here the single attempt fails). The body is held stopped
    until the client has given up: a client without a per-read timeout would wait for it (60 s), then succeed."""
    _Ranges.resume.clear()
    try:
        with pytest.raises(RetriesExceededError):
            _read(origin, "/stall/w.bin")
    finally:
        _Ranges.resume.set()


def test_first_byte_deadline_grows_with_the_range_and_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()
    assert retry.first_byte_timeout(10, 0) == 10
    assert retry.first_byte_timeout(10, 128 << 20) > 10 + 30  # the moto case: 128 MiB took over 10 s
    assert retry.first_byte_timeout(10, 1 << 40) == retry.FIRST_BYTE_MAX


def test_an_s3_range_whose_first_byte_is_slow_is_fetched_without_a_retry(
        tmp_path: Path, s3: S3, fault_proxy: FaultProxy) -> None:
    s3.put("models", "slow/w.bin", DATA)
    fault_proxy.add("delay", method="GET", ranged_only=True, seconds=SLOW_START, count=-1)
    f = Fetcher(Store(tmp_path / "root"), endpoint_url=fault_proxy.endpoint_url, chunk_size=2 * PIECE,
                concurrency=2, read_timeout=READ_TIMEOUT)
    snap = f.ensure(granted("s3://models/slow/"))
    assert (snap.path / "w.bin").read_bytes() == DATA
    assert snap.files[0].sha256 == hashlib.sha256(DATA).hexdigest()
    gets = [r for r in fault_proxy.requests_for("GET", "/models/slow/w.bin") if r.range]
    assert len(gets) == 2, [r.range for r in gets]  # two ranges, each asked for once


def test_a_stalled_range_is_halved_and_its_back_half_read_by_an_idle_worker(
        tmp_path: Path, s3: S3, fault_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranges of 8 MiB; the first request is held (an origin that does not answer). The worker whose range
    is done takes the back of the held one, aligned to pieces; released, the first stops where that half begins.
    Every byte arrives once in the blob and the sha256 is of the whole file, in order."""
    from weightcache.fetch import transfer

    monkeypatch.setattr(transfer, "SPLIT_STALL", 0.1)
    body = random.Random(7).randbytes(16 * PIECE)
    s3.put("models", "stall/w.bin", body)
    hold = fault_proxy.add("hold", method="GET", path="/models/stall/w.bin", ranged_only=True, count=1)

    def release_once_split() -> None:
        hold.arrived.wait(30)
        try:
            wait_until(lambda: any(r.range and not r.range.startswith(("bytes=0-", f"bytes={8 * PIECE}-"))
                                   for r in fault_proxy.requests_for("GET", "/models/stall/w.bin")),
                       timeout=30, what="a split range", every=0.02)
        finally:
            hold.release.set()

    releaser = threading.Thread(target=release_once_split, daemon=True)
    releaser.start()
    f = Fetcher(Store(tmp_path / "root"), endpoint_url=fault_proxy.endpoint_url, chunk_size=4 * PIECE,
                concurrency=2)
    snap = f.ensure(granted("s3://models/stall/"))
    releaser.join(5)
    assert (snap.path / "w.bin").read_bytes() == body
    assert snap.files[0].sha256 == hashlib.sha256(body).hexdigest()
    asked = sorted(fault_proxy.ranges_for("/models/stall/w.bin"))
    starts = [a for a, _ in asked]
    assert 0 in starts and 8 * PIECE in starts and len(asked) >= 3, asked
    split = [a for a in starts if a not in (0, 8 * PIECE)]
    assert all(a % PIECE == 0 for a in split), asked
