"""The transfer phase of a fetch: the planned downloads read in ranges by a pool of workers, written, journalled
and hashed in order (download.py), in rounds: a file failing verification is fetched once more.

Memory stays bounded: each worker owns one reusable chunk buffer; bodies stream to disk, never to RAM. A worker
with no task left takes over the back half of a stalled range (`_Reading`); a range whose bytes are on their way
to a peer (`Later`) is put back and taken again shortly."""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import closing, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weightcache.download import PIECE
from weightcache.errors import FetchCancelledError, InsufficientSpaceError, IntegrityError, ObjectChangedError
from weightcache.fetch import publish
from weightcache.fetch.handover import HandOver
from weightcache.fetch.items import Item, partial, serve_partials
from weightcache.fetch.report import Reporter
from weightcache.peers.source import Later
from weightcache.sources import Source
from weightcache.store import BlobWriter, Store
from weightcache.store.floor import full_disk_advice
from weightcache.units import fmt_bytes

if TYPE_CHECKING:
    from weightcache.peers import PeerSet

log = logging.getLogger(__name__)

LOCAL_LARGE_PIECE = 1 << 20  # a local source's piece this large is worth a thread of its own (see workers)
SPLIT_STALL = 2.0  # seconds without a piece after which an idle worker halves a range (_Reading); 5x for a first
# an idle worker (no task left) waits at most this long between looks for a stalled range, unless one may stall
# sooner or a range ends: at 0.05 s a fleet fill's idle workers (up to FLEET_MAX_WORKERS) woke ~1,000 times a
# second, each wake a GIL hand-off (a fetch cancelled meanwhile ends its idle workers within this)
IDLE_WAIT_S = 1.0
LATER_S = 0.2  # a range whose bytes are on their way to a peer (Later) is taken again after this
FLEET_RANGES_PER_NODE = 2  # with peers, ranges are cut so that every node of a fleet owns this many (_finer)
FLEET_MIN_PIECES = 4
FLEET_MAX_WORKERS = 64  # a fleet's fetch has a worker per range it follows (Transfer.workers), at most this many
SPLIT_MIN = 4 * PIECE  # a range is halved only while this much of it is left beyond the piece in flight

Piece = tuple[Item, int, int]  # (item, offset, length): one range to read


