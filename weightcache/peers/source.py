"""A Source that reads a blob's byte ranges from peers first, then from the origin, every piece accounted for.

The fetch engine asks for ranges of an object (`read_pieces`); this wrapper serves a range from a peer that holds
the object's blob when the blob's sha256 is known on trusted evidence (the store's own SHA-256 checksum, or a
manifest this node wrote for that very object version); for any other object peers are never asked (a digest the
source merely claims could name another namespace's model: asking peers for it would widen access).

Concurrent ranges of one blob go to different holders in turn, so a blob's pieces come from several peers at
once. Nodes started together cut the model into ranges that each node owns a few of, rotate them by rank
(`spread`), ask a range's owner first, and while it reads the range from the origin ("not yet") take another
range and come back (`Later`) rather than ask the origin again (docs/peers.md, "Nodes started together"). A peer
failing mid-range (dead, cut) costs a retry of the rest of that range on the next holder, then on the origin.
Bytes from peers are hashed like any others by the fetch engine; when a blob fails verification,
`verification_failed` makes the next round read that blob from the origin only, and each piece a peer served is
compared with the origin's: a peer whose piece differs is banned (for BAN_S, doubled per repeat offence). A range
from a peer below the rate floor (client.Pace: relative to the fetch's own origin rate, judged across the peer's
streams) is cut and taken elsewhere, and that peer is left out for BENCH_S, doubled each time.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import hashlib
import itertools
import logging
import socket
import threading
import time
import typing
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass, field

from weightcache.download import PartialFile
from weightcache.errors import SourceError
from weightcache.peers.client import (
    FLOOR_SHARE,
    MAX_STATUS_BLOBS,
    SILENT_S,
    SLOW_BYTES_S,
    SLOW_GRACE_S,
    SLOW_MIN_BYTES_S,
    STREAMS_PER_ASKER,
    WATCHDOG,
    Blob,
    EagerBody,
    Link,
    Pace,
    PeerBadAnswer,
    PeerBlobGone,
    PeerBusy,
    PeerClient,
    PeerDown,
    PeerFlow,
    PeerLied,
    PeerRangeMissing,
    PeerRangePending,
    PeerTooSlow,
    PeerUnreachable,
    answer_wait,
    answers_no_connect,
    connect_timed_out,
    peer_base_url,
    probe_wait,
    refused,
)
from weightcache.peers.identity import OriginId
from weightcache.peers.inflight import InFlight
from weightcache.ratelimit import BandwidthLimits
from weightcache.retry import Retry, Retryable
from weightcache.sources.base import ObjectInfo, OnBytes, Pieces, Source, stream_range

log = logging.getLogger(__name__)

T = typing.TypeVar("T")


class Later(Exception):
    """Bytes from `pos` of this range are on their way to a peer (it reads them from the origin now, or the node
    that owns the range has yet to start): the fetch engine takes another range first and comes back. Raised only
    while the engine's `defer_while` test says the engine has other ranges to take."""

    def __init__(self, pos: int, delay: float | None = None, on: str | None = None) -> None:
        super().__init__(pos)
        self.pos = pos
        self.delay = delay  # when to come back (the peer's estimate, bounded); None: the engine's default
        self.on = on  # the peer whose bytes it waits for: taken again at once when that peer goes down (`wake`)


GRACE_S = 1.0  # how long a range of another node's first share waits for that node to start fetching it
POLL_S = 0.05  # between asks while waiting, when the peer gave no estimate of when the bytes come
# a peer's "not yet" says when it expects the first piece (X-Weightcache-Retry-Ms); its word is bounded by these
NOT_YET_MIN_S, NOT_YET_MAX_S = 0.05, 3.0
NOT_YET_SLACK_S = 0.1  # the piece is journalled a little after its last byte came
# a range whose owner has not started it ("missing" from the owner) is asked again after UNSTARTED_S, doubled each
# time up to UNSTARTED_MAX_S: at 0.2 s each, 16 daemons starting a few seconds apart asked each other ~150 times a
# second per node before the first origin byte (docs/peers.md, "Less CPU a fill")
UNSTARTED_S, UNSTARTED_MAX_S = 0.2, 1.0
REASK_S = 0.25  # a peer that lacked a blob is asked again after this (nodes started together register late)
NO_ROUND = -REASK_S  # when a blob's HEAD round ran, before its first (its holders may be readers asked alone)
# a peer whose port refused (dead: _reprobe) is asked again after REASK_S, doubled per refusal up to this: a daemon
# restarting on its node is found this late at most, and a fleet fill with a third of its nodes killed did not
# send each live node's threads 4 refused HEADs a second per dead peer for MAX_PENDING_S (0.4 ms CPU each)
DEAD_REASK_MAX_S = 2.0
BENCH_S = 1.0  # a peer cut as too slow is left out of the fetch this long, doubled each time, up to MAX_BENCH_S
MAX_BENCH_S = 30.0
PROVEN_BYTES = 4 << 20  # a peer cut as slow after sending this fetch this much is waited for, not the origin
# a peer that failed, or sent nothing this long and was cut, is down until it answers again (PeerSource._went_down);
# and nothing heard from anywhere this long is this node's own link going (_not_theirs)
DOWN_S = 2.0
# a peer this fetch has heard from is connected to within this long (at most the configured connectTimeout): its
# connects took milliseconds, a SYN dropped in a full queue is sent again after 1 s; a peer that completes none in
# that time is cut off or gone, and its ranges go on. At the configured 5 s the streams still connecting when the
# --faults node was cut off held its ranges 5-10 s (the silence probe cuts a socket, and a connect has none yet).
# Longer where answers take longer (_timeouts)
KNOWN_CONNECT_S = 1.0
BUSY_S = 1.0  # a filling peer that answered 429 (busy) for a range is asked again after this (its Retry-After)
RELAY_FLOOR = SLOW_MIN_BYTES_S // 4  # the rate floor of a range from its owner while it fills the blob (_from_peer)
# and its grace: such a range streams as the owner's origin pieces land, one of ~30 flows on each link of a fleet
# filling at once, and flows starved for a second or more in the links' queues (N = 16, 1 MB/s: 85 cuts a fill)
RELAY_GRACE_S = 3.0
RELAY_PIECES = 64  # in a fleet, a claimed range is read from the origin in this many pieces (_relay_piece)
RELAY_PIECE_MIN = 16 << 10
LONG_WAIT_S = 5.0  # a range that waited this long on peers without a byte says on whom, once (PeerSource._settle)
PENDING_S = 15.0  # a range waits on peers ("not yet", a bench) at most this long without a byte of it, or longer:
# as long as PENDING_PIECES pieces take at this fetch's own rate per origin connection, at most MAX_PENDING_S. The
# owner reads the range at about that rate too: behind one 1 MB/s origin link shared by 11 nodes (--faults) a piece
# took 9 s, an owner's relay went 15 s without a byte, and every node handed live owners' ranges on (0.6x the model)
PENDING_PIECES = 4
MAX_PENDING_S = 60.0
BAN_S = 600.0  # a peer whose bytes the origin contradicts is not asked for this long; doubled per repeat offence
MAX_BAN_S = 24 * 3600.0
VOUCHERS = 2  # other holders asked for a digest of a peer's first piece before the origin judges it
# the origin judges a peer's first piece when no other holder vouches for it only if the piece is at most this
# big, or at most 1/JUDGE_SHARE of its blob: one piece of a small blob may be the whole file (a 2 MiB model read
# twice), and there the blob's own sha256 bounds what a liar costs about as well
JUDGE_BYTES = 1 << 20
JUDGE_SHARE = 8
#: judges a peer's piece (at, view, its sha256) before it is used (PeerSource._judged): "vouched" (a second
#: holder's digest agrees), "origin" (the origin's bytes agree: they count as the origin's), "lied" (the origin
#: contradicts it, and `view` holds the origin's bytes now), "unjudged" (no one could judge it at a fair cost)
Verdict = typing.Literal["vouched", "origin", "lied", "unjudged"]
Judge = Callable[[int, memoryview, bytes], Verdict]


class _JudgeFailed(Exception):
    """The origin failed while judging a peer's piece: raised as the origin's error, never as the peer's fault."""

    def __init__(self, error: SourceError) -> None:
        super().__init__(str(error))
        self.error = error


class _OwnerBack(Exception):
    """A range this node took over is its owner's again, before a byte of it was read (PeerSource._owner_back)."""


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
        """Ban `peer` (its offence counts as an error too); returns the ban's length in seconds. A peer banned now
        is not banned again: the other wrong pieces of the same blob (each is compared with the origin's after
        it failed, and a liar sends many at once, docs/peers.md "The lying peer") are one offence, not one each
        (before: the 18-32 pieces a liar got in were as many offences, a ban of 24 h after the sixth)."""
        with self.lock:
            until, offences = self.bans.get(peer, (0.0, 0))
            now = self.clock()
            if now < until:
                return until - now
            offences += 1
            length = min(MAX_BAN_S, self.ban_s * (1 << min(offences - 1, 32)))
            self.bans[peer] = (now + length, offences)
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
                 inflight: InFlight | None = None, self_url: str | None = None, ban_s: float = BAN_S,
                 limits: BandwidthLimits | None = None) -> None:
        """`limits`: the node's bandwidth limits, whose peer bucket paces what peers send (none by default).
        `self_url`: this node's own peer address, as the others list it (its rank among them spreads the
        pieces that nodes started together fetch first); unknown: a hash of the host name stands in. `ban_s`:
        how long a peer whose bytes the origin contradicts is first left out (PeerStats.ban)."""
        self.clients = list(clients)
        self.self_url = self_url
        self._static = {c.url for c in self.clients}
        self._make_client = make_client
        self.stats = PeerStats(ban_s=ban_s)
        self.inflight = inflight or InFlight()  # this node's downloads its peer server may serve from
        self.limits = limits or BandwidthLimits()
        self._sources: weakref.WeakSet[PeerSource] = weakref.WeakSet()  # fetches' sources: ended at close

    def wrap(self, origin: Source, digests: dict[str, tuple[Blob, int]]) -> PeerSource:
        """`digests`: object key -> (trusted sha256 or origin identity, size) for the objects peers may serve."""
        with self.stats.lock:
            banned = self.stats._banned_now()
            usable = [c for c in self.clients if c.url not in banned]
            everyone = sorted({c.url for c in self.clients} - {self.self_url})
        me = self.self_url or socket.gethostname()
        rank = (bisect.bisect_left(everyone, me) if self.self_url
                else int.from_bytes(hashlib.sha256(me.encode()).digest()[:4], "big") % (len(everyone) + 1))
        source = PeerSource(origin, usable, digests, self.stats, self.inflight, (rank, len(everyone) + 1),
                            limits=self.limits)
        source.ranked = [*everyone[:rank], "", *everyone[rank:]]  # "": this node
        with self.stats.lock:
            self._sources.add(source)
        return source

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
            clients, sources = list(self.clients), list(self._sources)
        for s in sources:
            s.end()
        for c in clients:
            c.close()


