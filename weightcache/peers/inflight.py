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

import contextlib
import threading
import time
import typing
from dataclasses import dataclass, field

from weightcache.download import PartialFile, Runs

if typing.TYPE_CHECKING:  # the fetch path imports this module: a CLI fetch pays no asyncio (only `watch` runs it)
    import asyncio

class TcpConnection(typing.Protocol):
    """A peer's connection to this node's peer server as InFlight keeps it (asyncio's TransportSocket; a socket in
    tests): only its TCP state is read (client.acked_ago), never its bytes, and a closed one has no descriptor (-1)."""

    def fileno(self) -> int: ...

    def getsockopt(self, level: int, optname: int, buflen: int, /) -> bytes: ...


MAX_CONNS = 16  # connections a peer host is remembered by (`asked_by`): a peer asks on a few at once
STALL_S = 10.0  # a claim that gained no byte for this long is no longer answered "not yet"
# a claim that journals a piece at least this often is streamed to an asker as its pieces land (InFlight.following),
# one request per range: answered "not yet" and asked again per piece, a fleet's asks grew with N^2
FOLLOW_S = 1.0


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

    def interval(self, now: float) -> float | None:
        """Seconds between two of its pieces at the rate it has had; None before a first piece."""
        if self.got <= 0 or self.piece <= 0:
            return None
        return self.piece / (self.got / max(now - self.began, 1e-3))


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
        self._asked: dict[str, float] = {}  # peer host -> when it last asked this node's peer server (`asked_by`)
        self._conns: dict[str, list[TcpConnection]] = {}  # peer host -> its connections to the peer server (`asked_by`)
        # sha256 -> futures of peer streams waiting for the next origin piece of it to be journalled (`landed`)
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]] = {}

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
        self.landed(sha256)  # streams following it go on from its blob, or end

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

    def asked_by(self, host: str, conn: TcpConnection | None = None) -> None:
        """A peer at `host` asked this node's peer server now (authorized): it is up, and its link too. `conn`: the
        connection's socket (asyncio's TransportSocket): while it is open, what the peer's kernel acknowledges on it
        tells this node's fetches whether the peer's link is up (`connections`, client._Acks)."""
        now = time.monotonic()
        with self._lock:
            self._asked[host] = now
            if conn is not None:
                # the closed ones go (a closed socket's descriptor is -1); a peer holds a few connections open
                conns = [c for c in self._conns.get(host, []) if c is not conn and c.fileno() >= 0]
                self._conns[host] = [*conns[-(MAX_CONNS - 1):], conn]

    def connections(self, host: str) -> list[TcpConnection]:
        """The peer server's open connections from `host` (sockets: read their TCP state only)."""
        with self._lock:
            return [c for c in self._conns.get(host, []) if c.fileno() >= 0]

    def asked_at(self, host: str) -> float | None:
        """When a peer at `host` last asked this node's peer server (monotonic), or None."""
        with self._lock:
            return self._asked.get(host)

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

    def origin_part(self, sha256: str) -> PartialFile | None:
        """The registered download of the blob whose origin bytes are recorded (`from_origin`), None when there is
        none or another download of the same blob runs beside it."""
        with self._lock:
            return self._parts.get(sha256) if sha256 in self._origin and sha256 not in self._others else None

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
        self.landed(claim.sha256)  # streams following it look again: at what it journalled, or at its end

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

    def following(self, sha256: str, pos: int) -> Claim | None:
        """The claim bringing byte `pos` of the blob, when it journals a piece at least every FOLLOW_S and moved
        within STALL_S: an asker is streamed the range as its pieces land (server `_stream`) rather than told
        "not yet"; None otherwise."""
        now = time.monotonic()
        with self._lock:
            claim = next((c for c in self._claims if c.sha256 == sha256 and c.start <= pos < c.end), None)
        if claim is None or now - claim.touched >= STALL_S:
            return None
        interval = claim.interval(now)
        return claim if interval is not None and interval <= FOLLOW_S else None

    def watch(self, sha256: str) -> asyncio.Future[None]:
        """A future (of the running loop) done when the next origin piece of the blob is journalled; `unwatch` it
        when done with it."""
        import asyncio  # the peer server's own loop: loaded long before

        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._waiters.setdefault(sha256, []).append((loop, future))
        return future

    def unwatch(self, sha256: str, future: asyncio.Future[None]) -> None:
        with self._lock:
            waiting = self._waiters.get(sha256, [])
            waiting[:] = [(loop, f) for loop, f in waiting if f is not future]
            if not waiting:
                self._waiters.pop(sha256, None)

    def landed(self, sha256: str) -> None:
        """An origin piece of the blob was journalled (called by the fetch, from its thread): the streams
        following it send it now."""
        with self._lock:
            waiting = self._waiters.pop(sha256, [])
        for loop, future in waiting:
            with contextlib.suppress(RuntimeError):  # that loop is closed: its server stopped
                loop.call_soon_threadsafe(_wake, future)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Planning:
    """One fetch's planning (InFlight.planning); `done` once its downloads are registered or it failed."""

    def __init__(self, inflight: InFlight) -> None:
        self._inflight: InFlight | None = inflight

    def done(self) -> None:
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            with inflight._lock:
                inflight._planning -= 1