@dataclass
class Transfer:
    """The downloads of one fetch from one source (peers' wrapper included)."""

    store: Store
    source: Source
    reporter: Reporter
    handover: HandOver | None
    peers: PeerSet | None
    chunk_size: int
    concurrency: int
    closing: threading.Event  # the Fetcher's: set, every read stops at its next chunk
    count: Callable[[str, int], None]  # Fetcher stats: origin_bytes, peer_bytes
    # called once the round's downloads are registered with this node's peer server (Fetcher: the plan is done)
    serving: Callable[[], None] | None = None

    def download(self, todo: list[Item]) -> int:
        """Download every item; a file failing verification is refetched once. Returns origin bytes."""
        fetched = 0
        pending = todo
        try:
            for round_ in (1, 2):
                with self.store.blob_writer() as blobs:
                    fetched += self._round(pending, blobs)
                pending = self._finish_round(pending, last=round_ == 2)
                if not pending:
                    break
        except (KeyboardInterrupt, FetchCancelledError):
            raise  # stop now: a syncfs could take seconds; journalled files resume, small ones are refetched
        except BaseException:  # verified files become blobs even when another file failed: a rerun reuses them
            publish.keep_verified(self.store, todo)
            raise
        publish.add_blobs(self.store, todo)  # the syncfs that makes them durable runs while publish links the tree
        return fetched

    def _finish_round(self, items: list[Item], *, last: bool) -> list[Item]:
        """Verify the round's files; returns those failing verification, to fetch again (none in the last)."""
        failed = []
        for item in items:
            if item.reported:  # finished, verified and made a blob in the round (publish.durable)
                self.reporter.add(0, 1)
                continue
            try:
                publish.finish(item, self.source)
                self.reporter.add(0, 1)
            except IntegrityError as exc:
                if last:
                    raise
                log.warning("%s; refetching %s", exc, item.relpath)
                self.source.verification_failed(item.obj)
                serve_partials(self.peers, [item], False)  # peers must not read what is discarded now
                partial(item).discard()
                self.reporter.add(-item.obj.size, 0)
                failed.append(item)
        return failed

    def _round(self, items: list[Item], blobs: BlobWriter) -> int:
        pieces: list[Piece] = []
        try:
            for item in items:
                pieces += [(item, off, n) for off, n in partial(item).open()]
        except OSError as exc:
            _discard_all(items)
            raise _space_error(exc, items, self.store) from exc
        self.reporter.add(sum(partial(i).resumed_bytes for i in items), 0)
        serve_partials(self.peers, items, True)
        if self.serving is not None:
            self.serving()
        # peers: nodes started together fetch different ranges first
        pieces = self.source.spread(_finer(pieces, self.source.nodes, min(PIECE, self.chunk_size)),
                                    lambda p: (p[0].obj.key, p[1], p[2]))
        return _Round(self, items, pieces, blobs).run()

    def workers(self, task_bytes: list[int]) -> int:
        """Threads hide request latency. A local source's reads are system calls with none to hide, and each
        call hands the GIL to another thread and back: 2,000 files of 4 KB took 180 ms on 8 workers, 100 ms on
        one. So a local round gets one worker per large task (disk reads and hashing of those overlap; a resumed
        file's hashing is a task too), up to `concurrency`, and one for all the small ones."""
        if not self.source.local:
            # a fleet: a range of another node's share streams at its owner's origin pace (peers/server.py
            # `_stream`), holding a worker all along, so every range of the fleet gets one (with `concurrency`
            # workers, 8 streams at 1/32 of a 1 MB/s origin each filled an eighth of a node's link)
            fleet = min(FLEET_MAX_WORKERS, FLEET_RANGES_PER_NODE * self.source.nodes) if self.source.nodes > 1 else 0
            return max(1, min(max(self.concurrency, fleet), len(task_bytes)))
        large = sum(1 for n in task_bytes if n >= LOCAL_LARGE_PIECE)
        return max(1, min(self.concurrency, len(task_bytes), large))

    def durable(self, item: Item) -> None:
        """A worker hashed the file's last bytes: hand it over now when the caller streams (on_file)."""
        if self.handover is not None and partial(item).complete:
            publish.durable(item, self.source, self.store, self.handover, self.peers)


