"""Fetch engine: a reference becomes a published snapshot, by phase: plan (plan.py: list, what each file must
match, dedup on trusted evidence) -> transfer (transfer.py: download missing blobs) -> publish (publish.py:
verify, name blobs, publish the snapshot); files streamed to the caller meanwhile through handover.py.

Single flight: one flock per model (`locks/<model-key>.lock`) serialises fetches of a model across threads and
processes alike (flock belongs to an open file description, so two threads conflict like two processes). Waiters
poll it, show the holder's progress file, and find the published snapshot when it is released.
"""

from __future__ import annotations

import collections
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING

from weightcache import defaults
from weightcache.access import Grant, require_grant
from weightcache.download import DROP_BEHIND_MIN
from weightcache.errors import FetchCancelledError, ObjectChangedError
from weightcache.fetch import signed
from weightcache.fetch.handover import DurableFile, HandOver
from weightcache.fetch.items import Item, serve_partials
from weightcache.fetch.plan import Planner, check_revision, open_parts, peer_digests, range_size
from weightcache.fetch.publish import publish
from weightcache.fetch.report import Reporter
from weightcache.fetch.transfer import Transfer
from weightcache.progress import Progress, drop_progress_files, read_progress_file, want_progress
from weightcache.ratelimit import BandwidthLimits
from weightcache.signatures import SignaturePolicy
from weightcache.sources import ClientPool, Source, SourceOptions
from weightcache.store import BlobMissingError, Snapshot, Store, validate_tree
from weightcache.units import fmt_bytes
from weightcache.uri import ModelRef

if TYPE_CHECKING:
    from weightcache.peers import PeerSet
    from weightcache.peers.inflight import Planning

log = logging.getLogger(__name__)

MOVABLE = frozenset({"oci"})  # schemes whose source may veto a cache hit of a moved revision (Fetcher._still_named)
MAX_RESTARTS = 3  # object replaced mid-download, or a planned blob evicted meanwhile
#: A fetch of at most this many files makes each durable by its own fsyncs (the file, its blob directory) in the
#: worker that finished it, while the others download, and publishes without a syncfs: a syncfs also writes what
#: every other writer of the filesystem left dirty (containerd's layers, logs, other fetches), 0.08-0.92 s after an
#: 88 MB model from radosgw on the shared development VM (docs/fetch.md, "Small models"). More files: one syncfs
#: (2,000 small files: two fsyncs each took seconds).
FEW_FILES = 32


