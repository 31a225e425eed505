"""Downloads in flight that peers may read from: blob sha256 -> the PartialFile being written, the byte ranges
this node is reading from the origin right now (its claims), and which of its bytes came from the origin.

The fetch engine registers a partial download when the blob's sha256 is known on trusted evidence (the same rule
as for asking peers) and removes it once the blob is published; the peer server serves ranges the partial file
has written and journalled (`PartialFile.holds`), and answers a claimed range with nothing journalled yet "not
yet" (after a short wait for its first piece), so a node that starts together with this one asks again for a
piece this node is fetching instead of reading it from the origin too. Those bytes are not verified yet: the
asking node verifies the whole blob as always, and a download that fails verification is withdrawn here before it
is discarded.

Only bytes this node read from the origin itself, in this run, are served in flight (`origin_end`): bytes it got
from a peer are not relayed before the blob is verified. A node that relayed a hostile peer's piece would be the
one its asker compares with the origin and bans; serving origin bytes only, the node whose bytes are wrong is
always the one that sent them (docs/peers.md, "Blame"). Resumed journal ranges are not served either: which
source wrote them in an earlier run is unknown.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from weightcache.download import PartialFile, Runs

STALL_S = 10.0  # a claim that gained no byte for this long is no longer answered "not yet"


@dataclass(eq=False)
class Claim:
    """A range [start, end) of a blob this node reads from the origin now; `touched`: when a byte last came."""

    sha256: str
    start: int
    end: int
    touched: float = field(default_factory=time.monotonic)
    began: float = field(default_factory=time.monotonic)
    got: int = 0  # bytes of it received so far (from `start`)
    piece: int = 0  # the largest piece journalled at once: bytes are servable a piece at a time

    def touch(self, n: int = 0) -> None:
        self.got += n  # called by the one thread reading the claim; eta() reads a stale value at worst
        self.touched = time.monotonic()

    def eta(self, pos: int, now: float) -> float | None:
        """Seconds until the piece holding byte `pos` is journalled, at the rate the claim has had; None before
        its first bytes (no rate yet)."""
        if self.got <= 0 or self.piece <= 0:
            return None
        done = self.start + ((pos - self.start) // self.piece + 1) * self.piece
        missing = min(done, self.end) - (self.start + self.got)
        return max(0.0, missing) / (self.got / max(now - self.began, 1e-3))


class InFlight:
    """Thread-safe registry shared by a node's fetches and its peer server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parts: dict[str, PartialFile] = {}
        self._origin: dict[str, Runs] = {}  # sha256 -> bytes of the registered part that the origin sent
        # sha256 -> other downloads of the same blob (two models sharing a file): while one runs, origin bytes
        # are not recorded, since they could belong to either part
        self._others: dict[str, list[PartialFile]] = {}
        self._claims: list[Claim] = []
        self._planning = 0  # fetches of this node that have yet to register their downloads (`planning`)

    def add(self, sha256: str, part: PartialFile) -> None:
        with self._lock:
            registered = self._parts.setdefault(sha256, part)
            if registered is part:
                self._origin.setdefault(sha256, Runs())
            elif not any(p is part for p in self._others.get(sha256, [])):
                self._others.setdefault(sha256, []).append(part)

    def remove(self, sha256: str, part: PartialFile) -> None:
        with self._lock:
            if self._parts.get(sha256) is part:
                del self._parts[sha256]
                self._origin.pop(sha256, None)
            elif others := self._others.get(sha256):
                others[:] = [p for p in others if p is not part]
                if not others:
                    del self._others[sha256]

    def planning(self) -> Planning:
        """A fetch of this node begins: until it registers its downloads (`Planning.done`) the peer server answers
        a blob it lacks with "planning" (its fetch may be of that blob), and a node waiting on this one for its
        share of a model waits on rather than read that share from the origin after its grace: a daemon slow to
        list and plan (a busy CPU, an origin answering 503) lost its share to every other node of the fleet
        (docs/peers.md, "Nodes started together")."""
        with self._lock:
            self._planning += 1
        return Planning(self)

    def is_planning(self) -> bool:
        with self._lock:
            return self._planning > 0

    def get(self, sha256: str) -> PartialFile | None:
        with self._lock:
            return self._parts.get(sha256)

    def from_origin(self, sha256: str, start: int, end: int) -> None:
        """Bytes [start, end) of the blob came from the origin (they are about to be written): servable once
        journalled."""
        with self._lock:
            runs = self._origin.get(sha256)
            if runs is not None and sha256 not in self._others:
                runs.add(start, end)

    def origin_end(self, sha256: str, part: PartialFile, start: int, end: int) -> int:
        """How far from `start` (at most `end`) `part` holds journalled bytes that came from the origin."""
        held = part.held_end(start, end)
        with self._lock:
            runs = self._origin.get(sha256) if self._parts.get(sha256) is part else None
            return min(held, runs.reach(start)) if runs is not None else start

    def started(self, sha256: str) -> bool:
        """The registered download has origin bytes, or claims: something of it may be served now or soon."""
        with self._lock:
            runs = self._origin.get(sha256)
            return bool(runs is not None and runs.starts) or any(c.sha256 == sha256 for c in self._claims)

    def claim(self, sha256: str, start: int, end: int) -> Claim:
        """This node reads [start, end) of the blob from the origin now; `release` the result when done, `touch`
        it as bytes arrive."""
        claim = Claim(sha256, start, end)
        with self._lock:
            self._claims.append(claim)
        return claim

    def release(self, claim: Claim) -> None:
        with self._lock:
            self._claims.remove(claim)

    def eta(self, sha256: str, pos: int) -> float | None:
        """Seconds until byte `pos` of the blob is journalled, by the claim covering it (None: unknown). Told to
        an asker with "not yet", so that it asks again about then rather than every fraction of a second: a
        fleet of N nodes following each other's ranges polled N^2 times per piece."""
        now = time.monotonic()
        with self._lock:
            claim = next((c for c in self._claims if c.sha256 == sha256 and c.start <= pos < c.end), None)
        return claim.eta(pos, now) if claim is not None else None

    def pending(self, sha256: str, pos: int) -> bool:
        """Byte `pos` of the blob is on its way from the origin: a claim covers it and gained a byte within
        STALL_S (a claim held up at the origin stops being one others should wait for)."""
        now = time.monotonic()
        with self._lock:
            return any(c.sha256 == sha256 and c.start <= pos < c.end and now - c.touched < STALL_S
                       for c in self._claims)


class Planning:
    """One fetch's planning (InFlight.planning); `done` once its downloads are registered or it failed."""

    def __init__(self, inflight: InFlight) -> None:
        self._inflight: InFlight | None = inflight

    def done(self) -> None:
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            with inflight._lock:
                inflight._planning -= 1
