"""weightcache/ratelimit.py: one token bucket shared by threads holds its rate, waits end at a cancel, rates change
live, and the daemon's bytesPerSecond reaches the limits it hands its fetches (no process-wide state)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest

from tests.fixtures_daemon import start_daemon
from tests.fixtures_s3 import S3
from tests.grants import granted
from weightcache import cli
from weightcache.daemon.config import load_settings
from weightcache.errors import ConfigError, FetchCancelledError
from weightcache.fetch import Fetcher
from weightcache.peers.client import Pace
from weightcache.ratelimit import BURST_S, BandwidthLimits, Limiter
from weightcache.store import Store


class PolledClock:
    """A limiter's clock that counts its reads: `polled()` returns once a waiter has looked at the bucket again
    (a held gate, not a sleep that hopes the waiter got there). `now` is None: the real clock."""

    def __init__(self, now: float | None = None) -> None:
        self.now = now
        self._reads = 0
        self._read = threading.Condition()

    def __call__(self) -> float:
        with self._read:
            self._reads += 1
            self._read.notify_all()
        return time.monotonic() if self.now is None else self.now

    def polled(self) -> None:
        """Return once the clock has been read twice since this call: a waiter's whole turn in the bucket."""
        with self._read:
            mark = self._reads
            assert self._read.wait_for(lambda: self._reads >= mark + 2, timeout=10), "nobody waits in the bucket"


def _drain(limiter: Limiter, threads: int, seconds: float, piece: int) -> int:
    got = [0] * threads
    stop = time.monotonic() + seconds

    def work(i: int) -> None:
        while time.monotonic() < stop:
            limiter.acquire(piece)
            got[i] += piece

    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(got)


def test_eight_threads_sharing_a_limiter_hold_its_rate_within_ten_percent() -> None:
    rate = 20 << 20
    limiter = Limiter(rate)
    took = time.monotonic()
    total = _drain(limiter, 8, 1.5, 256 << 10)
    took = time.monotonic() - took
    assert abs(total / took - rate) / rate < 0.10, total / took


def test_a_piece_larger_than_the_burst_passes_and_the_average_holds() -> None:
    limiter = Limiter(4 << 20, burst_s=0.1)
    start = time.monotonic()
    for _ in range(4):
        limiter.acquire(1 << 20)  # 0.25 s of the rate each, more than the 0.1 s burst
    took = time.monotonic() - start
    assert 0.6 <= took <= 1.2, took


def test_a_wait_ends_at_once_when_the_fetch_is_cancelled() -> None:
    clock = PolledClock(0.0)  # stopped: the bucket never refills, so only the cancel can end the wait
    limiter = Limiter(1000, clock=clock)
    limiter.acquire(1000)
    cancel = threading.Event()
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            limiter.acquire(1000, cancel)
        except FetchCancelledError as exc:
            raised.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    clock.polled()  # it waits in the bucket
    cancel.set()
    waiter.join(10)
    assert not waiter.is_alive() and len(raised) == 1


def test_a_coroutine_cancelled_in_the_bucket_stops_counting_as_a_waiter() -> None:
    """The peer server's `take`: a stream cancelled while it waits (its asker gone) no longer counts as demand, so
    the bucket's idle time is not banked up to CATCH_UP_S for it (a waiter counted for ever would let every later
    burst pass at ten times the burst)."""
    clock = PolledClock(0.0)  # stopped: only the test moves it
    limiter = Limiter(1000, clock=clock)  # a burst of 100 bytes

    async def main() -> None:
        await limiter.take(1000)  # granted from a full bucket: now 900 bytes in debt
        waiting = asyncio.create_task(limiter.take(1))
        await asyncio.sleep(0.2)  # it waits in the bucket (the clock never refills it)
        assert not waiting.done()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        clock.now = 10.0  # ten idle seconds: the bucket refills to its burst only, nobody waiting
        await limiter.take(100)
        await limiter.take(1)  # the bucket at 0 grants once more, then is in debt
        with pytest.raises(TimeoutError):  # in debt: this one waits (had 10 s been banked, it would pass)
            await asyncio.wait_for(limiter.take(1), 0.3)

    asyncio.run(main())