class Fetcher:
    """ensure(ref) -> Snapshot, single-flight in process (threads) and across processes (flock)."""

    #: one fetch cannot be stopped alone (the constructor's `cancel` and close() stop them all): the fetch queue
    #: lets a running fetch that every caller left run on (fetch_queue.Engine)
    stops_on_cancel = False

    def __init__(self, store: Store, *, concurrency: int = defaults.CONCURRENCY, chunk_size: int = defaults.CHUNK_SIZE,
                 endpoint_url: str | None = None, connect_timeout: float = defaults.CONNECT_TIMEOUT,
                 read_timeout: float = defaults.READ_TIMEOUT,
                 source_factory: Callable[[ModelRef], Source] | None = None,
                 cancel: threading.Event | None = None, peers: PeerSet | None = None,
                 proxy_url: str | None = None, require_source_checksum: bool = False,
                 limits: BandwidthLimits | None = None, clients: ClientPool | None = None) -> None:
        """`limits`: the node's bandwidth limits (weightcache/ratelimit.py) its origin reads wait on; none by default.
        `clients`: source clients kept between fetches (the daemon's; sources/base.py ClientPool).
        `cancel`: an event that, once set, stops this fetcher's downloads like close() (a caller's own stop).
        `peers`: blobs with a trusted sha256 are read from these peers first (weightcache/peers).
        `proxy_url`: the source's HTTP(S) forward proxy (s3 and http ranged reads).
        `require_source_checksum`: refuse a model with a file nothing from the source verifies (NotAllowedError)."""
        self.store = store
        self.concurrency = max(1, concurrency)
        self.chunk_size = max(64 << 10, chunk_size)
        self.endpoint_url = endpoint_url
        self.proxy_url = proxy_url
        self.require_source_checksum = require_source_checksum
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self._source_factory = source_factory
        self.peers = peers
        self.limits = limits or BandwidthLimits()
        self.clients = clients
        self._closing = cancel if cancel is not None else threading.Event()
        self._stats_lock = threading.Lock()
        self.stats: dict[str, int] = {"hits": 0, "misses": 0, "origin_bytes": 0, "peer_bytes": 0,
                                      "fetches_in_flight": 0}
        #: files this fetcher published, by what verified each against its source (vocabulary.SOURCE_CHECKS)
        self.published_checks: collections.Counter[str] = collections.Counter()
        self._signature_checked: set[tuple[str, tuple[SignaturePolicy, ...]]] = set()
        self._planner = Planner(store, peers=peers, require_source_checksum=require_source_checksum)

    # -- public -------------------------------------------------------------------------------------------------
    def ensure(self, grant: Grant, *, progress: Callable[[Progress], None] | None = None,
               looked_up: bool = False, on_file: Callable[[DurableFile], None] | None = None,
               cancel: threading.Event | None = None) -> Snapshot:
        """The snapshot of the files `grant` gave (weightcache/access.py: no fetch without a decision).
        Blocking; call from a thread in async code. Cache hit returns at once. `looked_up`: the caller's own
        lookup just missed (the fetch queue's), so only the re-check under the fetch lock asks the store.
        `on_file`: called (on a worker thread: return quickly) for each file once its blob is verified and
        durable, while the rest downloads; on a cache hit for every file before this returns. A file is never
        handed over twice with the same listing; a restart (an object changed at the source) may hand a path
        over again with other bytes. Nothing unverified is ever handed over. `cancel` is not watched: one fetch
        is not stopped alone (`stops_on_cancel`)."""
        ref = require_grant(grant).ref
        handover = HandOver(on_file, self.store) if on_file is not None else None
        snap = None if looked_up else self.store.lookup(ref)
        if snap is not None and self._still_named(ref, snap):
            return self._hit(grant, snap, handover)
        moved = snap.id if snap is not None else None  # the snapshot a moved tag no longer names
        lock_fd = self._acquire(ref, progress)
        try:
            snap = self.store.lookup(ref)
            if snap is not None and snap.id != moved and (moved is not None or self._still_named(ref, snap)):
                return self._hit(grant, snap, handover)
            self._count("misses")
            self._count("fetches_in_flight")
            try:
                if handover is not None and grant.signatures:
                    # nothing reaches a pod before model.sig verified the whole model: handed over once published
                    return handover.snapshot(self._fetch(grant, progress))
                return self._fetch(grant, progress, handover)
            finally:
                self._count("fetches_in_flight", -1)
        finally:
            os.close(lock_fd)

    def _hit(self, grant: Grant, snap: Snapshot, handover: HandOver | None) -> Snapshot:
        self._count("hits")
        snap = self._signed(grant, snap)
        return handover.snapshot(snap) if handover is not None else snap

    def lookup(self, grant: Grant) -> Snapshot | None:
        """The cached snapshot of the granted files, or None (the store serves no file the grant leaves out);
        SignatureError when its model.sig does not satisfy the grant's signature requirements."""
        snap = self.store.lookup(grant.ref)
        return self._signed(grant, snap) if snap is not None and self._still_named(grant.ref, snap) else None

    def _signed(self, grant: Grant, snap: Snapshot) -> Snapshot:
        """`snap` once its model.sig satisfies the grant's signature requirements (signed.py): a snapshot published
        for a request that asked none is checked here, and what verified it added to its manifest. Remembered
        per snapshot and requirement, so a CSI publish of a checked model costs a dict lookup."""
        key = (snap.id, grant.signatures)
        if grant.signatures and key not in self._signature_checked:
            record = signed.check(grant, self.store, snap.files)
            if record is not None:
                self.store.record_signature(snap.id, record.to_json())
            with self._stats_lock:
                self._signature_checked.add(key)
        return snap

    def _still_named(self, ref: ModelRef, snap: Snapshot) -> bool:
        """A cache hit stands unless the source moves this reference's revision (MOVABLE: an oci:// tag) and
        says it names other files now (`source.still_names(snapshot)`, sources/oci.py); the old snapshot then
        stays until evicted. Other sources' refs are final (docs/sources.md, "A moved tag")."""
        if ref.scheme not in MOVABLE:
            return True
        with closing(self._open_source(ref)) as source:
            return source.still_names(snap)

    def close(self) -> None:
        """Cancel: in-flight fetches stop at their next read or retry wait (FetchCancelledError); journalled
        chunks are kept and resume on the next run. Thread-safe; the Fetcher takes no new work after it."""
        self._closing.set()

    # -- locking ------------------------------------------------------------------------------------------------
    def _progress_path(self, ref: ModelRef) -> Path:
        return self.store.partial_path(f"{ref.key}.progress")

    def _acquire(self, ref: ModelRef, progress: Callable[[Progress], None] | None) -> int:
        fd = self.store.open_lock(ref.key)
        last_report = 0.0
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                pass
            if self._closing.is_set():
                os.close(fd)
                raise FetchCancelledError(f"shutting down while waiting for the fetch of {ref}")
            now = time.monotonic()
            if progress is not None and now - last_report > 0.25:
                p = read_progress_file(self._progress_path(ref))
                if p is not None:
                    progress(p)
                else:  # the holder writes it only for a waiter: say so (again, after a fetch ended)
                    want_progress(self._progress_path(ref))
                last_report = now
            time.sleep(0.05)

    def _checked(self, checks: dict[str, str]) -> None:
        with self._stats_lock:
            self.published_checks.update(checks.values())

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[name] += n

    # -- the fetch ----------------------------------------------------------------------------------------------
    def _fetch(self, grant: Grant, progress: Callable[[Progress], None] | None,
               handover: HandOver | None = None) -> Snapshot:
        ref = grant.ref
        reporter = Reporter(ref.uri, self._progress_path(ref), progress)
        reporter.phase("listing")
        # peers that wait on this node for its share of the model wait on while it lists and plans
        plan = self.peers.inflight.planning() if self.peers is not None else None
        try:
            source = self._open_source(ref)
        except BaseException:
            if plan is not None:
                plan.done()
            raise
        try:
            for attempt in range(1, MAX_RESTARTS + 1):
                try:
                    return self._fetch_once(grant, source, reporter, handover, plan)
                except (ObjectChangedError, BlobMissingError) as exc:
                    if attempt == MAX_RESTARTS:
                        raise
                    log.warning("restarting fetch of %s (%s)", ref, exc)
            raise AssertionError("unreachable")
        except BaseException as exc:
            reporter.phase("failed", str(exc))
            raise
        finally:
            if plan is not None:
                plan.done()
            source.close()
            drop_progress_files(self._progress_path(ref))

    def _open_source(self, ref: ModelRef) -> Source:
        if self._source_factory is not None:
            return self._source_factory(ref)
        from weightcache.sources import open_source

        return open_source(ref, SourceOptions(endpoint_url=self.endpoint_url, proxy_url=self.proxy_url,
                                              pool_size=max(10, self.concurrency * 2),
                                              connect_timeout=self.connect_timeout, read_timeout=self.read_timeout,
                                              cancel=self._closing, limits=self.limits, clients=self.clients))

    def _fetch_once(self, grant: Grant, source: Source, reporter: Reporter, handover: HandOver | None,
                    plan: Planning | None = None) -> Snapshot:
        ref = grant.ref
        started = time.monotonic()
        # tar layers (oci://): listed as one hidden object each, downloaded and verified like any file, then
        # replaced by their members (sources/oci_tar.py); taken before peers wrap the source
        expand = source.expand
        objects = source.list()
        validate_tree(o.relpath for o in objects)
        check_revision(ref, source, objects)
        items = self._planner.items(ref, source, objects)
        todo = [i for i in items if i.sha256 is None]
        total = sum(i.obj.size for i in items)
        reporter.start(total, len(items), already=total - sum(i.obj.size for i in todo),
                       files_already=len(items) - len(todo))
        if handover is not None:
            handover.listed(items)
            # small files first, and of those the index, config and tokenizer before any small shard: the pod's
            # entry point waits for them and the streaming loader plans its shards from the index, so a model of
            # small shards starts loading after its first shard, not its last
            todo.sort(key=lambda i: (i.obj.size > self.chunk_size, i.relpath.endswith(".safetensors")))
        resumed = open_parts(ref, self.store, todo, range_size=self._range_size(todo, streaming=handover is not None),
                             chunk_size=self.chunk_size,
                             drop_behind=handover is None and sum(i.obj.size for i in todo) >= DROP_BEHIND_MIN)
        fleet = None
        if self.peers is not None and todo and (digests := peer_digests(ref, todo)):
            source = fleet = self.peers.wrap(source, digests)
        self.store.ensure_space(sum(i.obj.size for i in todo) - resumed, uri=ref.uri)
        each = handover or (HandOver(None, self.store) if len(todo) <= FEW_FILES else None)
        try:
            # the plan is done once its downloads are registered (peers' HEADs: "empty", not a plain 404)
            fetched = Transfer(self.store, source, reporter, each, self.peers, self.chunk_size, self.concurrency,
                               self._closing, self._count, plan.done if plan is not None else None).download(todo)
        finally:  # the blobs have their names now (or the fetch failed): peers find one or nothing
            serve_partials(self.peers, todo, False)
            if fleet is not None:  # nor are down or dead peers asked again for it
                fleet.end()
        reporter.phase("publishing")
        # files made durable one by one (reported) need no syncfs before the snapshot is named
        snap = publish(grant, self.store, items, downloaded=any(not i.reported for i in todo), expand=expand,
                       checked=self._checked)
        secs = time.monotonic() - started
        log.info("fetched %s: %s from origin (%d of %d files, %s already cached) in %.1fs, %.2f GB/s",
                 ref, fmt_bytes(fetched), len(todo), len(items), fmt_bytes(total - fetched), secs,
                 fetched / secs / 1e9 if secs else 0.0)
        reporter.phase("done")
        return snap

    def _range_size(self, todo: list[Item], *, streaming: bool) -> int:
        """Streaming (on_file) wants the first file whole first: its ranges sized so that it alone spreads over
        every worker, as the workers take ranges in file order; else the model's bytes are spread."""
        spread = max((i.obj.size for i in todo), default=0) if streaming else sum(i.obj.size for i in todo)
        return range_size(spread, concurrency=self.concurrency, chunk_size=self.chunk_size)