@dataclass
class _Ask:
    """One range's asks of peers (PeerSource.read_pieces): where it stands, and what the peers answered. The
    round's answers (`progressed` to `stop`) start afresh each round (`new_round`)."""

    obj: ObjectInfo
    blob: Blob
    size: int  # the blob's
    offset: int  # where the range starts: its owner is the node of the share that holds this byte
    end: int
    owner: str | None  # the node that reads the range from the origin now ("": this one; None: no spread)
    wait: bool  # the range is another node's share: wait for its bytes from that node rather than the origin
    asked: float  # when the range was first asked of peers (monotonic)
    fetch_deadline: float  # until when ranges of others' shares wait for any peer (the fetch's grace)
    piece: int  # the fetch's piece: how much a peer journals and serves at a time
    pos: int = -1  # the first byte not yet yielded
    outcome: dict[str, str] = field(default_factory=dict)  # peer -> what it last answered (the origin's log line)
    progressed: bool = False  # a peer sent bytes this round
    downloading: bool = False  # a peer downloads the blob (lacks the bytes through no fault of its own)
    pending: bool = False  # the bytes are on their way to a peer that will serve them: wait
    retry_s: float | None = None  # when the peer reading these bytes expects them (its "not yet")
    taken: bool = False  # another node's range that fell to this one (its owner is not there for it)
    stop: bool = False  # ask no other peer this round
    why: str = ""  # why the rounds send it to the origin (logged once its claim stands: PeerSource._from_origin)
    taker: str | None = None  # the node that may have taken it over while its owner was down (PeerSource._taker)
    rechecked: bool = False  # its owner's return was looked for once its claim stood (PeerSource._owner_back)
    on: str | None = None  # the peer whose answer stopped the round: the range waits for its bytes
    downs: int = 0  # PeerSource._downs as the round began: a peer that went down since ends its wait
    name: str = field(init=False)  # how the blob is keyed (blob_key)

    def __post_init__(self) -> None:
        if self.pos < 0:
            self.pos = self.offset
        self.name = blob_key(self.blob)

    @property
    def span(self) -> tuple[str, int]:
        """How the fetch keys the range's clocks: (object key, range end)."""
        return self.obj.key, self.end

    @property
    def deadline(self) -> float:
        """Until when the range waits for a peer downloading the blob, from its first ask."""
        return self.asked + GRACE_S

    def new_round(self) -> None:
        self.progressed = self.downloading = self.pending = self.stop = False
        self.retry_s = self.on = None

    def why_origin(self, holders: int, stalled: float | None) -> str:
        """Why the range goes to the origin after all, for its log line (`stalled`: it waited this long)."""
        why = "its owner is not there for it: this node is next in rank" if self.taken else \
            "own share" if not self.wait else f"owner {self.owner}" if self.owner else "no owner"
        why += f", {holders} holders" + "".join(f", {u} {o}" for u, o in sorted(self.outcome.items()))
        return why + (f", no byte for {stalled:.0f} s" if stalled is not None else "")