class _Round:
    """One round's workers: each takes the next task (a range to read, a resumed file to hash) until none is
    left, then halves stalled ranges. One future per worker, not per piece (2,000 small files: no future,
    condition and queue hand-off each)."""

    def __init__(self, transfer: Transfer, items: list[Item], pieces: list[Piece], blobs: BlobWriter) -> None:
        self.t, self.items, self.pieces, self.blobs = transfer, items, pieces, blobs
        self.source = transfer.source
        self.abort = threading.Event()
        self.fetched = 0
        self._fetched_lock = threading.Lock()
        self._local = threading.local()
        self._threads = itertools.count()  # workers that made their buffers, in turn (buffers)
        # a worker's buffer: a whole small file, or one piece of a large one (download.PIECE: written, journalled
        # and hashed while still in the core's cache); bytearray() writes every byte, so never more than needed
        self.piece = piece = min(PIECE, transfer.chunk_size)
        journalled = any(partial(i).journalled for i in items)
        self._buf_size = max(64 << 10, piece if journalled else 0, min(
            transfer.chunk_size, max((n for i, _, n in pieces if not partial(i).journalled), default=0)))
        # scratch re-reads what waits to be hashed, a piece at a time: only journalled (large) files have any
        self._scratch_size = piece if journalled else 64 << 10
        self.reading = _Reading(piece)
        self.queue: deque[Callable[[], None]] = deque([
            *(functools.partial(self.hash_resumed, i) for i in items if partial(i).resumed_bytes),
            *(functools.partial(self.read, *p) for p in pieces)])
        # (when, peer, task) in order of when: ranges a peer is still fetching from the origin (Later), taken again
        # from `when` (the peer's estimate of when its bytes are journalled, or LATER_S), or once that peer went
        # down (`wake`)
        self.deferred: list[tuple[float, str | None, Callable[[], None]]] = []
        # a sorted list is no deque: its insert and pop race between workers; notified when a range is deferred or
        # woken, for a worker waiting on the first one's time
        self._deferred_lock = threading.Condition()
        self.source.defer_while(lambda: bool(self.queue) or len(self.deferred) > 1, self.wake)

    def buffers(self, whole: bool = False) -> tuple[memoryview, memoryview]:
        """This worker's buffer and scratch. `whole`: a file read in one go, which needs the round's largest
        buffer; a worker beyond `concurrency` (a fleet's, Transfer.workers) keeps a piece's and makes that one
        for the read, so memory stays `concurrency` large buffers and a piece per other worker."""
        if not hasattr(self._local, "buf"):
            extra = next(self._threads) >= self.t.concurrency
            self._local.buf = memoryview(bytearray(min(self._buf_size, max(64 << 10, self.piece)) if extra
                                                   else self._buf_size))
            self._local.scratch = memoryview(bytearray(self._scratch_size))
        buf = self._local.buf
        if whole and len(buf) < self._buf_size:
            buf = memoryview(bytearray(self._buf_size))
        return buf, self._local.scratch

    def check_cancel(self) -> None:
        if self.abort.is_set() or self.t.closing.is_set():
            raise FetchCancelledError("fetch cancelled; finished chunks are kept and resume on the next run")

    def arrived(self, n: int) -> None:
        """Bytes as each read() returns them: progress moves on a slow origin, and a cancel lands at once."""
        self.check_cancel()
        with self._fetched_lock:
            self.fetched += n
        self.t.reporter.add(n, 0)

    def read(self, item: Item, offset: int, length: int) -> None:
        part = partial(item)
        buf, scratch = self.buffers(not part.journalled)
        self.check_cancel()
        into = buf[:self.piece] if part.journalled else buf
        entry = self.reading.begin(item, offset, offset + length) if part.journalled else None
        end = offset + length
        try:
            with closing(self.source.read_pieces(item.obj, offset, length, into, self.arrived)) as pieces:
                for pos, view in pieces:
                    if part.journalled or pos or len(view) != item.obj.size or not self.blobs.usable:
                        part.write(pos, view, scratch)
                    else:
                        publish.write_whole(item, view, self.source, self.blobs)
                    if entry is not None and not self.reading.advanced(entry, pos + len(view)):
                        break  # an idle worker took the rest of this range (it stalled)
        except Later as later:  # its bytes are on their way to a peer: another range first, this one again soon
            if entry is not None:
                end = self.reading.end(entry)
                entry = None
            when = time.monotonic() + (LATER_S if later.delay is None else later.delay)
            with self._deferred_lock:
                self.deferred.insert(bisect.bisect(self.deferred, when, key=_when),
                                     (when, later.on, functools.partial(self.read, item, later.pos, end - later.pos)))
                self._deferred_lock.notify()
        finally:
            if entry is not None:
                self.reading.end(entry)
        self.t.durable(item)

    def hash_resumed(self, item: Item) -> None:
        partial(item).hash_resumed(self.buffers()[1])
        self.t.durable(item)

    def wake(self, peer: str) -> None:
        """`peer` went down: the ranges deferred on its bytes are taken again now (the source walks them on to the
        next node), not at their wait's end (a "not yet" waits up to 3 s: the --faults bench's cut node's ranges
        went on 1.0-8.1 s after its cut)."""
        now = time.monotonic()
        with self._deferred_lock:
            if any(on == peer for _, on, _ in self.deferred):
                self.deferred = sorted(((now if on == peer else when, on, task) for when, on, task in self.deferred),
                                       key=_when)
                self._deferred_lock.notify_all()

    def next_task(self) -> Callable[[], None] | None:
        """A deferred range whose wait is over, else the next in order; each is handed to one thread."""
        with self._deferred_lock:
            while self.deferred and not self.queue and (left := self.deferred[0][0] - time.monotonic()) > 0:
                self._deferred_lock.wait(left)  # nothing else to take: its time, or a wake, or one deferred sooner
            due = self.deferred.pop(0)[2] if self.deferred and self.deferred[0][0] <= time.monotonic() else None
        if due is not None:
            return due
        with suppress(IndexError):
            return self.queue.popleft()
        return None

    def worker(self) -> None:
        """Take the next task until none is left or the round aborts, then halve stalled ranges."""
        while (task := self.next_task()) is not None:
            if self.abort.is_set():
                return
            task()
        while not self.abort.is_set() and self.reading.busy():  # no task left: take over the back of a stalled range
            taken = self.reading.split()
            if taken is not None:
                self.read(*taken)
            else:
                self.reading.wait_end()
                if self.abort.is_set():
                    return
            self.check_cancel()

    def run(self) -> int:
        """Run the workers to the round's end; returns the bytes read from the origin."""
        peer_before = self.source.peer_bytes
        workers = self.t.workers([*(partial(i).resumed_bytes for i in self.items if partial(i).resumed_bytes),
                                  *(n for _, _, n in self.pieces)])
        try:
            pool = ThreadPoolExecutor(workers, thread_name_prefix="wc-fetch")
            futures = [pool.submit(self.worker) for _ in range(workers)]
            try:
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            except BaseException:  # KeyboardInterrupt in the main thread: stop the workers, keep the journal, and
                self.abort.set()  # do not join them: one may sit in a read the origin holds until its timeout
                self.reading.wake()
                pool.shutdown(wait=False, cancel_futures=True)
                raise
            if errors := [e for f in done if (e := f.exception()) is not None]:
                self.abort.set()  # the other workers return at their next read, the idle ones at once
                self.reading.wake()
            pool.shutdown()
            if errors:
                _handle_failure(errors[0], self.items, self.t.store)
        finally:
            peer = self.source.peer_bytes - peer_before
            with self._fetched_lock:
                self.fetched -= peer
                self.t.count("origin_bytes", self.fetched)  # a failed round's bytes came from the origin all the same
                self.t.count("peer_bytes", peer)
        return self.fetched


