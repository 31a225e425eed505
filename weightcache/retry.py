"""The one retry policy: every source's requests and body reads, and the cluster watch, back off through here.

A failure worth another attempt is raised as `Retryable` (the backend's cause chained). `Retry` counts the
failures of one operation, waits between attempts (exponential backoff with full jitter, a server's Retry-After
as a floor, both capped) and, when attempts run out, raises `RetriesExceededError` naming the operation and
the last reason. A wait ends early when the caller's cancel event is set, so Ctrl-C and shutdown never sit out a
backoff.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from weightcache.errors import FetchCancelledError, RetriesExceededError

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_BACKOFF = 10.0  # seconds; also the cap on a server's Retry-After
DEFAULT_ATTEMPTS = 5
DEFAULT_BACKOFF = 0.2  # the first pause's upper bound; doubles per failure
# a store answering "slow down" (S3 503 SlowDown, 429) is retried this long from its first such answer, whatever
# the attempts: 5 attempts took under 3 s, and a fleet starting behind an origin throttling it for 10 s failed
# every fetch at its listing (scripts/bench_fleet_netns.py --faults)
THROTTLED_S = 60.0
# ...and each of those pauses is at most this long (a server's Retry-After still sets a longer one): a throttling
# window ends unannounced, and a pause that had doubled to MAX_BACKOFF held a node up to 10 s past it (a fleet
# behind an origin answering 503 for its first 10 s came back to it over 10 s, the last node 9 s late:
# scripts/bench_fleet_netns.py --faults, docs/peers.md). Full jitter keeps the retries of many nodes spread.
THROTTLED_MAX_BACKOFF = 2.0


#: A range's first byte may take this long per byte asked for, beyond the per-read timeout: some origins copy
#: or read the object before they answer (moto copies the whole object per ranged GET; a 128 MiB range's first
#: byte took over the 10 s read timeout on a loaded machine). 4 MB/s: 16 MiB +4 s, 256 MiB +67 s.
FIRST_BYTE_RATE = 4_000_000
FIRST_BYTE_MAX = 300.0  # seconds, whatever the range


def first_byte_timeout(read_timeout: float, length: int) -> float:
    """Seconds a request for `length` bytes may wait for its response: the per-read timeout, plus time that
    grows with the range. Once the body flows, each read has `read_timeout` again (`body_timeout`)."""
    return min(FIRST_BYTE_MAX, read_timeout + max(0, length) / FIRST_BYTE_RATE)


def body_timeout(resp: object, seconds: float) -> None:
    """Give the reads of a urllib3 response's body the per-read timeout `seconds` (its request was sent with a
    longer first-byte deadline; the pool sets the timeout again for the connection's next request)."""
    sock = getattr(getattr(resp, "connection", None), "sock", None)
    if sock is not None:
        sock.settimeout(seconds)


class Retryable(Exception):
    """A failure worth another attempt; the backend's exception is chained as the cause."""

    def __init__(self, reason: str, retry_after: float | None = None, *, throttled: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after
        self.throttled = throttled  # the server asked us to slow down (THROTTLED_S)


class PartialRead(Retryable):
    """A read failed after writing `done` bytes of its buffer."""

    def __init__(self, done: int, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason, retry_after)
        self.done = done


def backoff_pause(failures: int, first: float, *, cap: float = MAX_BACKOFF, retry_after: float | None = None) -> float:
    """Seconds to wait after `failures` failures: full jitter up to first * 2**(failures-1), at least a
    server's Retry-After; the backoff capped at `cap`, the Retry-After at `cap` or MAX_BACKOFF, the longer."""
    pause = random.uniform(0, min(cap, first * 2 ** (max(1, failures) - 1)))
    if retry_after:
        pause = max(pause, min(retry_after, max(cap, MAX_BACKOFF)))
    return pause


@dataclass
class Retry:
    """Failure accounting for one operation (a request, a range read)."""

    what: str  # "reading s3://b/k bytes 0-99": the operation, as an error message names it
    max_attempts: int = DEFAULT_ATTEMPTS
    backoff: float = DEFAULT_BACKOFF
    cancel: threading.Event | None = field(default=None, repr=False)
    failures: int = 0
    throttled_since: float | None = None  # the first "slow down" answer: throttled failures count by time

    def failed(self, err: Retryable) -> None:
        """Count `err`; wait before the next attempt, or raise RetriesExceededError when none is left (a
        throttled failure: when THROTTLED_S have passed since the first)."""
        self.failures += 1
        cause = err.__cause__ or err
        if err.throttled and self.throttled_since is None:
            self.throttled_since = time.monotonic()
        throttled_for = time.monotonic() - self.throttled_since if err.throttled and self.throttled_since else None
        if (self.failures >= self.max_attempts and throttled_for is None) or \
                (throttled_for is not None and throttled_for >= THROTTLED_S):
            raise RetriesExceededError(
                f"{self.what} failed {self.failures} times, last: {err.reason}; check the network and the object "
                "store, then fetch again (finished ranges are kept)", cause) from cause
        pause = backoff_pause(self.failures, self.backoff, retry_after=err.retry_after,
                              cap=THROTTLED_MAX_BACKOFF if err.throttled else MAX_BACKOFF)
        log.debug("retrying %s in %.2fs after: %s", self.what, pause, err.reason)
        wait(pause, self.cancel)

    def call(self, fn: Callable[[], T]) -> T:
        """`fn()` until it returns; each `Retryable` it raises counts as one failure."""
        while True:
            try:
                return fn()
            except Retryable as err:
                self.failed(err)


def wait(seconds: float, cancel: threading.Event | None) -> None:
    """Sleep, or raise FetchCancelledError as soon as `cancel` is set."""
    if cancel is None:
        time.sleep(seconds)
    elif cancel.wait(seconds):
        raise FetchCancelledError("cancelled; finished chunks are kept and resume on the next run")