def test_a_rate_changed_live_reaches_a_waiting_worker() -> None:
    clock = PolledClock(0.0)  # stopped: at the old rate the worker would wait for ever
    limiter = Limiter(100, clock=clock)
    limiter.acquire(100)
    done = threading.Event()
    def wait() -> None:
        limiter.acquire(1000)
        done.set()

    threading.Thread(target=wait, daemon=True).start()
    clock.polled()
    assert not done.is_set()
    limiter.set_rate(0)
    assert done.wait(10)


def test_unlimited_costs_nothing() -> None:
    limiter = Limiter(0)
    start = time.thread_time()  # CPU time: a loaded machine stretches wall time, not this (0.07 s; 0.9 s when each
    for _ in range(100_000):    # unlimited acquire built a generator)
        limiter.acquire(1 << 20)
    assert time.thread_time() - start < 0.5


def test_a_source_limit_applies_on_top_of_the_nodes_and_the_most_specific_wins() -> None:
    limits = BandwidthLimits()
    limits.configure(origin=0, peers=0, sources={"s3": 1 << 30, "s3://slow": 1000})
    assert limits.for_source("s3://slow/a/b.bin") is not None
    assert limits.for_source("s3://slow/a/b.bin").rate == 1000  # type: ignore[union-attr]
    assert limits.for_source("s3://fast/a").rate == 1 << 30  # type: ignore[union-attr]
    assert limits.for_source("gs://x/a") is None
    limits.acquire_origin("s3://slow/k", 1000)
    start = time.monotonic()
    limits.acquire_origin("s3://slow/k", 500)
    assert time.monotonic() - start >= 0.4


def test_bytes_per_second_in_the_daemon_config_is_parsed_and_applied_live() -> None:
    from weightcache.daemon.config import Settings, apply_bandwidth, apply_live, parse_settings

    s = parse_settings({"bytesPerSecond": {"origin": "200Mi", "peers": "1Gi", "serve": "100Mi", "s3://models": "50Mi"}})
    assert dict(s.limits.bytes_per_second) == {"origin": 200 << 20, "peers": 1 << 30, "serve": 100 << 20,
                                               "s3://models": 50 << 20}
    merged, pending = apply_live(Settings(), s)
    assert "bytesPerSecond" not in pending
    limits = BandwidthLimits()
    apply_bandwidth(limits, merged)
    rates = {k: v for k, v in limits.status().items() if k != "waited_seconds"}
    assert rates == {"origin": 200 << 20, "peers": 1 << 30, "serve": 100 << 20, "sources": {"s3://models": 50 << 20}}
    apply_bandwidth(limits, apply_live(merged, Settings())[0])
    assert {k: v for k, v in limits.status().items() if k != "waited_seconds"} == \
        {"origin": 0, "peers": 0, "serve": 0, "sources": {}}
    with pytest.raises(ConfigError, match="bytesPerSecond"):
        parse_settings({"bytesPerSecond": {"s3://a/b c": 1}})
    with pytest.raises(ConfigError, match="bytesPerSecond"):
        parse_settings({"bytesPerSecond": 5})


