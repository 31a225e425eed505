"""A Source that reads a blob's byte ranges from peers first, then from the origin, every piece accounted for.

The fetch engine asks for ranges of an object (`read_pieces`); this wrapper serves a range from a peer that holds
the object's blob when the blob's sha256 is known on trusted evidence (the store's own SHA-256 checksum, or a
manifest this node wrote for that very object version); for any other object peers are never asked (a digest the
source merely claims could name another namespace's model: asking peers for it would widen access).

Concurrent ranges of one blob go to different holders in turn, so a blob's pieces come from several peers at
once. Nodes started together rotate their ranges by rank (`spread`) and wait for a range a peer is fetching from
the origin now (its claim) rather than ask the origin again (docs/peers.md, "Nodes started together"). A peer
failing mid-range (dead, cut) costs a retry of the rest of that range on the next holder, then on the origin.
Bytes from peers are hashed like any others by the fetch engine; when a blob fails verification,
`verification_failed` makes the next round read that blob from the origin only, and each piece a peer served is
compared with the origin's: a peer whose piece differs is banned (for BAN_S, doubled per repeat offence). A range
from a peer below the rate floor (client.Pace) is cut and taken elsewhere, and that peer is left out of the fetch.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import logging
import socket
import threading
import time
import typing
from collections.abc import Callable, Iterable
from contextlib import closing
from dataclasses import dataclass, field

from weightcache.errors import SourceError
from weightcache.peers.client import (
    WATCHDOG,
    Blob,
    Pace,
    PeerClient,
    PeerRangeMissing,
    PeerTooSlow,
    PeerUnreachable,
    peer_base_url,
)
from weightcache.peers.identity import OriginId
from weightcache.peers.inflight import InFlight
from weightcache.ratelimit import acquire_peers
from weightcache.retry import Retry, Retryable
from weightcache.sources.base import ObjectInfo, OnBytes, Pieces, Source, stream_range

log = logging.getLogger(__name__)

T = typing.TypeVar("T")
GRACE_S = 1.0  # how long a range of another node's first share waits for that node to start fetching it
POLL_S = 0.05  # between asks while waiting
REASK_S = 0.25  # a peer that lacked a blob is asked again after this (nodes started together register late)
BAN_S = 600.0  # a peer whose bytes the origin contradicts is not asked for this long; doubled per repeat offence
MAX_BAN_S = 24 * 3600.0


@dataclass
class PeerStats:
    """Counters of one node's peer traffic, shared by every fetch (the daemon exports them)."""

    bytes_by_peer: dict[str, int] = field(default_factory=dict)
    errors_by_peer: dict[str, int] = field(default_factory=dict)
    ban_s: float = BAN_S  # the first ban's length; each repeat doubles it, up to MAX_BAN_S
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    # peer -> (banned until, offences): peers that sent bytes the origin contradicts. A ban ends: the peer may
    # have been repaired or replaced at the same address, and a node banned by mistake must come back
    bans: dict[str, tuple[float, int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def banned(self) -> set[str]:
        """The peers banned now."""
        with self.lock:
            return self._banned_now()

    def _banned_now(self) -> set[str]:
        now = self.clock()
        return {peer for peer, (until, _) in self.bans.items() if now < until}

    def ban(self, peer: str) -> float:
        """Ban `peer` (its offence counts as an error too); returns the ban's length in seconds."""
        with self.lock:
            offences = self.bans.get(peer, (0.0, 0))[1] + 1
            length = min(MAX_BAN_S, self.ban_s * (1 << min(offences - 1, 32)))
            self.bans[peer] = (self.clock() + length, offences)
            self.errors_by_peer[peer] = self.errors_by_peer.get(peer, 0) + 1
        return length

    def add_bytes(self, peer: str, n: int) -> None:
        with self.lock:
            self.bytes_by_peer[peer] = self.bytes_by_peer.get(peer, 0) + n

    def error(self, peer: str) -> None:
        with self.lock:
            self.errors_by_peer[peer] = self.errors_by_peer.get(peer, 0) + 1


class PeerSet:
    """The peers of a node and what it learnt about them; `wrap` gives a fetch its PeerSource. `update` replaces
    the discovered peers (ModelCacheNode status) while the configured ones stay."""

    def __init__(self, clients: Iterable[PeerClient], make_client: Callable[[str], PeerClient] | None = None,
                 inflight: InFlight | None = None, self_url: str | None = None, ban_s: float = BAN_S) -> None:
        """`self_url`: this node's own peer address, as the others list it (its rank among them spreads the
        pieces that nodes started together fetch first); unknown: a hash of the host name stands in. `ban_s`:
        how long a peer whose bytes the origin contradicts is first left out (PeerStats.ban)."""
        self.clients = list(clients)
        self.self_url = self_url
        self._static = {c.url for c in self.clients}
        self._make_client = make_client
        self.stats = PeerStats(ban_s=ban_s)
        self.inflight = inflight or InFlight()  # this node's downloads its peer server may serve from

    def wrap(self, origin: Source, digests: dict[str, tuple[Blob, int]]) -> PeerSource:
        """`digests`: object key -> (trusted sha256 or origin identity, size) for the objects peers may serve."""
        with self.stats.lock:
            banned = self.stats._banned_now()
            usable = [c for c in self.clients if c.url not in banned]
            everyone = sorted({c.url for c in self.clients} - {self.self_url})
        me = self.self_url or socket.gethostname()
        rank = (bisect.bisect_left(everyone, me) if self.self_url
                else int.from_bytes(hashlib.sha256(me.encode()).digest()[:4], "big") % (len(everyone) + 1))
        return PeerSource(origin, usable, digests, self.stats, self.inflight, (rank, len(everyone) + 1))

    def update(self, urls: Iterable[str]) -> None:
        """Discovered peers now: new ones get a client, gone ones are dropped (fetches in flight keep theirs)."""
        if self._make_client is None:
            raise AssertionError("PeerSet.update needs make_client")
        with self.stats.lock:
            known = {c.url: c for c in self.clients}
        wanted = {peer_base_url(u) for u in urls} | self._static
        clients = [known.get(u) or self._make_client(u) for u in sorted(wanted)]
        with self.stats.lock:
            self.clients = clients
        if added := wanted - set(known):
            log.info("peers discovered: %s", ", ".join(sorted(added)))

    @property
    def urls(self) -> list[str]:
        with self.stats.lock:
            return [c.url for c in self.clients]

    def close(self) -> None:
        with self.stats.lock:
            clients = list(self.clients)
        for c in clients:
            c.close()


class PeerSource:
    """`origin` with peer-first ranged reads for the objects in `digests`; thread-safe like any Source."""

    def __init__(self, origin: Source, peers: typing.List[PeerClient],  # noqa: UP006
                 digests: dict[str, tuple[Blob, int]], stats: PeerStats, inflight: InFlight | None = None,
                 rank: tuple[int, int] = (0, 1)) -> None:
        """`rank`: (this node's place, nodes) among its peers and itself: which share of pieces it fetches first."""
        self.origin = origin
        self._inflight = inflight or InFlight()
        self._rank = rank
        self._own: set[tuple[str, int]] = set()  # (key, offset) of the ranges this node fetches first
        self._grace_until: float | None = None  # until when ranges of others' shares wait for any peer
        self.ref, self.name = origin.ref, origin.name
        self._peers = peers
        self._digests = digests
        self._stats = stats
        self._lock = threading.Lock()
        self._probing = threading.Lock()
        # sha256 -> (when asked, peers that said they hold or are downloading it)
        self._holders: dict[str, tuple[float, typing.List[PeerClient]]] = {}  # noqa: UP006 (`list` is a method)
        self._turn = itertools.count()
        self._origin_only: set[str] = set()  # object keys that failed verification once
        self._dead: set[str] = set()  # peers that did not answer a HEAD during this fetch
        self._served: dict[tuple[str, int], tuple[str, bytes]] = {}  # (key, offset) -> (peer, piece digest)
        self.peer_bytes = 0

    # -- the Source interface: everything but read_pieces goes to the origin ----------------------------------
    def list(self) -> list[ObjectInfo]:
        return self.origin.list()

    def read_into(self, obj: ObjectInfo, offset: int, buf: memoryview) -> None:
        self.origin.read_into(obj, offset, buf)

    def etag_md5(self, obj: ObjectInfo) -> str | None:
        return self.origin.etag_md5(obj)

    def close(self) -> None:
        self.origin.close()

    def spread(self, ranges: typing.List[T], key: Callable[[T], tuple[str, int]]) -> typing.List[T]:  # noqa: UP006
        """The fetch's ranges in this node's order: rotated by its rank, so nodes started together fetch different
        ranges from the origin first; that first share is this node's own (`key`: (object key, offset))."""
        place, nodes = self._rank
        if nodes <= 1 or not ranges:
            return ranges
        cut = len(ranges) * place // nodes
        mine = ranges[cut:cut + -(-len(ranges) // nodes)]
        with self._lock:
            self._own = {key(r) for r in mine}
        return ranges[cut:] + ranges[:cut]

    def read_pieces(self, obj: ObjectInfo, offset: int, length: int, buf: memoryview,
                    on_bytes: OnBytes | None = None) -> Pieces:
        """Peers first: those holding the blob, or fetching these bytes now (their server streams them as they
        arrive). A range outside this node's own share that no peer has yet is asked again for up to GRACE_S
        (the node it falls to first is about to fetch it), counted from the fetch's first ask unless a peer is
        downloading the blob, then from this range's; then the origin, with a claim that lets this node's peer
        server stream it to the others."""
        pos, end = offset, offset + length
        trusted = self._digests.get(obj.key)
        if trusted is None or obj.key in self._origin_only:
            yield from self._from_origin(obj, pos, end, buf, on_bytes, None)
            return
        name = blob_key(trusted[0])
        with self._lock:
            wait = (obj.key, offset) not in self._own and self._rank[1] > 1
            # peers that start later register later: ranges may wait for them until GRACE_S after this fetch's
            # first ask (once per fetch, so peers that never fetch the model cost that once, not per blob)
            if self._grace_until is None:
                self._grace_until = time.monotonic() + GRACE_S
            fetch_deadline = self._grace_until
        deadline = time.monotonic() + GRACE_S
        while True:
            progressed, downloading = False, False
            for peer in self._holders_in_turn(*trusted):
                try:
                    for at, view in self._from_peer(peer, obj.key, trusted[0], pos, end, buf, on_bytes):
                        yield at, view
                        pos, progressed = at + len(view), True
                except PeerRangeMissing:
                    downloading = True  # a peer still downloading the blob lacks these bytes: no fault of its own
                except PeerTooSlow as exc:
                    self._stats.error(peer.url)
                    with self._lock:
                        self._dead.add(peer.url)  # this fetch asks it no more: one slow peer costs ~1 s, once
                    log.warning("%s at byte %d of %s; this fetch takes the rest elsewhere", exc, pos, obj.relpath)
                except SourceError as exc:
                    self._stats.error(peer.url)
                    self._drop_holder(name, peer)
                    log.warning("peer %s failed at byte %d of %s (%s); the rest of the range from another source",
                                peer.url, pos, obj.relpath, exc)
                if pos >= end:
                    return
            if progressed:
                continue
            now = time.monotonic()
            if not wait or (now >= fetch_deadline and not (downloading and now < deadline)):
                break
            time.sleep(POLL_S)
        yield from self._from_origin(obj, pos, end, buf, on_bytes, name)

    def _from_origin(self, obj: ObjectInfo, pos: int, end: int, buf: memoryview, on_bytes: OnBytes | None,
                     sha256: str | None) -> Pieces:
        claim = self._inflight.claim(sha256, pos, end) if sha256 else None
        try:
            with closing(self.origin.read_pieces(obj, pos, end - pos, buf, on_bytes)) as pieces:
                for at, view in pieces:
                    self._blame(obj.key, at, view)
                    if sha256:  # this node's peer server may relay these bytes while the download goes on
                        self._inflight.from_origin(sha256, at, at + len(view))
                    yield at, view
        finally:
            if claim is not None:
                self._inflight.release(claim)

    # -- peers ------------------------------------------------------------------------------------------------
    def _holders_in_turn(self, blob: Blob, size: int) -> typing.List[PeerClient]:  # noqa: UP006
        """Peers holding or downloading the blob, rotated per range so concurrent ranges spread out. Asked once
        per fetch when every peer has it; peers that did not are asked again after REASK_S (they may have
        started downloading it since)."""
        sha256 = blob_key(blob)
        with self._lock:
            asked, known = self._holders.get(sha256, (-REASK_S, []))
        if time.monotonic() - asked >= REASK_S and len(known) < len(self._live_peers()):
            with self._probing:  # one prober at a time: a dead peer is found once, then skipped by the others
                with self._lock:
                    asked, known = self._holders.get(sha256, (-REASK_S, []))
                if time.monotonic() - asked >= REASK_S:
                    known = [p for p in self._live_peers() if p in known or self._asks(p, blob, size)]
                    with self._lock:
                        self._holders[sha256] = (time.monotonic(), known)
        banned = self._stats.banned
        with self._lock:
            holders = [p for p in known if p.url not in banned and p.url not in self._dead]
        if not holders:
            return []
        start = next(self._turn) % len(holders)
        return holders[start:] + holders[:start]

    def _live_peers(self) -> typing.List[PeerClient]:  # noqa: UP006
        with self._lock:
            return [p for p in self._peers if p.url not in self._dead]

    def _asks(self, peer: PeerClient, sha256: Blob, size: int) -> bool:
        """HEAD one peer; one that cannot be reached is not asked again by this fetch (a blackholed peer costs
        one connect timeout per fetch, not one per blob)."""
        try:
            return peer.probe(sha256, size) is not None
        except PeerUnreachable as exc:
            log.info("%s; this fetch goes on without it", exc)
            self._stats.error(peer.url)
            with self._lock:
                self._dead.add(peer.url)
            return False

    def _drop_holder(self, sha256: str, peer: PeerClient) -> None:
        with self._lock:
            asked, known = self._holders.get(sha256, (time.monotonic(), []))
            self._holders[sha256] = (asked, [p for p in known if p is not peer])

    def _from_peer(self, peer: PeerClient, key: str, sha256: Blob, pos: int, end: int, buf: memoryview,
                   on_bytes: OnBytes | None) -> Pieces:
        """Yield pieces of [pos, end), or of the shorter span a peer still downloading the blob serves, from one
        peer. One attempt: a failure raises SourceError and the caller goes on with the bytes not yet yielded;
        PeerTooSlow when the watchdog cut a range below its rate floor (client.Pace)."""
        pace = Pace(end - pos)
        WATCHDOG.watch(pace)
        try:
            yield from self._paced(peer, key, sha256, pos, end, buf, on_bytes, pace)
        except PeerRangeMissing:
            raise
        except SourceError as exc:
            if pace.was_cut:
                raise PeerTooSlow(f"peer {peer.url} sent {pace.describe()}") from exc
            raise
        finally:
            pace.finish()
            WATCHDOG.unwatch(pace)

    def _paced(self, peer: PeerClient, key: str, blob: Blob, pos: int, end: int, buf: memoryview,
               on_bytes: OnBytes | None, pace: Pace) -> Pieces:
        sha256 = blob_key(blob)
        try:
            resp, served = peer.open_span(blob, pos, end, pace)
        except Retryable as exc:
            raise SourceError(str(exc)) from exc
        pace.expect(served - pos)
        opened = iter([resp])

        def counted(n: int) -> None:
            pace.add(n)
            if on_bytes is not None:
                on_bytes(n)

        def open_once(a: int, b: int) -> typing.Any:
            resp = next(opened, None)
            if resp is None:
                raise Retryable(f"peer {peer.url} cut blob {sha256[:12]} at byte {a}")
            return resp

        retry = Retry(f"reading blob {sha256[:12]} bytes {pos}-{served - 1} from peer {peer.url}", 1)
        with closing(stream_range(open_once, pos, served - pos, buf, retry, counted)) as pieces:
            for at, view in pieces:
                with pace.held():  # our own wait is no slowness of the peer's
                    acquire_peers(len(view))  # the node's peer bytesPerSecond: the next piece waits (ratelimit.py)
                with self._lock:
                    self._served[(key, at)] = (peer.url, hashlib.sha256(view).digest())
                    self.peer_bytes += len(view)
                self._stats.add_bytes(peer.url, len(view))
                yield at, view

    # -- blame ------------------------------------------------------------------------------------------------
    def verification_failed(self, obj: ObjectInfo) -> None:
        """The blob assembled for `obj` failed its checks: its next round reads from the origin only."""
        with self._lock:
            self._origin_only.add(obj.key)

    def _blame(self, key: str, at: int, view: memoryview) -> None:
        """An origin piece of a blob that failed verification: a peer that served other bytes here is banned."""
        with self._lock:
            served = self._served.pop((key, at), None) if key in self._origin_only else None
        if served is None:
            return
        peer, digest = served
        if hashlib.sha256(view).digest() != digest:
            length = self._stats.ban(peer)
            log.warning("peer %s sent bytes at offset %d of %s that the origin contradicts; not asking it for "
                        "%.0f s", peer, at, key, length)


def blob_key(blob: Blob) -> str:
    """How a blob is keyed in holders, claims and downloads in flight: its sha256, or its identity's address."""
    return blob.address if isinstance(blob, OriginId) else blob