@dataclass
class _Range:
    item: Item
    next: int  # the next byte its owner reads
    end: int
    last: float  # monotonic time of its last piece (or its start)
    started: bool = False  # a piece arrived


class _Reading:
    """The ranges of large files being read, so that a worker with no task left can halve a stalled one: a range
    without a piece for SPLIT_STALL seconds (5x that before its first) loses its back half, aligned to its pieces,
    to that worker, and its owner stops where the half begins (its own request goes on being retried). A slow
    origin then costs one range's front, not the fetch's tail; the journal, hashing and resume take the halves as
    any other pieces."""

    def __init__(self, piece: int) -> None:
        self.piece = piece
        self._mu = threading.Lock()
        self._ended = threading.Condition(self._mu)
        self._ranges: dict[int, _Range] = {}

    def begin(self, item: Item, start: int, end: int) -> _Range:
        entry = _Range(item, start, end, time.monotonic())
        with self._mu:
            self._ranges[id(entry)] = entry
        return entry

    def advanced(self, entry: _Range, pos: int) -> bool:
        """The owner wrote up to `pos`: False when the rest is another worker's now."""
        with self._mu:
            entry.next, entry.last, entry.started = pos, time.monotonic(), True
            return pos < entry.end

    def end(self, entry: _Range) -> int:
        """The range is done with; returns where it ends now (an idle worker may have taken its back half)."""
        with self._mu:
            self._ranges.pop(id(entry), None)
            self._ended.notify_all()
            return entry.end

    def busy(self) -> bool:
        with self._mu:
            return bool(self._ranges)

    def wait_end(self) -> None:
        """Wait until a range ends, the round aborts (`wake`), or a range being read could have stalled long
        enough to be halved (`split`; IDLE_WAIT_S at most). The workers with no task left wait here for the last
        range: waking only every 50 ms, they held the round's end, and the fetch, by up to that after its last
        byte was hashed (36 ms of an 88 MB fetch's 0.55 s); and a fleet's many idle workers woke ~1,000 times a
        second, each wake a GIL hand-off. The ranges are looked at under the lock the ending one notifies with,
        so no end is missed."""
        with self._mu:
            if not self._ranges:
                return
            now = time.monotonic()
            due = [e.last + (SPLIT_STALL if e.started else 5 * SPLIT_STALL) - now for e in self._ranges.values()
                   if e.end - e.next - self.piece >= SPLIT_MIN]
            self._ended.wait(max(0.01, min([IDLE_WAIT_S, *due])))

    def wake(self) -> None:
        """Every idle worker looks again now (the round aborts)."""
        with self._mu:
            self._ended.notify_all()

    def split(self) -> Piece | None:
        """The back half of the stalled range with the most bytes left, or None."""
        now = time.monotonic()
        with self._mu:
            stalled = [e for e in self._ranges.values() if e.end - e.next - self.piece >= SPLIT_MIN
                       and now - e.last > (SPLIT_STALL if e.started else 5 * SPLIT_STALL)]
            if not stalled:
                return None
            entry = max(stalled, key=lambda e: e.end - e.next)
            item, nxt, end = entry.item, entry.next, entry.end
            first = nxt + self.piece  # the piece in flight stays the owner's
            mid = first + (end - first) // 2 // self.piece * self.piece
            entry.end = mid
        log.info("%s: bytes %d-%d stalled; reading %d-%d on another connection", item.relpath, nxt, end - 1,
                 mid, end - 1)
        return item, mid, end - mid


