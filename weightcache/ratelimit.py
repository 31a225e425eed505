"""Bandwidth limits: one token bucket per limit, shared by every fetch worker that is handed the same limits.

    limits = BandwidthLimits()                              # the daemon's one, passed down (Node.bandwidth)
    limits.configure(origin=100 << 20, peers=0, sources={"s3://models": 50 << 20})   # its bytesPerSecond
    limits.acquire_origin("s3://models/llama/a.bin", n, cancel)   # before reading n bytes from the origin
    limits.acquire_peers(n, cancel)                               # before / as reading n bytes from peers

Origin and peer traffic are limited separately (peers are usually on the free cluster network); a source's own
limit (`scheme` or `scheme://bucket`, the most specific wins) applies on top of the node's origin limit. A
limit of 0 is none. Rates change live (`configure` again): waiting workers pick the new rate up within POLL_S.
`acquire` blocks until the bytes are allowed and returns at once with FetchCancelledError when `cancel` is set.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Mapping
from contextlib import closing

from weightcache.errors import FetchCancelledError

BURST_S = 0.1  # a bucket holds this many seconds of its rate: short bursts, a limit held over ~1 s windows
POLL_S = 0.05  # a waiting worker looks at the bucket (and its cancel event) at least this often
CATCH_UP_S = 1.0  # while workers wait, the bucket holds up to this many seconds of its rate (see Limiter)
SERVE_BURST_S = 0.05  # the serving bucket's burst: a link's queue holds ~0.1 s, and a burst past it is what fills it


class Limiter:
    """A thread-safe token bucket of `rate` bytes per second (0: unlimited) with a `burst_s` burst. A request is
    allowed as soon as the bucket is out of debt and takes all its bytes, leaving it in debt when they are more
    than it holds, so the average holds whatever the request sizes. Granting at "not in debt" rather than at "holds
    the whole request" leaves the bucket's capacity as slack: waiters that wake late (a busy CPU, the POLL_S
    ticks) lose no tokens unless the bucket fills meanwhile. Asking for requests of up to a full bucket, with 1 MiB
    pieces over a 0.8 MiB bucket (8 MiB/s), every grant needed a full bucket and each late wake-up was lost: 8
    workers held 78-91 % of the limit on a loaded 2-core machine (scripts/bench_ratelimit.py).

    While a worker waits here the demand is there, so the bucket then fills up to CATCH_UP_S of the rate instead
    of `burst_s`: a waiter that got no CPU for a while (load 9 on 2 cores took 0.8-1.0 of the limit) takes the
    bytes it was owed when it runs, and the average over a second holds. With nobody waiting (the origin is the
    slow part, or no fetch runs) the bucket keeps its short burst, so idle time is never banked."""

    def __init__(self, rate: int = 0, burst_s: float = BURST_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self.burst_s = burst_s
        self._rate = max(0, int(rate))
        self._tokens = self._capacity()
        self._stamp = clock()
        self._waiting = 0  # workers blocked in acquire now
        self.waited_s = 0.0  # seconds workers spent blocked here, all together

    @property
    def rate(self) -> int:
        return self._rate

    def set_rate(self, rate: int) -> None:
        with self._lock:
            self._refill()
            self._rate = max(0, int(rate))
            self._tokens = min(self._tokens, self._capacity())

    def _capacity(self) -> float:
        return max(1.0, self._rate * self.burst_s)

    def _refill(self) -> None:
        now = self._clock()
        if self._rate:
            cap = max(self._capacity(), self._rate * CATCH_UP_S) if self._waiting else self._capacity()
            self._tokens = min(cap, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now

    def acquire(self, n: int, cancel: threading.Event | None = None) -> None:
        """Wait until `n` bytes are allowed, then take them. FetchCancelledError once `cancel` is set."""
        if n <= 0 or not self._rate:  # unlimited: called per piece, so no generator is made (0.1 us, not 10)
            return
        with closing(self._pauses(n)) as pauses:
            for pause in pauses:
                if cancel is None:
                    time.sleep(pause)
                elif cancel.wait(pause):
                    raise FetchCancelledError("fetch cancelled while waiting for its bandwidth limit")

    async def take(self, n: int) -> None:
        """`acquire` for a coroutine: waits on the event loop (the peer server paces its sends with one)."""
        if n <= 0 or not self._rate:
            return
        if (wait := self._grant(n, None)) <= 0:  # granted at once (the peer server's slices, mostly): no generator
            return
        import asyncio  # here: a CLI fetch paces threads only, and asyncio's import was 0.02-0.07 s of its start

        with closing(self._pauses(n, wait)) as pauses:
            for pause in pauses:
                await asyncio.sleep(pause)

    def _pauses(self, n: int, wait: float | None = None) -> Generator[float, None, None]:
        """The waits before `n` bytes are allowed (none when they are now), each at most POLL_S; taken when it
        ends. `wait`: what the caller's own first `_grant` said (it waits from now, as a waiter). Closed early
        (cancelled, interrupted), it stops counting as a waiter."""
        started = None
        try:
            if wait is None:
                wait = self._grant(n, None)
            while wait > 0:
                if started is None:
                    started = self._clock()
                yield min(wait, POLL_S)
                wait = self._grant(n, started)
            started = None
        finally:
            if started is not None:
                with self._lock:
                    self._waiting -= 1

    def _grant(self, n: int, since: float | None) -> float:
        """0.0 once `n` bytes are taken (the bucket was out of debt), else the seconds until it is. `since`: when
        the caller began waiting (None: it has not yet), for the waiting count and `waited_s`."""
        with self._lock:
            self._refill()
            if not self._rate or self._tokens >= 0:
                if self._rate:
                    self._tokens -= n
                if since is not None:
                    self._waiting -= 1
                    self.waited_s += self._clock() - since
                return 0.0
            if since is None:
                self._waiting += 1
            return -self._tokens / self._rate


class BandwidthLimits:
    """The process's limits: the node's origin and peer buckets and one per source key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.origin = Limiter()
        self.peers = Limiter()
        # what this node's peer server sends, to every peer together: below the node's uplink, so the ACKs of what
        # the node receives are not queued behind it (docs/peers.md, "Serving below the uplink"); short bursts
        self.serve = Limiter(burst_s=SERVE_BURST_S)
        self._sources: dict[str, Limiter] = {}

    def configure(self, origin: int = 0, peers: int = 0, sources: Mapping[str, int] | None = None,
                  serve: int = 0) -> None:
        """Set every limit (live: buckets in use keep their state and take the new rate)."""
        self.origin.set_rate(origin)
        self.peers.set_rate(peers)
        self.serve.set_rate(serve)
        wanted = {k.rstrip("/"): v for k, v in (sources or {}).items()}
        with self._lock:
            for key in list(self._sources):
                if key not in wanted:
                    del self._sources[key]
            for key, rate in wanted.items():
                if key in self._sources:
                    self._sources[key].set_rate(rate)
                else:
                    self._sources[key] = Limiter(rate)

    def for_source(self, name: str) -> Limiter | None:
        """The most specific source limit for an object named `name` (`s3://bucket/key`): `s3://bucket`, then
        `s3`; None when there is none."""
        with self._lock:
            if not self._sources:
                return None
            scheme, sep, rest = name.partition("://")
            if not sep:
                return None
            bucket = rest.split("/", 1)[0]
            return self._sources.get(f"{scheme}://{bucket}") or self._sources.get(scheme)

    def status(self) -> dict[str, object]:
        """The rates now (bytes/s, 0: none) and the seconds workers have waited on each bucket, all together
        (whether a limit bites): what `weightcache status` shows of a daemon."""
        with self._lock:
            sources = {k: v.rate for k, v in self._sources.items()}
            waited = {k: round(v.waited_s, 3) for k, v in self._sources.items()}
        return {"origin": self.origin.rate, "peers": self.peers.rate, "serve": self.serve.rate, "sources": sources,
                "waited_seconds": {"origin": round(self.origin.waited_s, 3), "peers": round(self.peers.waited_s, 3),
                                   "serve": round(self.serve.waited_s, 3), "sources": waited}}

    def acquire_origin(self, name: str, n: int, cancel: threading.Event | None = None) -> None:
        """Before `n` bytes of the object `name` are read from its origin: the source's limit, then the node's."""
        if (source := self.for_source(name)) is not None:
            source.acquire(n, cancel)
        self.origin.acquire(n, cancel)

    def acquire_peers(self, n: int, cancel: threading.Event | None = None) -> None:
        """As `n` bytes are read from peers."""
        self.peers.acquire(n, cancel)