class PeerSource(Source):
    """`origin` with peer-first ranged reads for the objects in `digests`; thread-safe like any Source."""

    def __init__(self, origin: Source, peers: typing.List[PeerClient],  # noqa: UP006
                 digests: dict[str, tuple[Blob, int]], stats: PeerStats, inflight: InFlight | None = None,
                 rank: tuple[int, int] = (0, 1), *, limits: BandwidthLimits | None = None) -> None:
        """`rank`: (this node's place, nodes) among its peers and itself: which share of pieces it fetches first."""
        self.origin = origin
        self._limits = limits or BandwidthLimits()
        self._inflight = inflight or InFlight()
        self._rank = rank
        # object key -> [(start, node, n)]: the node that fetches the range from `start` first ("": this one), and
        # the range's place in that node's share (0: its first range)
        self._owners: dict[str, list[tuple[int, str, int]]] = {}
        self._share_ranges: dict[str, int] = {}  # node ("": this one) -> how many ranges its share has
        self.ranked: list[str] = []  # every node's peer URL in rank order, "" for this one (PeerSet.wrap)
        self._grace_until: float | None = None  # until when ranges of others' shares wait for any peer
        self.ref, self.name = origin.ref, origin.name
        self._peers = peers
        # peer URL -> its host, for the hosts only one peer has: a peer's asks of this node's peer server come from
        # its host (InFlight.asked_by), and they say it is up (_is_down)
        hosts = [p.address[0] for p in peers]
        self._hosts = {p.url: host for p, host in zip(peers, hosts, strict=True) if hosts.count(host) == 1}
        self._digests = digests
        self._stats = stats
        self._lock = threading.Lock()
        self._probing = threading.Lock()
        # sha256 -> (when asked, peers that said they hold or are downloading it)
        self._holders: dict[str, tuple[float, typing.List[PeerClient]]] = {}  # noqa: UP006 (`list` is a method)
        self._turn = itertools.count()
        self._origin_only: set[str] = set()  # object keys that failed verification once
        self._dead: set[str] = set()  # peers whose port refused a HEAD, until they answer again (_reprobe)
        self._served: dict[tuple[str, int], tuple[str, bytes]] = {}  # (key, offset) -> (peer, piece digest)
        self._proven: set[str] = set()  # peers whose first piece in this fetch was judged right (_trial)
        self._on_trial: set[str] = set()  # peers whose first piece a range is judging now
        self._unjudged: set[tuple[str, str]] = set()  # (blob, peer): no one vouches, too big for the origin to judge
        self._downloading: set[tuple[str, str]] = set()  # (blob, peer): downloading it when asked (HEAD)
        self._ahead: set[tuple[str, str]] = set()  # (blob, peer): had origin bytes of it at this fetch's first HEAD
        # (blob, peer): its last HEAD said "planning" (a fetch of its lists and plans: InFlight.planning); a peer
        # that lacks a blob is asked again every REASK_S while a range waits, so this is fresh. Kept for a second
        # after the answer, a range whose round outlasted that went to the origin (--faults: 1 MiB, 1.03x)
        self._planning: set[tuple[str, str]] = set()
        # (blob, peer): its last HEAD said it neither holds, downloads nor plans it (an idle daemon, or one whose
        # fetch failed: the --faults cut node's listing timed out while its link was down)
        self._idle: set[tuple[str, str]] = set()
        self._flows: dict[str, PeerFlow] = {}  # bytes from each peer over all streams (client.PeerFlow)
        # this fetch's last byte from anywhere: a silent peer is probed only while it moves; quiet for DOWN_S (no
        # byte, no answer): this node's own link (_not_theirs)
        self._link = Link(DOWN_S)
        self._answers = PeerFlow()  # how long answers from any peer take (a first request's wait: client.Pace)
        # how long HEADs of any peer take to be answered: a HEAD waits as long as answers take (_timeouts) from
        # this fetch's first answered HEAD, not only from its first GET's answer
        self._heads = PeerFlow()
        self._asked: dict[tuple[str, int], float] = {}  # (key, range end) -> when it was first asked of peers
        self._claimers: set[tuple[str, str]] = set()  # (peer, blob): it answered "not yet" (reads it now)
        self._moved: dict[tuple[str, int], float] = {}  # (key, range end) -> when a byte of it last came
        self._benched: dict[str, tuple[float, int]] = {}  # peer cut as slow -> (left out until, times)
        # peer -> when it went down: its ranges go to the next node (_serving_owner) until it is heard from again
        self._down: dict[str, float] = {}
        # peer -> the `_down` time the silence probe confirmed (PeerUnreachable.probed): not waited on (_unconfirmed)
        self._sure: dict[str, float] = {}
        self._reprobing: set[str] = set()  # down peers a thread asks again (_reprobe), not the fetch's rounds
        # peer -> the Paces of this fetch's requests to it in flight (_asks, _from_peer): a verdict that it is down
        # ends those not answered yet (_went_down)
        self._asking: dict[str, set[Pace]] = {}
        self._heard: dict[str, float] = {}  # peer -> when it last answered this fetch or sent it a byte
        self._alone: dict[tuple[str, str], float] = {}  # (blob, peer) -> when a range asked it alone (_reader_alone)
        # (blob, peer) -> (when it last answered about the blob, whether it holds or downloads it): a peer is asked
        # about every blob of the fetch it is not known to hold in one request (_asks), and a round or a reader
        # asked alone within REASK_S of that answer takes it rather than ask again (_said)
        self._answered: dict[tuple[str, str], tuple[float, bool]] = {}
        self._one_by_one: set[str] = set()  # peers that answer no statuses request (a release before it): HEADs
        self._handed: dict[tuple[str, int], str | None] = {}  # (key, range end) -> the node its owner handed it to
        # (key, range end) -> the node it was handed to that started it ("not yet", or a byte): _serving_owner
        self._takers: dict[tuple[str, int], str] = {}
        self._given_up: dict[tuple[str, int], set[str]] = {}  # (key, range end) -> owners it waited PENDING_S on
        self._long: dict[tuple[str, int], str | None] = {}  # (key, range end) -> its reader its long wait was logged on
        self._unstarted: dict[tuple[str, int], int] = {}  # (key, range end) -> its owner's "missing" answers in a row
        self._relayed: dict[tuple[str, int], int] = {}  # (key, range end) -> its first byte that a peer sent
        self._origin_rate: float | None = None  # bytes/s this fetch reads per origin connection (a moving mean)
        self.peer_bytes = 0
        self._ended = threading.Event()  # the fetch is over (end): its threads ask no peer any more
        self._may_defer: Callable[[], bool] = lambda: False  # the fetch engine: other ranges wait for a worker
        self._wake: Callable[[str], None] = lambda url: None  # the fetch engine: ranges deferred on `url` are due
        # peers gone down or confirmed down (_went_down), all told, and its wake: a range waiting for a peer's bytes
        # (its "not yet": up to NOT_YET_MAX_S) rounds again at once, walked on to the next node (docs/peers.md,
        # "Ranges waiting on the cut node")
        self._downs = 0
        self._woken = threading.Condition(self._lock)

    @property
    def nodes(self) -> int:
        """Nodes that may fetch this model together: this one and its peers."""
        return self._rank[1]

    # -- the Source interface: everything but read_pieces goes to the origin ----------------------------------
    def list(self) -> list[ObjectInfo]:
        return self.origin.list()

    def read_into(self, obj: ObjectInfo, offset: int, buf: memoryview) -> None:
        self.origin.read_into(obj, offset, buf)

    def etag_md5(self, obj: ObjectInfo) -> str | None:
        return self.origin.etag_md5(obj)

    def close(self) -> None:
        self.origin.close()

    def end(self) -> None:
        """The fetch is over: the threads asking down or dead peers again (_reprobe) stop at their next wait (a
        peer whose port refused is asked for MAX_PENDING_S: not for that long after the fetch)."""
        self._ended.set()

    def defer_while(self, may_defer: Callable[[], bool], wake: Callable[[str], None] = lambda url: None) -> None:
        self._may_defer, self._wake = may_defer, wake

    def spread(self, ranges: typing.List[T], key: Callable[[T], tuple[str, int, int]]) -> typing.List[T]:  # noqa: UP006
        """The fetch's ranges in this node's order: its own share first, so nodes started together fetch different
        ranges from the origin first, then the shares before it in rank; the node of rank r owns the r-th share
        (`key`: (object key, offset, length)), and this node asks a range's owner first. Shares are cut by
        bytes, not by count: a range goes to the node whose 1/N of the model holds its middle byte. By count, a
        model's small files and the short last range of each shard made some shares 3 ranges (2.6 MiB of a 32 MB
        model at N = 16) and others 1: an owner relays its share to every other node, so its uplink carried
        41 MB where 31 MB was the mean."""
        place, nodes = self._rank
        if nodes <= 1 or not ranges:
            return ranges
        ranked = self.ranked if len(self.ranked) == nodes else [""] * nodes  # unknown peers: every share "mine"
        total = max(1, sum(key(r)[2] for r in ranges))
        owners: dict[str, list[tuple[int, str, int]]] = {}
        ranks, at, counts = [], 0, [0] * nodes
        for r in ranges:
            k, offset, length = key(r)
            rank = min(nodes - 1, (2 * at + length) * nodes // (2 * total))  # the share holding its middle byte
            ranks.append(rank)
            at += length
            owners.setdefault(k, []).append((offset, ranked[rank] if rank != place else "", counts[rank]))
            counts[rank] += 1
        with self._lock:
            self._owners = {k: sorted(v) for k, v in owners.items()}
            self._share_ranges = {ranked[rank] if rank != place else "": n for rank, n in enumerate(counts)}
        # its own share first, then the shares before it in rank, nearest first: the first range of a share whose
        # owner is not there goes to the next node in rank, its second to the node after (_walk), so the ranges
        # this node takes over are asked for second and third, not last (a killed node's share waited 15-55 s for
        # its taker's workers: --faults, all ready 2.58x)
        order = sorted(range(len(ranges)), key=lambda i: (place - ranks[i]) % nodes)
        return [ranges[i] for i in order]

    def _owner(self, key: str, pos: int) -> str | None:
        """The node that fetches byte `pos` of object `key` first ("": this one); None: no spread was made."""
        place = self._place(key, pos)
        return place[0] if place is not None else None

    def _place(self, key: str, pos: int) -> tuple[str, int] | None:
        """(the node that fetches byte `pos` of `key` first, the range's place in its share); None: no spread."""
        with self._lock:
            starts = self._owners.get(key)
            if not starts:
                return None
            i = bisect.bisect_right(starts, (pos, "\uffff")) - 1
            return (starts[i][1], starts[i][2]) if i >= 0 else None

    def _walk(self, key: str, pos: int) -> typing.List[str]:  # noqa: UP006
        """Every node in the order they read the range holding byte `pos` of `key` from the origin while the ones
        before are not there for it (_serving_owner): its owner, then the nodes after it in rank from the (1 + p)-th
        every k-th (p: the range's place in the owner's share of k ranges), then the others in rank order. A down
        owner's ranges go to as many nodes as its share has ranges, and when one of those is down too its range
        goes on to a node none of the share's other ranges goes to first: by owner, the next node in rank took a
        killed node's share and the node cut off's, and relayed them to the fleet alone (--faults: all ready
        2.15-2.82x, against 1.23x without faults)."""
        place = self._place(key, pos)
        nodes = len(self.ranked)
        if place is None or place[0] not in self.ranked:
            return [self.ranked[(step - 1) % nodes] for step in range(nodes)]
        at = self.ranked.index(place[0])
        with self._lock:
            share = max(1, self._share_ranges.get(place[0], 1))
        turn = place[1] % share
        order = sorted(range(nodes - 1), key=lambda j: ((j - turn) % share, j))
        return [place[0], *(self.ranked[(at + 1 + j) % nodes] for j in order)]

    def read_pieces(self, obj: ObjectInfo, offset: int, length: int, buf: memoryview,
                    on_bytes: OnBytes | None = None) -> Pieces:
        """Peers first: those holding the blob, or fetching these bytes now (their server streams them as they
        arrive). A range outside this node's own share that no peer has yet is asked again for up to GRACE_S
        (the node it falls to first is about to fetch it), counted from the fetch's first ask unless a peer is
        downloading the blob, then from this range's; then the origin, with a claim that lets this node's peer
        server stream it to the others. Each round: who reads the range from the origin now (`_hand_over`),
        which holders to ask (`_holders_for`), each one's answer (`_ask_peer`), then wait or go to the origin
        (`_settle`)."""
        end = offset + length
        trusted = self._digests.get(obj.key)
        if trusted is None or obj.key in self._origin_only:
            self._why_origin(obj, offset, end, "no trusted digest" if trusted is None else "failed verification")
            yield from self._from_origin(obj, offset, end, buf, on_bytes, None)
            return
        ask = self._begin(obj, offset, end, trusted[0], trusted[1], len(buf))
        while True:
            ask.new_round()
            ask.downs = self._downs
            self._hand_over(ask)
            holders = self._holders_for(ask)
            if holders is not None:
                for peer in holders:
                    if self._downs != ask.downs:  # a peer went down since the round began (its holders chosen,
                        break  # under the HEAD rounds' lock maybe): the next round walks past it at once
                    yield from self._ask_peer(ask, peer, buf, on_bytes)
                    if ask.stop:
                        ask.on = peer.url
                        break  # the peer reads these bytes now (or is waited out): ask no other one meanwhile
                    if ask.pos >= end:
                        return
                if ask.progressed or self._downs != ask.downs:
                    continue
                step = self._settle(ask, len(holders))
                if step == "again":
                    continue
                if step == "wait":
                    later = self._may_defer()  # another range may be ready now: its bytes are still on their way
                    with self._woken:  # unless a peer went down since the round began: round again at once
                        if self._downs == ask.downs:
                            if later:
                                raise Later(ask.pos, ask.retry_s, ask.on or ask.owner or None)
                            self._woken.wait(POLL_S if ask.retry_s is None else ask.retry_s)
                    continue
            try:
                yield from self._from_origin(obj, ask.pos, end, buf, on_bytes, ask.name, self._relayed_gap(ask), ask)
                return
            except _OwnerBack:  # the owner it was taken over from is back and reads it: the rounds ask it
                ask.wait = True  # another node's range again: waited for, not read from the origin by this node

    def _relayed_gap(self, ask: _Ask) -> int | None:
        """Where a range taken over from its owner is read from the origin again: the first byte a peer sent this
        node of it, when one did (None: from `ask.pos` only). A node relays origin bytes only ("Blame"), so it
        would answer the nodes behind it on the dead owner's relay "not held" for those bytes: each waited
        PENDING_S on it, then read the range, or its own gap, from the origin (--faults: "taken over" 0.45-0.55x
        the model where the killed nodes' shares are 0.31x). Read again once here, under the claim of the rest,
        they follow this node's claim as its pieces land (server `_stream`); not yielded again (_reread)."""
        if not ask.taken:
            return None
        with self._lock:
            first = self._relayed.get(ask.span)
        return first if first is not None and first < ask.pos else None

    def _begin(self, obj: ObjectInfo, offset: int, end: int, blob: Blob, size: int, piece: int) -> _Ask:
        """A range's asks of peers start: its owner, and the clocks its waits are measured by."""
        owner = self._owner(obj.key, offset)
        with self._lock:
            # peers that start later register later: ranges may wait for them until GRACE_S after this fetch's
            # first ask (once per fetch, so peers that never fetch the model cost that once, not per blob)
            if self._grace_until is None:
                self._grace_until = time.monotonic() + GRACE_S
            fetch_deadline = self._grace_until
            # from this range's first ask: a range deferred (Later) and taken again waits no longer
            asked = self._asked.setdefault((obj.key, end), time.monotonic())
            self._moved.setdefault((obj.key, end), time.monotonic())
        return _Ask(obj, blob, size, offset, end, owner, owner not in (None, ""), asked, fetch_deadline, piece)

    def _hand_over(self, ask: _Ask) -> None:
        """The owner, or the next node in rank while the owner is not there for the range, reads it now."""
        serving = self._serving_owner(ask.obj.key, ask.offset, ask.end, ask.name)
        if serving == ask.owner:
            return
        with self._lock:  # logged once per hand-over, not per ask: a deferred range (Later) comes back often
            handed = self._handed.get(ask.span) != serving
            self._handed[ask.span] = serving
            # the next node gets PENDING_S of its own from this ask: counted from the hand-over instead,
            # a --faults run (kills and a 503 origin) gave up on the next nodes too and read 2.37x the
            # model, 1.77x with the clock reset (one run each, scripts/bench_fleet_netns.py)
            self._moved[ask.span] = time.monotonic()
        if handed:
            log.info("%s bytes %d-%d: %s reads them from the origin now (%s is not there for them)",
                     ask.obj.relpath, ask.pos, ask.end - 1, serving or "this node", ask.owner)
        ask.owner = serving

    def _holders_for(self, ask: _Ask) -> typing.List[PeerClient] | None:  # noqa: UP006
        """The peers to ask for the range this round, its owner first; None: read it from the origin now (the
        range fell to this node and no peer holds the whole blob)."""
        if ask.owner == "" and ask.wait:
            holders = self._holders_in_turn(ask.blob, ask.size)
            with self._lock:  # a peer holding the whole blob still serves it: the origin is for nobody's bytes
                whole = [p for p in holders if (ask.name, p.url) not in self._downloading]
            # and the node after this one in rank may have taken it over first (this node was cut off, or saw
            # the owner gone later): asked once, as for this node's own share, before the origin reads it twice
            after = self._next_in_rank(ask.name, ask.obj.key, ask.offset)
            with self._lock:  # (not one given up on for this range: it waited on that one already)
                after_waited = after is None or after in self._given_up.get(ask.span, set())
            if not whole and after_waited:
                ask.taken = True  # its relayed bytes are read again with the rest (_relayed_gap)
                ask.why = "its owner is not there for it: this node is next in rank"
                return None
            ask.wait, ask.taken = False, True  # this node's own range now: asked of those, then the origin
        ask.taker = self._taker(ask)
        holders = self._holders_in_turn(ask.blob, ask.size, first=ask.taker or ask.owner)
        if any(p.url == ask.owner for p in holders) or not ask.wait or \
                (ask.owner and self._about_to_fetch(ask.name, ask.owner)):
            # only a range's owner reads it from the origin, and a node relays origin bytes only: the other
            # nodes still downloading the blob lack it (asking each cost a request, and on a busy link a cut)
            # A node that started before this one may hold them (a late joiner asks it), and so may the next
            # node in rank: it takes this node's share when this node starts after the grace
            after = self._next_in_rank(ask.name, ask.obj.key, ask.offset) if not ask.wait else None
            with self._lock:
                holders = [p for p in holders if p.url in (ask.owner, after, ask.taker)
                           or (ask.name, p.url) not in self._downloading or (ask.name, p.url) in self._ahead]
        return holders

    def _taker(self, ask: _Ask) -> str | None:
        """The node that took the range over while its owner was down, when the owner is its reader again now (it
        answers again) and this node has not heard who started it meanwhile (_started_by): asked first, before the
        owner, which answers "missing" for a range it handed on (_hand_back). Before, a node that had not asked
        the taker before the --faults cut node's link was back went back to the cut node and waited on it, "missing",
        37 s, until it gave up on it. The same when its reader back is not its owner but a node that had taken it
        over from a dead owner before it was cut off itself: nodes waited on the cut node back for the killed
        node's range it had handed on, 30 s. None: no such node, or this one."""
        if not ask.wait or not ask.owner:
            return None
        with self._lock:  # its reader now was down (the owner, or a node that had taken it over from a dead one)
            if ask.owner not in self._down or self._takers.get(ask.span) not in (None, ask.owner):
                return None
        return self._serving_owner(ask.obj.key, ask.offset, ask.end, ask.name, past=ask.owner) or None

    def _ask_peer(self, ask: _Ask, peer: PeerClient, buf: memoryview, on_bytes: OnBytes | None) -> Pieces:
        """Yield what one peer sends of the range from `ask.pos`; its answer (a fault, "not yet", a cut) goes
        to `ask` for the round's verdict."""
        # the owner filling the blob with this node relays the range as its origin pieces land, to
        # every node of the fleet at once: its link's share, not a trickle (_from_peer)
        relay = peer.url == ask.owner and (ask.name, peer.url) in self._downloading
        if peer.url in self._stats.banned:  # since this round's holders were chosen (its trial took seconds)
            ask.outcome[peer.url] = "banned"
            return
        trial = self._trial(ask, peer)
        if trial == "busy":  # its first piece is being judged for another range: wait for the verdict
            ask.outcome[peer.url] = "on trial"
            ask.pending = True
            return
        judge = functools.partial(self._judged, ask, peer) if trial == "mine" else None
        began = time.monotonic()
        try:
            for at, view in self._from_peer(peer, ask.obj.key, ask.blob, ask.pos, ask.end, buf, on_bytes, relay,
                                            judge):
                self._started_by(ask, peer.url)
                yield at, view
                ask.pos, ask.progressed = at + len(view), True
                with self._lock:
                    self._relayed.setdefault(ask.span, at)
                self._moved[ask.span] = time.monotonic()
                self._unstarted.pop(ask.span, None)
        except _JudgeFailed as exc:  # the origin failed us while judging: an origin failure, not the peer's
            raise exc.error from None
        except PeerLied:
            ask.outcome[peer.url] = "lied"  # banned (_judged): the rest of the range from another source
            self._drop_holder(ask.name, peer)
        except PeerBlobGone:
            ask.outcome[peer.url] = "gone"
            ask.downloading = True  # no fault; probed again after REASK_S: it may serve the blob by then
            self._drop_holder(ask.name, peer)
            if peer.url == ask.owner:  # most likely moving its finished download to its blob: wait for the
                ask.pending = ask.stop = True  # probe rather than read the owner's range from the origin
        except PeerRangePending as exc:
            self._not_yet(ask, peer, exc.retry_s)
            self._started_by(ask, peer.url)
        except PeerRangeMissing as exc:
            busy = isinstance(exc, PeerBusy)
            ask.outcome[peer.url] = "busy" if busy else "missing"
            ask.downloading = True  # a peer still downloading the blob lacks these bytes: no fault of its own
            with self._lock:
                flow = self._flows.get(peer.url) if busy else None
            if peer.url == ask.owner:  # it fetches the blob and this range first: it is about to read it
                ask.pending = ask.stop = True  # (a node that started late, or short of CPU, still does): and the
                # others relay nothing of it: ask none of them. Asked again later each time (UNSTARTED_S)
                with self._lock:
                    times = self._unstarted[ask.span] = self._unstarted.get(ask.span, 0) + 1
                ask.retry_s = min(UNSTARTED_MAX_S, UNSTARTED_S * (1 << min(times - 1, 8)))
            elif busy and (ask.name, peer.url) in self._downloading:
                # a peer filling the blob answers 429 only once it found bytes of the range to send (server
                # `_stream`): it holds or reads them now, and serves this node all the streams it allows. Its turn
                # is waited for, asked every BUSY_S, up to the range's wait without a byte (`_settle`), not read
                # from the origin: the --faults cut node, its link back, asked the node after it in rank for the
                # ranges that node had taken over, was told busy and read them again (0.13x the model)
                ask.pending = ask.stop = True
                ask.retry_s = BUSY_S
            else:
                flow = None
            if flow is not None:
                # it serves this node as many streams as it allows: the range waits its turn, PENDING_S from the
                # peer's last byte to this node, not from its own (--faults: the node that took over the cut and
                # the killed nodes' shares, four ranges, answered 429 to the nodes behind on them for 15 s, and
                # they read three of them from the origin; and the cut node, its link back, whose slots there held
                # streams following that node's own slow claims, was told busy for 16-27 s and read the ranges
                # that node had taken over again: 0.08x the model)
                self._moved[ask.span] = max(self._moved[ask.span], flow.last)
        except PeerTooSlow as exc:
            self._cut(ask, peer, exc, began)
        except PeerBadAnswer as exc:  # an offence, not a fault: banned, and the range goes on without it
            ask.outcome[peer.url] = "failed"
            log.warning("%s; not asking it for %.0f s", exc, self._stats.ban(peer.url))
            if ask.wait and peer.url in (ask.owner, ask.taker):
                ask.stop = True
        except PeerDown:  # found down while asked (_went_down drew the verdict): a round walks past it
            ask.outcome[peer.url] = "down"
            if ask.wait and peer.url in (ask.owner, ask.taker):
                ask.stop = True
        except SourceError as exc:
            ask.outcome[peer.url] = "failed"
            if self._not_theirs(began, connect_timed_out(exc), refused(exc)):  # not the peer's: asked again
                log.warning("peer %s failed at byte %d of %s (%s) while nothing came to this node lately (%.0f s) "
                            "since it was asked: this node's link, asked again", peer.url, ask.pos, ask.obj.relpath,
                            exc, DOWN_S)
                ask.pending = ask.stop = True
                return
            self._stats.error(peer.url)
            self._went_down(peer, ask.blob, ask.size, sure=isinstance(exc, PeerUnreachable) and exc.probed,
                            confirm=connect_timed_out(exc))
            log.warning("peer %s failed at byte %d of %s (%s); the rest of the range from another source",
                        peer.url, ask.pos, ask.obj.relpath, exc)
            if ask.wait and peer.url in (ask.owner, ask.taker):
                # the node reading the range went down: the next round walks on to the node after it at once. The
                # rest of this round's holders, chosen before, were asked first: a killed owner's connect, a peer's
                # "not yet" after its long poll, a HEAD under the rounds' lock; the --faults bench's nodes handed
                # the cut node's ranges on 0.3-1.1 s after the silence probe's verdict, where the first went at once
                ask.stop = True
        finally:
            if trial == "mine":
                with self._lock:
                    self._on_trial.discard(peer.url)

    def _started_by(self, ask: _Ask, url: str) -> None:
        """`url`, the node a range was handed to from its owner (or that took it over while its owner was down:
        `ask.taker`), reads it now or sent a byte of it: it keeps it when the owner is back (_serving_owner)."""
        if url in (ask.owner, ask.taker) and ask.wait and url != self._owner(ask.obj.key, ask.offset):
            with self._lock:
                self._takers[ask.span] = url

    def _trial(self, ask: _Ask, peer: PeerClient) -> typing.Literal["none", "mine", "busy"]:
        """Whether the peer's next piece must be judged before it is used ("mine": this range judges it; "busy":
        another range does now, so no second piece of it is taken meanwhile). A peer's first piece in a fetch
        is judged unless the peer is downloading the blob with this node (its HEAD said so: it relays origin
        bytes of its own share, and judging each relay would cost the fleet a piece per pair of nodes) or no
        one could judge its piece of this blob at a fair cost (_judged: "unjudged"); once one piece was right,
        its others are used as they come (the blob's sha256 still decides)."""
        with self._lock:
            if (ask.name, peer.url) in self._downloading or (ask.name, peer.url) in self._unjudged or \
                    peer.url in self._proven:
                return "none"
            if peer.url in self._on_trial:
                return "busy"
            self._on_trial.add(peer.url)
            return "mine"

    def _judged(self, ask: _Ask, peer: PeerClient, at: int, view: memoryview, digest: bytes) -> Verdict:
        """Is the peer's piece [at, at + len(view)) right? By a second holder's digest of the same bytes (one it
        holds verified or read from the origin itself: PeerServer._digests), else by the origin's bytes (one
        piece). Where they disagree the origin decides, and whoever it contradicts is banned. "lied": `view`
        holds the origin's bytes now."""
        span = (at, at + len(view))
        theirs: tuple[PeerClient, bytes] | None = None
        for other in self._vouchers(ask, peer):
            try:
                said = other.piece_digests(ask.blob, [span])[0]
            except PeerBadAnswer as exc:
                length = self._stats.ban(other.url)
                log.warning("%s; not asking it for %.0f s", exc, length)
                continue
            except SourceError as exc:  # unreachable: asked no more by this judge
                log.info("asking %s for a piece digest: %s", other.url, exc)
                continue
            if said is not None:
                theirs = (other, said)
                break
        if theirs is not None and theirs[1] == digest:
            self._prove(peer.url)
            return "vouched"
        if theirs is None and len(view) > JUDGE_BYTES and len(view) * JUDGE_SHARE > ask.size:
            with self._lock:  # this blob's pieces from it are used as they come: its sha256 decides
                self._unjudged.add((ask.name, peer.url))
            return "unjudged"
        origin = bytearray(len(view))
        why = f"judging {peer.url}'s first piece" + (f" ({theirs[0].url} disagrees)" if theirs else
                                                      " (no other holder vouches for it)")
        self._why_origin(ask.obj, at, span[1], why)
        try:
            self.origin.read_into(ask.obj, at, memoryview(origin))
        except SourceError as exc:
            raise _JudgeFailed(exc) from exc
        truth = hashlib.sha256(origin).digest()
        if theirs is not None and theirs[1] != truth:
            length = self._stats.ban(theirs[0].url)
            log.warning("peer %s vouched for a digest of bytes %d-%d of %s that the origin contradicts; not "
                        "asking it for %.0f s", theirs[0].url, at, span[1] - 1, ask.obj.key, length)
        if truth == digest:
            self._prove(peer.url)
            return "origin"
        length = self._stats.ban(peer.url)
        log.warning("peer %s sent bytes at offset %d of %s that the origin contradicts; not asking it for "
                    "%.0f s (judged before use: its bytes were not used)", peer.url, at, ask.obj.key, length)
        view[:] = origin
        return "lied"

    def _prove(self, url: str) -> None:
        with self._lock:
            self._proven.add(url)

    def _vouchers(self, ask: _Ask, peer: PeerClient) -> typing.List[PeerClient]:  # noqa: UP006
        """Up to VOUCHERS other peers that may hold the blob's bytes on their own evidence: the range's owner
        (it reads the range from the origin) first, then peers that said they hold the whole blob."""
        banned = self._stats.banned
        with self._lock:
            known = [p for p in self._holders.get(ask.name, (0.0, []))[1]
                     if p is not peer and p.url not in banned and p.url not in self._dead]
            whole = [p for p in known if (ask.name, p.url) not in self._downloading]
        owner = [p for p in known if p.url == ask.owner]
        return (owner + [p for p in whole if p.url != ask.owner])[:VOUCHERS]

    def _not_yet(self, ask: _Ask, peer: PeerClient, retry_s: float | None) -> None:
        """The peer reads these bytes from the origin now: wait for them, and ask no other peer meanwhile (each
        would be one more request per poll)."""
        ask.outcome[peer.url] = "not yet"
        self._unstarted.pop(ask.span, None)
        if retry_s is not None:
            ask.retry_s = min(NOT_YET_MAX_S, max(NOT_YET_MIN_S, retry_s + NOT_YET_SLACK_S))
        with self._lock:
            self._claimers.add((peer.url, ask.name))
        ask.pending = ask.downloading = ask.stop = True

    def _cut(self, ask: _Ask, peer: PeerClient, exc: PeerTooSlow, began: float) -> None:
        """The watchdog cut the peer's stream below its rate floor."""
        ask.outcome[peer.url] = "cut"
        self._stats.error(peer.url)
        if peer.url == ask.owner and (ask.name, peer.url) in self._downloading:
            # the owner filling the blob with this node is the one node reading this range from the
            # origin: a stall of its (a busy CPU, a full link) is waited out, not paid at the origin;
            # heard from on no stream for DOWN_S, it is down and the next node in rank takes its ranges
            silent = time.monotonic() - self._heard.get(peer.url, ask.asked) >= DOWN_S
            silent = silent and not self._not_theirs(began)
            if silent:
                self._went_down(peer, ask.blob, ask.size)
            log.warning("%s at byte %d of %s; %s", exc, ask.pos, ask.obj.relpath,
                        "down: the next node in rank takes its ranges" if silent else "asked again")
            ask.pending = ask.stop = True
            return
        bench_s = self._bench(peer.url)
        log.warning("%s at byte %d of %s; this fetch leaves it out for %.0f s", exc, ask.pos, ask.obj.relpath,
                    bench_s)

    def _settle(self, ask: _Ask, holders: int) -> typing.Literal["again", "wait", "origin"]:
        """After a round without a byte: ask again at once (the range's owner was given up on), wait for the
        bytes on their way, or read the range from the origin."""
        now = time.monotonic()
        if ask.wait and ask.owner and self._serving_owner(ask.obj.key, ask.offset, ask.end, ask.name) != ask.owner:
            # found not there for it this round (it failed, or its HEAD found it dead): the next node in rank
            # now, not the origin (the round's owner was chosen before: with a third of a fleet killed, nodes
            # read dead owners' ranges from the origin as well as the node that took them over)
            return "again"
        # a peer that served this fetch well and was cut only now is congested, not hostile: wait out its
        # bench rather than read the range from the origin again; and no wait lasts past PENDING_S (or the
        # time of PENDING_PIECES pieces from the origin) without a byte of this range (a peer answering "not
        # yet" for ever costs that, once)
        # An owner still listing and planning (its last HEAD) is waited for up to MAX_PENDING_S: with the origin
        # answering 503 for 10 s nodes came out of their listing's backoff up to 16 s apart (load 50), and the
        # first through took the last one's share after PENDING_S and read it from the origin too (--faults, 1.17x)
        # from this range's first ask; the wait for a byte of it starts again once the owner's plan is done
        if planning := ask.wait and bool(ask.owner) and self._about_to_fetch(ask.name, ask.owner or ""):
            self._moved[ask.span] = now
        # Neither wait counts time this node's own link was quiet (nothing from anyone for DOWN_S: cut off): no
        # byte could come then, and a wait counts again from the link's return (`Link.back`). Counted through
        # the --faults cut, a range of a live owner relaying it was given up on 9 s into this node's cut (its
        # last byte 15 s before), handed to nodes that never read it, and the cut node, its link back, waited on
        # them until another node published the blob: the last node ready, 1.5 s after the others
        back, quiet = self._link.back, self._link.quiet()
        stalled = not quiet and (now - max(ask.asked, back) >= MAX_PENDING_S if planning else
                                 now - max(self._moved[ask.span], back) >= self._pending_s(ask.piece))
        waited = now - max(self._moved[ask.span], back)
        said = ", ".join(f"{u} {o}" for u, o in sorted(ask.outcome.items())) or "nothing"
        if ask.wait and ask.owner and stalled:  # the next node in rank takes it (the others give up on it too)
            with self._lock:
                self._given_up.setdefault(ask.span, set()).add(ask.owner)
            log.info("%s bytes %d-%d: no byte for %.0f s from %s (last said: %s): the next node in rank takes them",
                     ask.obj.relpath, ask.pos, ask.end - 1, waited, ask.owner, said)
            return "again"
        if waited >= LONG_WAIT_S and not quiet:
            with self._lock:  # once a range and reader: what a wait that went on long waits on (a range's wait
                long = self._long.get(ask.span) != ask.owner  # logged nothing: docs/peers.md, "Session 55")
                self._long[ask.span] = ask.owner
            if long:
                log.info("%s bytes %d-%d: no byte for %.0f s, waiting on %s (last said: %s)", ask.obj.relpath,
                         ask.pos, ask.end - 1, waited, ask.owner or "this node", said)
        pending = ask.pending
        if ask.wait and ask.owner and (now < ask.fetch_deadline or self._fetching(ask.name, ask.owner)
                                       or self._about_to_fetch(ask.name, ask.owner)):
            # the owner (or the node after it) is fetching the blob, or listing and planning a fetch: its
            # bytes will come (an owner that started its share seconds late lost it to every other node, whose
            # grace was over: 1.31-1.33x the model at N = 16, and 1.75x with an origin answering 503 for 10 s)
            pending = True
        if ask.wait and ask.owner and self._down_lately(ask.owner):  # confirmed down or up within DOWN_S
            pending = True
        if ask.wait and ask.owner and self._unasked(ask.name, ask.owner):
            pending = True
        pending = (pending or self._benched_holder(ask.name, ask.owner)) and not stalled
        if pending or (ask.wait and (now < ask.fetch_deadline or (ask.downloading and now < ask.deadline))):
            return "wait"
        ask.why = ask.why_origin(holders, now - self._moved[ask.span] if stalled else None)
        return "origin"

    def _pending_s(self, piece: int) -> float:
        """How long a range waits on peers without a byte of it: PENDING_S, or PENDING_PIECES pieces at this
        fetch's own rate per origin connection (the owner reads the range at about that rate), at most
        MAX_PENDING_S."""
        with self._lock:
            rate = self._origin_rate
        if not rate:
            return PENDING_S
        return min(MAX_PENDING_S, max(PENDING_S, PENDING_PIECES * piece / rate))

    @staticmethod
    def _why_origin(obj: ObjectInfo, pos: int, end: int, why: str) -> None:
        log.info("origin read: %s bytes %d-%d (%d): %s", obj.relpath, pos, end - 1, end - pos, why)

    def _hear(self, url: str) -> None:
        """`url` answered or sent a byte now (self._lock held)."""
        self._heard[url] = time.monotonic()
        self._link.heard()

    def _timeouts(self, url: str) -> tuple[float | None, float | None]:
        """A request to `url`: its connect timeout and a HEAD's read timeout (None: as configured). Once this
        fetch has timed answers (the peer's, or any peer's, HEADs' too: client.answer_wait), a HEAD waits for its
        answer as long as a GET waits for its headers (SLOW_GRACE_S, or ANSWER_SLACK times what answers took): on a
        pooled connection (no connect) a HEAD to the --faults node cut off waited the read timeout, 10 s, while every
        round of the fetch waited on it (`_probing`), and the cut node's ranges were handed on at 8.7-10 s. A
        peer heard from is connected to within KNOWN_CONNECT_S, or that wait where answers take longer (the
        silence probe's rule): on full links a burst of SYNs is dropped and the kernel sends them again 1 s and
        3 s later, so a 1 s connect took a live peer behind such a link for down. HEADs count from the first
        answered: a node still listing when its link was cut off (its HEAD said "planning"), asked by nodes that
        had no GET answered yet, held every round's HEADs the read timeout, long enough for the failure to be taken
        for the asker's own link (nothing came for DOWN_S), and its share waited on it."""
        with self._lock:
            wait = answer_wait(self._flows.get(url), self._answers, self._heads)
            heard = url in self._heard
        return max(KNOWN_CONNECT_S, wait) if heard else None, max(SLOW_GRACE_S, wait) if wait > 0 else None

    def _not_theirs(self, began: float, connecting: bool = False, refusal: bool = False) -> bool:
        """A request begun at `began` that failed now failed on this node's link, not the peer's: its connect timed
        out (`connecting`: after KNOWN_CONNECT_S, under DOWN_S) and no byte came from anywhere within SILENT_S / 2
        (the silence probe's rule; the --faults node cut off took 14 live peers for down 1 s into its cut); nothing
        came from anywhere (no peer's answer, no byte, the origin's included) for DOWN_S (`Link.quiet`: the --faults
        node cut off, its streams' read timeouts ended together 10 s into the cut, took every live owner it waited
        on for down, walked past them all to itself and read 0.3x the model from the origin once its link was back);
        or nothing had between `began` and a moment since (`Link.back`: the cut node, its streams' read timeouts
        ended 0.5-2 s after its link was back; it took the peers for down and read 0.1x the model from the origin).
        Peers alone were not enough: a node reading its own share from the origin while its asks all waited on
        connects to the node cut off took that node's failures for its own link, kept asking it, and took over a
        killed node's share 17 s late, once the node after it in rank had given up on it and read it too (--faults).
        And a failure within DOWN_S after this node's link came back from a cut (`Link.cut_back`): connects and
        probes begun then meet queues full of what every node resends, and a silence probe failing a second after
        the --faults cut node's link was back took the node after it in rank for down, so the node read the ranges
        that node had taken over again. A failure taken for this node's link marks it cut off (`Link.blame`). None
        of this for a refusal (`refusal`): the peer's host answered, so this node's link carried the answer and the
        peer is down. Taken for the link after DOWN_S of quiet, a killed owner was asked again, never found down,
        until its range's wait ran out (PENDING_S, 15 s, where it is read at once now), and this node was taken for
        cut off. Nor is a refusal a sign of life for the link (`Link.heard`): that would move `Link.back`, excusing
        every request in flight, and a local port (a test's) refuses across no link at all."""
        if refusal:
            return False
        now = time.monotonic()
        late = connecting and now - self._link.last >= SILENT_S / 2
        if late or self._link.quiet():
            self._link.blame()
            return True
        return began < self._link.back or now - self._link.cut_back < DOWN_S

    def _bench(self, url: str) -> float:
        """Leave a peer cut as too slow out of this fetch for a while: BENCH_S, doubled each time (a peer that is
        slow because many ask it at once is asked again once they are served; a trickler costs a second each
        time, less and less often)."""
        now = time.monotonic()
        with self._lock:
            until, times = self._benched.get(url, (0.0, 0))
            if until > now:  # its other ranges cut at the same time: one offence
                return until - now
            length = min(MAX_BENCH_S, BENCH_S * (1 << min(times, 16)))
            self._benched[url] = (now + length, times + 1)
        return length

    def _serving_owner(self, key: str, pos: int, end: int, sha256: str, past: str | None = None) -> str | None:
        """The node that reads byte `pos` of `key` from the origin ("": this one; None: no spread): the range's
        owner, or the next node in rank while it is not there for it: dead, down (failed, or cut and silent for
        DOWN_S), benched (cut as slow while not filling the blob with this node: a trickler claiming to hold it
        costs its second, then its ranges go on), given up on for this range (no byte of it for PENDING_S), or
        idle once the fetch's grace is over (its last HEAD: it neither holds, downloads nor plans the blob; a node
        still listing says "planning" and is waited for). Before the planning answer an idle owner was not walked
        past (views of who fetches differed between nodes started apart, and every node took itself for the next
        one), and every node read its share from the origin past the grace. Every node
        walks the same ranks from what it saw itself, so one node takes over such a range and the others wait
        for it, rather than all of them reading it from the origin (a third of a fleet killed cost it 2.7
        models, nodes starting seconds apart on a busy machine 3-4)."""
        owner = self._owner(key, pos)
        if not owner or len(self.ranked) < 2:
            return owner
        now = time.monotonic()
        walk = self._walk(key, pos)
        banned = self._stats.banned  # a liar's share is read from the origin by the next node in rank
        with self._lock:
            given_up = self._given_up.get((key, end), set())
            idle = self._grace_until is not None and now >= self._grace_until
            lately: str | None = None  # the first owner walked past that went down under DOWN_S ago

            def passed(url: str) -> bool:
                return url in self._dead or url in banned or self._is_down(url) or url in given_up or \
                    (self._benched.get(url, (0.0, 0))[0] > now and (sha256, url) not in self._downloading) or \
                    (idle and (sha256, url) in self._idle)

            for url in walk:
                if url == "":
                    # this node would read it from the origin: not on a peer down for under DOWN_S that has not
                    # been found dead (a live node may miss a probe: a --faults run took one for cut at its full
                    # link, and the node after it in rank read its range from the origin again at once)
                    return lately or url
                if url == past:  # who took it over while that node was down (_taker)
                    continue
                if lately is None and self._unconfirmed(url, now):
                    lately = url
                if passed(url):
                    continue
                # an owner back (up again after it was down) leaves the range with the node that took it over
                # and started it meanwhile (it reads it on): the --faults cut node, its link back, hands its
                # claims on to that node (_hand_back) and cannot relay that node's bytes (a node relays origin
                # bytes only), and the others, back on it, waited "missing" until it published (44 s; all ready
                # 2.67x). Before the hand-back both read the range, so following the taker loses nothing
                # (and so does a node that had taken the range over from a dead owner, then went down and is back)
                taker = self._takers.get((key, end))
                return taker if taker is not None and taker != url and (url == owner or url in self._down) and \
                    not passed(taker) else url
        return ""

    def _down_lately(self, url: str) -> bool:
        """`url` is down, under DOWN_S, and not found dead: this node waits on it rather than read its range."""
        with self._lock:
            return self._unconfirmed(url, time.monotonic())

    def _unconfirmed(self, url: str, now: float) -> bool:
        """`url` is down, under DOWN_S, not found dead, and not found unreachable by the silence probe (self._lock
        held). The probe waits as long as answers take: its verdict is confirmation enough, and waiting DOWN_S more
        on it held the --faults cut node's ranges at the node next in rank 3-4.4 s after the cut (the other nodes
        handed them on within 1-2 s)."""
        return url not in self._dead and self._is_down(url) and now - self._down[url] < DOWN_S and \
            self._sure.get(url) != self._down[url]

    def _is_down(self, url: str) -> bool:
        """`url` failed, or was cut silent, and has not answered, sent a byte, nor asked this node's peer server
        since (self._lock held). Its asks count: the --faults node cut off, its link back, asked the node after it
        in rank for its share, was told "missing" and read on, while that node, which had not heard from it yet,
        took the share over and read it too (0.16x the model, handback38's run 2)."""
        since = self._down.get(url)
        if since is None or self._heard.get(url, -1.0) > since:
            return False
        host = self._hosts.get(url)
        asked = self._inflight.asked_at(host) if host is not None else None
        return asked is None or asked <= since

    def _owner_back(self, ask: _Ask) -> bool:
        """A range of another node's share that fell to this node is not this node's to read any more: its owner
        is back (it asked this node's peer server since it went down: _is_down), or another node is next for it
        now. Asked once its claim stands and before its first origin byte: an owner that asked before then was
        told "missing" and reads it itself, one that asks after is told "not yet" and follows this node. Once a
        range: the rounds that follow decide as before (asked every time, a range whose rounds chose the origin
        while another node was its reader went round at once, again and again)."""
        if not ask.taken or ask.rechecked:
            return False
        ask.rechecked = True
        return self._serving_owner(ask.obj.key, ask.offset, ask.end, ask.name) != ""

    def _went_down(self, peer: PeerClient, blob: Blob, size: int, sure: bool = False, confirm: bool = False) -> None:
        """The peer failed, or went silent on every stream and was cut: its ranges go to the next node in rank
        until it answers again, and a thread asks it (a HEAD) meanwhile (_reprobe). Down for DOWN_S only, a
        peer cut off or killed had its ranges handed back to it when that ran out: it failed again (a connect
        timeout), or, dropped from the blob's holders, was no longer waited on and the range went to the
        origin (--faults: the cut node's share and the killed node's it had taken over, read by 2-4 nodes)."""
        self._drop_holder(blob_key(blob), peer)
        with self._lock:
            news = not self._is_down(peer.url) or (sure and self._sure.get(peer.url) != self._down[peer.url])
            if not self._is_down(peer.url):  # down since its first failure: its thread's failures confirm it
                self._down[peer.url] = time.monotonic()
            if sure:  # the silence probe's verdict: not waited on (_unconfirmed)
                self._sure[peer.url] = self._down[peer.url]
            if news:  # ranges waiting for its bytes round again now: not at their wait's end (up to NOT_YET_MAX_S)
                self._downs += 1
                self._woken.notify_all()
                if (flow := self._flows.get(peer.url)) is not None:
                    # and its streams still waiting on it are probed at the watchdog's next look, not at their
                    # backoff's end (PROBE_AGAIN_S; up to 2 s when it doubled with the silence, and the --faults cut
                    # node's ranges streaming from it went on at 2.9 s where its HEAD had timed out at 1.3 s)
                    flow.probe_after = 0.0
            reprobing = peer.url in self._reprobing
            self._reprobing.add(peer.url)
            asking = [p for p in self._asking.get(peer.url, ()) if not p.answered_yet] if news else []
        for pace in asking:
            # and its requests not answered yet end now (HEADs, connects), not at their timeout (up to 3x what answers
            # take, KNOWN_CONNECT_S at least): a round's HEAD of the --faults cut node held the prober lock, and every
            # round and lone HEAD of the fetch behind it, past its verdict; what asked goes on without it. A body
            # flowing is no such wait: its silence is probed at the watchdog's next look (above)
            pace.cut(down=True)
        if news:
            self._wake(peer.url)
        if news and not sure and confirm:  # a HEAD's or a connect's timeout: no stream the watchdog looks at
            WATCHDOG.probers.run(self._confirm, peer, blob, size)
        if reprobing:
            return
        threading.Thread(target=self._reprobe, args=(peer, blob, size), name="peer-reprobe", daemon=True).start()

    def _confirm(self, peer: PeerClient, blob: Blob, size: int) -> None:
        """A peer gone down by a HEAD's or a connect's timeout (`confirm`, _went_down) is probed at once, as the
        watchdog probes a silent one: no connect answered within as long as answers take, and nothing
        acknowledged, while bytes still come from elsewhere, confirms it down (`_sure`: the node next in rank reads
        its ranges at once, _unconfirmed). Before, a peer whose only request of this node's was the one that failed
        (a HEAD, a connect: no stream for the silence probe to look at) was waited on DOWN_S after its failure, and
        the requests that would have shown it silent ended at its verdict (`asking`, above)."""
        with self._lock:
            since, flow = self._down.get(peer.url), self._flows.get(peer.url)
            host = self._hosts.get(peer.url)
        conns = functools.partial(self._inflight.connections, host) if host is not None else None
        if since is None or not answers_no_connect(peer.address, probe_wait(flow, self._answers), conns):
            return
        if self._link.last < time.monotonic() - SILENT_S / 2:  # nothing came from anywhere: this node's link
            return
        with self._lock:
            still = self._is_down(peer.url) and self._down.get(peer.url) == since
        if still:
            log.info("peer %s answered no connect within %.2f s after it failed: down", peer.url,
                     probe_wait(flow, self._answers))
            self._went_down(peer, blob, size, sure=True)

    def _reprobe(self, peer: PeerClient, blob: Blob, size: int) -> None:
        """Ask a down or dead peer for the blob (HEAD) every REASK_S (a dead one: doubled per refusal up to
        DEAD_REASK_MAX_S) until it answers or asks this node (it is up
        again, and a holder if it says so), or MAX_PENDING_S passed (it stays down, or dead). A refusal does not
        end it: a peer whose port refuses once is dead until it answers, not for the rest of the fetch (a daemon
        restarting on its node; a node whose link came back as its daemon's port was being opened again). Not in
        the fetch's rounds (_holders_in_turn): their probes run one at a time under one lock, and a HEAD to a node
        cut off held every range of the fetch until its timeout (10 s), long enough for no peer to have been
        heard from, so the failure was taken for this node's link and the peer was never found dead."""
        sha256, deadline = blob_key(blob), time.monotonic() + MAX_PENDING_S
        pause = REASK_S
        try:
            while time.monotonic() < deadline and not self._ended.is_set():
                holds = self._asks(peer, blob, size)
                with self._lock:
                    if not self._is_down(peer.url):
                        self._dead.discard(peer.url)
                        asked, known = self._holders.get(sha256, (time.monotonic(), []))
                        if holds and peer not in known:
                            self._holders[sha256] = (asked, [*known, peer])
                        return
                    dead = peer.url in self._dead
                self._ended.wait(pause)
                # refused (dead): asked less often the longer it stays so; down (a timeout: a cut link coming back)
                # is asked every REASK_S, each ask as long as its timeout anyway
                pause = min(pause * 2, DEAD_REASK_MAX_S) if dead else REASK_S
        finally:
            with self._lock:
                self._reprobing.discard(peer.url)

    def _next_in_rank(self, sha256: str, key: str, pos: int) -> str | None:
        """The first node after this one in the walk of the range holding byte `pos` of `key` (_walk) that fetches
        the blob: it takes the range when this node is late, or not there for it (_serving_owner)."""
        if "" not in self.ranked:
            return None
        walk = self._walk(key, pos)
        at = walk.index("")
        with self._lock:
            fetching = {p.url for p in self._holders.get(sha256, (0.0, []))[1]}
        return next((u for u in walk[at + 1:] + walk[:at] if u in fetching), None)

    def _fetching(self, sha256: str, url: str) -> bool:
        """`url` said it holds or downloads the blob (benched or not)."""
        with self._lock:
            return any(p.url == url for p in self._holders.get(sha256, (0.0, []))[1])

    def _unasked(self, sha256: str, url: str) -> bool:
        """`url` gave no answer about the blob that stands: a round skipped it while it was down (its own thread
        asks it then, of another blob maybe), and it is up again. Its range waits for the next round's HEAD (one
        REASK_S away), not the origin: the --faults cut node, its link back, answered another blob's HEAD, and two
        nodes read its share (3 MiB) from the origin while it read it itself."""
        with self._lock:
            known = any(p.url == url for p in self._holders.get(sha256, (0.0, []))[1])
            return not known and (sha256, url) not in self._idle and (sha256, url) not in self._planning

    def _about_to_fetch(self, sha256: str, url: str) -> bool:
        """`url` said in its last HEAD that a fetch of its lists and plans (it may be about to fetch the blob)."""
        with self._lock:
            return (sha256, url) in self._planning

    def _benched_holder(self, sha256: str, owner: str | None) -> bool:
        """A holder of the blob is benched now that is worth waiting for: it sent this fetch PROVEN_BYTES or more,
        or said it reads some of the blob from the origin now, or it owns the range and sent this fetch 64 KiB or
        is downloading the blob itself (so reads the range from the origin; a trickler claiming to hold the blob
        does none of these, and one claiming to download it costs PENDING_S at most). It was slow because many
        asked it at once, or its link is busy, and it will serve the range once its bench ends."""
        now = time.monotonic()
        with self._lock:
            known = self._holders.get(sha256, (0.0, []))[1]
            for p in known:
                if self._benched.get(p.url, (0.0, 0))[0] <= now:
                    continue
                sent = self._flows[p.url].total if p.url in self._flows else 0
                if (p.url, sha256) in self._claimers or sent >= PROVEN_BYTES or \
                        (p.url == owner and (sent >= 64 << 10 or (sha256, p.url) in self._downloading)):
                    return True
            return False

    def _floor(self) -> int:
        """The rate floor of a range from a peer: FLOOR_SHARE of what this fetch reads per origin connection,
        within [SLOW_MIN_BYTES_S, SLOW_BYTES_S]; SLOW_BYTES_S before it has read from the origin."""
        with self._lock:
            rate = self._origin_rate
        if rate is None:
            return SLOW_BYTES_S
        return int(min(SLOW_BYTES_S, max(SLOW_MIN_BYTES_S, rate * FLOOR_SHARE)))

    def _from_origin(self, obj: ObjectInfo, pos: int, end: int, buf: memoryview, on_bytes: OnBytes | None,
                     sha256: str | None, again: int | None = None, ask: _Ask | None = None) -> Pieces:
        """[pos, end) from the origin, claimed while it is read so that peers follow it; `again`: [again, pos)
        first, bytes this range already yielded from a peer that is not there for it any more (_relayed_gap),
        under the same claim and not yielded again (_reread). `ask`: the rounds that sent the range here (its
        `why` is logged once the claim stands); _OwnerBack, before any byte, when it is another node's range
        taken over and its owner asked this node since it went down (_owner_back)."""
        part = self._inflight.origin_part(sha256) if sha256 and again is not None else None
        if again is not None and part is None:  # no download of this node's serves them: not read again
            again = None
        first = pos if again is None else again
        claim = self._inflight.claim(sha256, first, end) if sha256 else None
        if ask is not None and self._owner_back(ask):
            if claim is not None:
                self._inflight.release(claim)
            raise _OwnerBack
        if ask is not None:
            self._why_origin(obj, pos, end, ask.why)
        if again is not None:
            self._why_origin(obj, again, pos, "read again, relayed by its owner that is not there for it: the "
                                              "nodes behind on its relay follow this node")

        def arrived(n: int) -> None:
            self._link.touch()
            if claim is not None:
                claim.touch(n)  # the claim moves: peers asking for it are told "not yet", not "go elsewhere"

        def told(n: int) -> None:
            arrived(n)
            if on_bytes is not None:
                on_bytes(n)

        started, got, cut_back = time.monotonic(), 0, self._link.cut_back
        piece = self._relay_piece(len(buf), end - first) if claim is not None else len(buf)
        try:
            if sha256 and part is not None and again is not None:
                self._reread(obj, sha256, part, again, pos, buf[:piece], arrived)
            with closing(self.origin.read_pieces(obj, pos, end - pos, buf[:piece], told)) as pieces:
                for at, view in pieces:
                    got += len(view)
                    self._origin_rate_seen(got, time.monotonic() - started)
                    self._blame(obj.key, at, view)
                    if sha256:  # this node's peer server may relay these bytes while the download goes on
                        self._inflight.from_origin(sha256, at, at + len(view))
                    if claim is not None:
                        claim.piece = max(claim.piece, len(view))
                    yield at, view
                    if sha256:  # journalled now (the caller wrote it): streams following the claim send it
                        self._inflight.landed(sha256)
                    if claim is not None and self._link.cut_back != cut_back and \
                            self._hand_back(obj, sha256, at + len(view), end):
                        # the caller wrote every byte before this one: it takes the range again from here
                        raise Later(at + len(view), 0.0)
        finally:
            if claim is not None:
                self._inflight.release(claim)

    def _hand_back(self, obj: ObjectInfo, sha256: str | None, pos: int, end: int) -> bool:
        """A claimed origin read whose node was cut off (its link back now, `Link.cut_back` moved since the read
        began) stops at `pos` and goes back to the rounds (the caller's `Later`), where the node after this one in
        rank is asked first: it took the claim's range over while this node was cut off (its relay stopped), and
        the origin's connections outlive a 10 s cut, so both read it (--faults: the cut node and the next, 3-4 MiB,
        0.09-0.13x the model a run). Nobody holds it: the rounds read it on from the origin under a new claim.
        Not without a node after this one fetching the blob, nor at the range's end."""
        if not sha256 or pos >= end or self._next_in_rank(sha256, obj.key, pos) is None:
            return False
        with self._lock:  # the next node's wait for a byte starts now, not at the range's first ask
            self._moved[(obj.key, end)] = time.monotonic()
            # the bytes a dead owner relayed were read again under this claim (_relayed_gap): not a third time
            self._relayed.pop((obj.key, end), None)
        log.info("%s bytes %d-%d: this node's link was cut off and is back; the node after it in rank may have "
                 "taken them over: asked before the origin reads on", obj.relpath, pos, end - 1)
        return True

    def _reread(self, obj: ObjectInfo, sha256: str, part: PartialFile, start: int, end: int, buf: memoryview,
                arrived: OnBytes) -> None:
        """Read [start, end) of `obj` from the origin again, bytes a peer sent that this node's download holds
        already, and make each piece the part holds the same of servable as origin bytes (InFlight.from_origin):
        a node relays origin bytes only. Not yielded (each byte of a range is yielded once: before, they were
        yielded again, and a range yielded more bytes than it had), and not told to the caller's on_bytes (its
        progress). A piece that differs is not served; the blob's own sha256 decides (a peer's piece is no
        offence until then: _blame)."""
        differ = 0
        with closing(self.origin.read_pieces(obj, start, end - start, buf, arrived)) as pieces:
            for at, view in pieces:
                if part.holds_same(at, view):
                    self._inflight.from_origin(sha256, at, at + len(view))
                    self._inflight.landed(sha256)
                else:
                    differ += len(view)
        if differ:
            log.warning("%s: %d of the bytes %d-%d a peer relayed are not the origin's (or not written yet): not "
                        "served by this node; the blob's sha256 decides", obj.relpath, differ, start, end - 1)

    def _relay_piece(self, size: int, length: int) -> int:
        """The piece (at most `size`) a claimed range of `length` bytes is read from the origin in. In a fleet each
        origin piece is journalled, then relayed to every other node as it lands (server `_stream`), so it is a
        1/RELAY_PIECES of the range (at least RELAY_PIECE_MIN): at N = 16 behind a 1 MB/s origin a 256 KiB piece
        took 8 s to land, the owner's uplink idled meanwhile, and the last pieces of every range landed together
        and were relayed after the origin's last byte, 15 times each. Relative to the range, not to the origin's
        rate: a range's CPU stays RELAY_PIECES journal lines and wakes however fast the origin (re-asking the
        range once the rate was known wasted what the origin had sent ahead: 1.87x the model at N = 4)."""
        if self.nodes <= 1:
            return size
        return min(size, max(RELAY_PIECE_MIN, length // RELAY_PIECES >> 12 << 12))

    def _origin_rate_seen(self, got: int, took: float) -> None:
        if took < 0.1:  # the first piece's rate is mostly the request's latency, or a burst
            return
        rate = got / took
        with self._lock:
            self._origin_rate = rate if self._origin_rate is None else 0.8 * self._origin_rate + 0.2 * rate

    # -- peers ------------------------------------------------------------------------------------------------
    def _holders_in_turn(self, blob: Blob, size: int, first: str | None = None) -> typing.List[PeerClient]:  # noqa: UP006
        """Peers holding or downloading the blob, rotated per range so concurrent ranges spread out, the peer
        `first` (a range's owner) first. Asked once per fetch when every peer has it; peers that did not are
        asked again after REASK_S (they may have started downloading it since). Not while `first` downloads the
        blob or plans to: it is asked alone (_reader_alone)."""
        sha256 = blob_key(blob)
        with self._lock:
            asked, known = self._holders.get(sha256, (NO_ROUND, []))
        if time.monotonic() - asked >= REASK_S and len(known) < len(self._live_peers()) and \
                not self._reader_alone(blob, size, first):
            with self._probing:  # one prober at a time: a dead peer is found once, then skipped by the others
                with self._lock:
                    asked, known = self._holders.get(sha256, (NO_ROUND, []))
                if time.monotonic() - asked >= REASK_S:
                    # a holder known (a reader asked alone, too) is not asked again, nor a peer down (asked by its own
                    # thread, _reprobe, or no more), by the time its turn comes: one found down while the round
                    # asked the others was asked after its verdict, and the round waited on its HEAD's timeout
                    live = self._live_peers()
                    ask = [p for p in live if p not in known]
                    # one peer after another: 4 at once made the N = 16 fill slower (1.30x and 1.31x against 1.19x,
                    # main 1.21-1.23x; docs/peers.md, "Session 54"): with the CPU short the answers come no sooner
                    holds = {p: not self._skipped(p.url) and self._holds(p, blob, size, asked == NO_ROUND) for p in ask}
                    known = [p for p in live if p in known or holds.get(p)]
                    with self._lock:  # and one its own thread, or a range asking it alone, found holding meanwhile
                        known += [p for p in self._holders.get(sha256, (NO_ROUND, []))[1] if p not in known]
                        self._holders[sha256] = (time.monotonic(), known)
        banned = self._stats.banned
        now = time.monotonic()
        with self._lock:
            known = self._holders.get(sha256, (NO_ROUND, []))[1]
            holders = [p for p in known if p.url not in banned and p.url not in self._dead
                       and self._benched.get(p.url, (0.0, 0))[0] <= now]
        if not holders:
            return []
        start = next(self._turn) % len(holders)
        turn = holders[start:] + holders[:start]
        return sorted(turn, key=lambda p: p.url != first) if first else turn

    def _reader_alone(self, blob: Blob, size: int, url: str | None) -> bool:
        """Whether a range whose reader (its owner, or the node it was handed to) is the peer `url` goes on without
        the blob's HEAD round: that peer downloads the blob, or lists and plans, by its own HEAD, asked alone (again
        once REASK_S passed, while it lacks the blob). The range needs no other holder then: the others download
        the blob too and lack its bytes (`_holders_for`), or the range waits on its reader's plan (`_settle`). A
        round asks 31 peers one after another, 1.3-6 s at N = 32 on full links, under the fetch's one prober lock,
        and the ranges of a blob whose round had not run waited on it: the owners of a node's last blobs' ranges
        were asked 10-26 s into the fill (docs/peers.md, "N = 32: where the fill's first 20 s go"). Not for a
        reader holding the whole blob (its first piece is judged, by the round's holders' digests), nor one down
        or dead (its own thread asks it: _reprobe), nor this node (None, ""): those wait on the round as before."""
        if not url:
            return False
        sha256 = blob_key(blob)
        now = time.monotonic()
        with self._lock:
            peer = next((p for p in self._peers if p.url == url), None)
            if peer is None or url in self._dead or url in self._reprobing or self._is_down(url):
                return False
            asked, known = self._holders.get(sha256, (NO_ROUND, []))
            if peer in known:
                return (sha256, url) in self._downloading
            said = self._answered.get((sha256, url))
            if said is not None and now - said[0] < REASK_S:  # it answered a round, or another blob's ask, just now
                return (sha256, url) in self._planning
            alone = self._alone.get((sha256, url))
            if alone is not None and now - alone < REASK_S:  # asked by another range now, or its answer stands
                return (sha256, url) in self._planning or (sha256, url) not in self._idle
            self._alone[(sha256, url)] = float("inf")  # asked now: the other ranges it reads wait for its answer
        # one HEAD at a time, a round's included: with a range's reader asked alone at once by each worker, HEADs
        # came later than their wait, and live owners were taken for down (N = 32: 527 such verdicts, origin 3.6x)
        try:
            with self._probing:
                with self._lock:
                    asked, known = self._holders.get(sha256, (NO_ROUND, []))
                # found down while this waited for the lock: not asked (its own thread asks it), the round walks past
                holds = peer in known or (not self._skipped(url) and
                                          self._holds(peer, blob, size, asked == NO_ROUND and alone is None))
        finally:
            with self._lock:
                self._alone[(sha256, url)] = time.monotonic()
        with self._lock:
            asked, known = self._holders.get(sha256, (NO_ROUND, []))
            if holds and peer not in known:
                self._holders[sha256] = (asked, [*known, peer])
            return (sha256, url) in (self._downloading if holds else self._planning)

    def _skipped(self, url: str) -> bool:
        """`url` is down (asked by its own thread, _reprobe), or is being asked by that thread: no round asks it."""
        with self._lock:
            return url in self._reprobing or self._is_down(url)

    def _live_peers(self) -> typing.List[PeerClient]:  # noqa: UP006
        with self._lock:
            return [p for p in self._peers if p.url not in self._dead]

    def _holds(self, peer: PeerClient, blob: Blob, size: int, first_ask: bool = False) -> bool:
        """Whether the peer holds or downloads the blob: its answer of the last REASK_S (a round, or a reader asked
        alone, of another blob asked it about this one too: _asks), else asked now."""
        said = self._said(blob_key(blob), peer.url)
        return said if said is not None else self._asks(peer, blob, size, first_ask)

    def _said(self, sha256: str, url: str) -> bool | None:
        with self._lock:
            said = self._answered.get((sha256, url))
        return said[1] if said is not None and time.monotonic() - said[0] < REASK_S else None

    def _asks(self, peer: PeerClient, sha256: Blob, size: int, first_ask: bool = False) -> bool:
        """Ask one peer about the blob, and in the same request (`PeerClient.statuses`) about every other blob of
        the fetch it is not known to hold and has not answered about within REASK_S: one request a peer covers the
        model, where a HEAD a blob made a round of every peer per blob, one HEAD after another under the fetch's
        one prober lock (N = 32: a reader asked alone waited on that lock a median 4.3 s, up to 25 s; docs/peers.md,
        "Session 54"). A peer of a release before it is asked by HEAD (`probe`), this blob only. One that refuses
        is not asked again by this fetch, one that times out is down until it answers (_went_down: a blackholed
        peer costs one timeout of the fetch's rounds, not one per blob; its own thread asks it meanwhile).
        `first_ask`: this fetch's first probe of the blob (a peer with origin bytes of it by then started before
        this node: it may hold this node's share too)."""
        key = blob_key(sha256)
        asked: dict[str, int] = {key: size}
        firsts = {key} if first_ask else set()
        if isinstance(sha256, str) and peer.url not in self._one_by_one:
            now = time.monotonic()
            with self._lock:
                for blob, other in self._digests.values():
                    if len(asked) >= MAX_STATUS_BLOBS:  # a model of more blobs: the others in their own requests
                        break
                    if not isinstance(blob, str) or blob in asked:
                        continue
                    said = self._answered.get((blob, peer.url))
                    if peer in self._holders.get(blob, (NO_ROUND, []))[1] or (said and now - said[0] < REASK_S):
                        continue
                    asked[blob] = other
                    if blob not in self._holders and said is None:
                        firsts.add(blob)
        began = time.monotonic()
        pace = Pace(0, 0)  # no floor: a HEAD waits its timeout, or a verdict that its peer is down (_went_down)
        try:
            timeouts = self._timeouts(peer.url)
            batch = isinstance(sha256, str) and peer.url not in self._one_by_one
            with self._asked_of(peer.url, pace):
                kinds = peer.statuses(asked, *timeouts, pace=pace) if batch else None
            if kinds is None:
                if batch:
                    with self._lock:
                        self._one_by_one.add(peer.url)
                pace = Pace(0, 0)
                with self._asked_of(peer.url, pace):
                    kinds = {key: peer.probe(sha256, size, *timeouts, pace=pace)}
            self._heads.took(time.monotonic() - began)
        except PeerDown:  # found down while asked: drawn where it was found (_went_down)
            return False
        except PeerUnreachable as exc:
            self._unanswered(peer, sha256, size, exc, began)
            return False
        now = time.monotonic()
        with self._lock:
            self._hear(peer.url)  # an answer: alive
            for blob, kind in kinds.items():
                holds = self._answer(peer.url, blob, kind, blob in firsts)
                self._answered[(blob, peer.url)] = (now, holds)
                if holds and blob != key:  # a holder of another blob: its rounds and readers need not ask it
                    when, known = self._holders.get(blob, (NO_ROUND, []))
                    if peer not in known:
                        self._holders[blob] = (when, [*known, peer])
        return kinds.get(key) not in (None, "planning")

    def _answer(self, url: str, blob: str, kind: str | None, first_ask: bool) -> bool:
        """Record what a peer said of a blob (self._lock held); whether it holds or downloads it."""
        if kind == "planning":  # lacks it, but may be about to fetch it: its share is waited for
            self._planning.add((blob, url))
            self._idle.discard((blob, url))
            return False
        self._planning.discard((blob, url))
        if kind is None:
            self._idle.add((blob, url))
        else:
            self._idle.discard((blob, url))
        if kind in ("empty", "partial"):
            self._downloading.add((blob, url))
        if kind == "partial" and first_ask:
            self._ahead.add((blob, url))
        return kind is not None

    def _unanswered(self, peer: PeerClient, sha256: Blob, size: int, exc: PeerUnreachable, began: float) -> None:
        """A peer's `_asks` failed: this node's link, or the peer down (a timeout) or dead (refused)."""
        if self._not_theirs(began, connect_timed_out(exc), refused(exc)):  # this node's link: asked next round
            log.info("%s while nothing came to this node lately (%.0f s): this node's link", exc, DOWN_S)
            return
        if exc.timed_out:
            # no refusal: its link may be cut for a while. Down until it answers (asked again by its own
            # thread), not dead for the fetch: a HEAD begun while the --faults node was cut off timed out a
            # second after its link was back, and the node after it in rank read its share and the share it
            # had taken over (4 MiB) from the origin while it read them itself
            self._stats.error(peer.url)
            log.info("%s; down until it answers", exc)
            self._went_down(peer, sha256, size, confirm=True)
            return
        # refused: nothing listens there now. Dead (walked past at once, asked by no round) until it answers
        # again (its own thread asks it: _reprobe), not for the rest of the fetch: a daemon restarting on its
        # node refuses for a few seconds, then serves its blobs and fetches its share again
        with self._lock:
            again = peer.url in self._dead
            self._dead.add(peer.url)
        if not again:  # its thread's refusals while it stays dead are the one failure
            self._stats.error(peer.url)
            log.info("%s; dead until it answers", exc)
        self._went_down(peer, sha256, size, sure=True)

    @contextlib.contextmanager
    def _asked_of(self, url: str, pace: Pace) -> Iterator[None]:
        """A request to `url` in flight, with its Pace: a verdict that `url` is down ends it until it is answered
        (_went_down). Not one begun after that verdict: a down peer's own thread asks it (_reprobe), and a range
        whose reader is down unconfirmed asks it still (_serving_owner)."""
        with self._lock:
            self._asking.setdefault(url, set()).add(pace)
        try:
            yield
        finally:
            with self._lock:
                pending = self._asking.get(url)
                if pending is not None:
                    pending.discard(pace)
                    if not pending:
                        del self._asking[url]

    def _drop_holder(self, sha256: str, peer: PeerClient) -> None:
        with self._lock:
            asked, known = self._holders.get(sha256, (time.monotonic(), []))
            self._holders[sha256] = (asked, [p for p in known if p is not peer])

    def _from_peer(self, peer: PeerClient, key: str, sha256: Blob, pos: int, end: int, buf: memoryview,
                   on_bytes: OnBytes | None, relay: bool = False, judge: Judge | None = None) -> Pieces:
        """Yield pieces of [pos, end), or of the shorter span a peer still downloading the blob serves, from one
        peer. One attempt: a failure raises SourceError and the caller goes on with the bytes not yet yielded;
        PeerTooSlow when the watchdog cut a range below its rate floor (client.Pace). `relay`: the peer is the
        range's owner filling the blob with this node: its floor is RELAY_FLOOR (a fleet of N shares its link N
        ways; before the fetch had an origin rate its floor was 1 MiB/s, and at N = 16 on 1 MB/s links every
        relay was cut, 230-360 times a fill, each a new connection and its bytes on the wire lost). `judge`: the
        first piece is judged before it is used (_trial)."""
        with self._lock:
            flow = self._flows.get(peer.url)
            if flow is None:  # its probe asks first what this node's peer server hears from its host (client._Acks)
                host = self._hosts.get(peer.url)
                conns = functools.partial(self._inflight.connections, host) if host is not None else None
                flow = self._flows[peer.url] = PeerFlow(peer.address, self._link, conns)
        # its floor is its share of the bodies it sends (client.Pace.answered), as many as the fleet's other nodes
        # could ask of an honest peer at most
        fanout = STREAMS_PER_ASKER * max(1, self.nodes - 1)
        pace = Pace(end - pos, min(self._floor(), RELAY_FLOOR), RELAY_GRACE_S, flow, fanout, self._answers) \
            if relay else Pace(end - pos, self._floor(), flow=flow, max_fanout=fanout, answers=self._answers)
        WATCHDOG.watch(pace)
        try:
            with self._asked_of(peer.url, pace):
                yield from self._paced(peer, key, sha256, pos, end, buf, on_bytes, pace, judge)
        except PeerRangeMissing:
            with self._lock:
                self._hear(peer.url)  # an answer: alive
            raise
        except SourceError as exc:
            if pace.down:  # a verdict that it is down reached elsewhere before it answered (_went_down)
                raise PeerDown(f"peer {peer.url} found down while asked") from exc
            if pace.unreachable:  # the watchdog's probe: its link is cut, or it is dead (a failure, not slowness)
                took = f"; its answers took {flow.answer_s:.2f} s" if flow.answer_s is not None else ""
                raise PeerUnreachable(f"peer {peer.url} sent nothing for {SILENT_S:g} s and answered no connect "
                                      f"within {flow.probe_s:.2f} s{took}", probed=True) from exc
            if pace.was_cut:
                raise PeerTooSlow(f"peer {peer.url} sent {pace.describe()}") from exc
            raise
        finally:
            pace.finish()
            WATCHDOG.unwatch(pace)

    def _paced(self, peer: PeerClient, key: str, blob: Blob, pos: int, end: int, buf: memoryview,
               on_bytes: OnBytes | None, pace: Pace, judge: Judge | None = None) -> Pieces:
        sha256 = blob_key(blob)
        try:
            resp, served = peer.open_span(blob, pos, end, pace, self._timeouts(peer.url)[0])
        except Retryable as exc:
            raise SourceError(str(exc)) from exc
        with self._lock:
            self._hear(peer.url)
        pace.expect(served - pos)
        opened = iter([EagerBody(resp)])

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
                    self._limits.acquire_peers(len(view))  # the node's peer bytesPerSecond: the next piece waits
                digest = hashlib.sha256(view).digest()
                if judge is not None:
                    with pace.held():  # a digest request or an origin read of ours
                        verdict = judge(at, view, digest)
                    judge = None
                    if verdict == "lied":  # `view` holds the origin's bytes now: the peer's are never used
                        yield at, view
                        raise PeerLied(f"peer {peer.url} sent a piece at byte {at} that the origin contradicts")
                    if verdict == "origin":  # the origin sent these bytes too: counted as its own
                        yield at, view
                        continue
                with self._lock:
                    self._served[(key, at)] = (peer.url, digest)
                    self.peer_bytes += len(view)
                    self._hear(peer.url)
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