def test_a_big_file_from_s3_holds_the_nodes_origin_limit(tmp_path: Path, s3: S3) -> None:
    """Big files stream through read_pieces (origin_pieces): each piece waits on the same buckets as small ones, so
    an 8 MiB object at 8 MiB/s takes about a second, not what moto can serve."""
    size, rate = 8 << 20, 8 << 20
    s3.put("models", "big/w.bin", bytes(range(256)) * (size // 256))
    limits = BandwidthLimits()
    limits.configure(origin=rate)
    started = time.monotonic()
    snap = Fetcher(Store(tmp_path / "root"), endpoint_url=s3.endpoint_url, chunk_size=1 << 20,
                   concurrency=4, limits=limits).ensure(granted("s3://models/big/"))
    took = time.monotonic() - started
    assert snap.size == size
    assert took >= 0.9 * (size / rate - BURST_S), f"{size} bytes in {took:.2f}s: the limit was not held"


def test_a_waiter_without_cpu_is_owed_its_bytes_but_idle_time_is_never_banked() -> None:
    """A fake clock jumps 2 s while a worker waits in the bucket (descheduled on a busy CPU): it and the next
    request get the bytes of those 2 s, so the average holds. Two idle seconds give only the 0.1 s burst."""
    clock = PolledClock(0.0)
    limiter = Limiter(1000, burst_s=0.1, clock=clock)
    limiter.acquire(1000)  # the 100-byte burst, then 900 in debt
    granted_at: list[float | None] = []

    def take(n: int) -> None:
        limiter.acquire(n)
        granted_at.append(clock.now)

    waiter = threading.Thread(target=take, args=(1000,), daemon=True)
    waiter.start()
    clock.polled()  # it polls the bucket, in debt
    assert not granted_at
    clock.now = 2.0  # 2,000 bytes accrued while it waited: 1,100 more than its debt and request
    waiter.join(10)
    assert granted_at == [2.0]
    second = threading.Thread(target=take, args=(1000,), daemon=True)
    second.start()
    second.join(10)
    assert granted_at == [2.0, 2.0]  # 3,000 bytes granted by t=2: the rate and the burst, no more

    clock = PolledClock(2.0)
    idle = Limiter(1000, burst_s=0.1, clock=clock)
    idle.acquire(100)
    clock.now = 10.0  # nobody waits: the bucket fills to its 100-byte burst only
    idle.acquire(200)  # 100 in debt
    late = threading.Thread(target=idle.acquire, args=(100,), daemon=True)
    late.start()
    clock.polled()
    assert late.is_alive()  # in debt: waits for a clock that no longer moves
    clock.now = 10.2  # its debt paid
    late.join(10)
    assert not late.is_alive()


def test_a_peer_range_held_by_this_nodes_own_peer_limit_is_not_judged_slow() -> None:
    """The peers' rate floor (peers/client.py Pace) counts no time this node's bytesPerSecond.peers held the
    reader: 8 workers sharing 8 MiB/s get 1 MiB/s each, the floor's rate, and every peer was cut as a trickler."""
    pace = Pace(10 << 20, min_rate=1 << 20, grace_s=0.5)
    before = pace.started
    with pace.held():
        time.sleep(0.05)
        assert not pace.due(before + 100)  # held by us: never cut meanwhile
    assert pace.started - before >= 0.05  # its clock starts again later by the time held
    assert not pace.due(pace.started + 0.4) and pace.due(pace.started + 0.6)  # the peer's own pace still counts


async def test_status_shows_the_daemons_limits_and_a_reload_changes_them(
        short_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`weightcache status` (and -o json) of a running daemon: its bytesPerSecond as the buckets hold them now,
    the seconds waited on each and that they are live; after a config reload, the new ones."""
    limits = {"origin": "200Mi", "peers": "1Gi", "serve": "8Mi", "s3://models": "50Mi"}
    running = await start_daemon(short_dir, short_dir / "no-model", config={"bytesPerSecond": limits})
    monkeypatch.setenv("WEIGHTCACHE_SOCKET", str(running.socket))
    try:
        assert await asyncio.to_thread(cli.main, ["status", "-o", "json"]) == 0
        bandwidth = json.loads(capsys.readouterr().out)["bandwidth"]
        waited = bandwidth.pop("waited_seconds")  # this daemon's buckets: no other test's waits
        assert bandwidth == {"origin": 200 << 20, "peers": 1 << 30, "serve": 8 << 20,
                             "sources": {"s3://models": 50 << 20}, "live": True}
        assert waited["sources"] == {"s3://models": 0.0} and waited["origin"] >= 0 and waited["peers"] >= 0
        assert await asyncio.to_thread(cli.main, ["status"]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("bandwidth"))
        assert line.split(None, 1)[1] == "origin 200 MiB/s, peers 1 GiB/s, serve 8 MiB/s, s3://models 50 MiB/s; " \
                                         "live (a config reload applies it)"
        await running.daemon.apply(load_settings(flags={"root": str(running.root), "socket": str(running.socket)}))
        assert await asyncio.to_thread(cli.main, ["status"]) == 0
        assert "bandwidth     no limit (bytesPerSecond unset); live" in capsys.readouterr().out
    finally:
        await running.daemon.stop()