def _when(deferred: tuple[float, str | None, Callable[[], None]]) -> float:
    return deferred[0]


def _finer(pieces: list[Piece], nodes: int, piece: int) -> list[Piece]:
    """A fleet's ranges: the journalled files' ranges cut, on `piece` boundaries, so that each of `nodes` nodes
    owns about FLEET_RANGES_PER_NODE of them (PeerSource.spread), none below FLEET_MIN_PIECES pieces. With 8 ranges and
    16 nodes, two nodes owned each range and both read it from the origin; and a node reading one large range
    from the origin serves it to the others at that one connection's pace."""
    if nodes <= 1:
        return pieces
    total = sum(n for item, _, n in pieces if partial(item).journalled)
    size = max(FLEET_MIN_PIECES, -(-total // (nodes * FLEET_RANGES_PER_NODE) // piece)) * piece
    out = []
    for item, off, n in pieces:
        if not partial(item).journalled or n <= size:
            out.append((item, off, n))
            continue
        out += [(item, at, min(size, off + n - at)) for at in range(off, off + n, size)]
    return out


def _handle_failure(exc: BaseException, items: list[Item], store: Store) -> None:
    for item in items:
        partial(item).close()
    if isinstance(exc, ObjectChangedError):
        _discard_all(items)  # restart from a fresh listing; never a body mixed from two versions
        raise exc
    if isinstance(exc, OSError) and exc.errno in (28, 122):
        _discard_all(items)
        raise _space_error(exc, items, store) from exc
    raise exc


def _discard_all(items: list[Item]) -> None:
    for item in items:
        if item.partial is not None:
            item.partial.discard()


def _space_error(exc: OSError, items: list[Item], store: Store) -> InsufficientSpaceError:
    """The store checked its floor before the download: a full disk now is another writer's doing (or a budget
    above what the disk holds)."""
    need = sum(i.obj.size for i in items)
    return InsufficientSpaceError(f"disk full while fetching ({exc.strerror}); the model needs {fmt_bytes(need)}; "
                                  f"{full_disk_advice(store.root)}")
