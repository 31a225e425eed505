"""Fetch engine: a reference becomes a published snapshot. list -> plan -> download missing blobs -> verify -> publish.

Single flight: one flock per model (`locks/<model-key>.lock`) serialises fetches of a model across threads and
processes alike (flock belongs to an open file description, so two threads conflict like two processes). Waiters
poll it, show the holder's progress file, and find the published snapshot when it is released.
Dedup: a file is linked without downloading only on evidence this node can trust: the same source object
(uri, path, ETag/version, size) recorded in a manifest this node wrote, or the store's own full-object SHA-256
(S3 computes and verifies it on upload). A digest a file in the source names (SHA256SUMS, *.sha256) is a claim:
it only checks bytes actually downloaded, so a source cannot link another model's blob into its snapshot, and
sizes recorded are the sizes written.
Memory stays bounded: each worker owns one reusable chunk buffer; bodies stream to disk, never to RAM.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import re
import threading
import time
import typing
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import closing, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from weightcache import defaults
from weightcache.access import Grant, require_grant
from weightcache.checksums import Hasher, new_hasher
from weightcache.download import PIECE, PartialFile, sync_filesystem
from weightcache.errors import (
    FetchCancelledError,
    InsufficientSpaceError,
    IntegrityError,
    NotAllowedError,
    ObjectChangedError,
    SafetensorsHeaderError,
    SourceNotFoundError,
)
from weightcache.peers.identity import COMPOSITE, CompositeMD5, OriginId, composite_factory, origin_evidence
from weightcache.peers.source import Later
from weightcache.progress import Progress, RateMeter, read_progress_file, write_progress_file
from weightcache.sources import ObjectInfo, Source, SourceOptions
from weightcache.store import BlobMissingError, BlobWriter, FileEntry, Snapshot, Store, validate_tree
from weightcache.store.floor import full_disk_advice
from weightcache.units import fmt_bytes
from weightcache.uri import ModelRef
from weightcache.vocabulary import NO_SOURCE_CHECK

if TYPE_CHECKING:
    from weightcache.peers import PeerSet

log = logging.getLogger(__name__)

__all__ = ["DurableFile", "FetchCancelledError", "Fetcher", "Progress"]

SIDECAR_MAX = 1 << 20
MOVABLE = frozenset({"oci"})  # schemes whose source may veto a cache hit of a moved revision (Fetcher._still_named)
MAX_RESTARTS = 3  # object replaced mid-download, or a planned blob evicted meanwhile
LOCAL_LARGE_PIECE = 1 << 20  # a local source's piece this large is worth a thread of its own (see _workers)
MIN_RANGE_CHUNKS = 4  # requests of 4 chunks or more (64 MiB by default) while every worker gets one (_range_size)
SPLIT_STALL = 2.0  # seconds without a piece after which an idle worker halves a range (_Reading); 5x for a first
LATER_S = 0.2  # a range whose bytes are on their way to a peer (Later) is taken again after this
FLEET_RANGES_PER_NODE = 2  # with peers, ranges are cut so that every node of a fleet owns this many (_finer)
FLEET_MIN_PIECES = 4
SPLIT_MIN = 4 * PIECE  # a range is halved only while this much of it is left beyond the piece in flight
MULTIPART_ETAG = re.compile(r"[0-9a-f]{32}-[0-9]{1,5}")  # S3's multipart ETag: MD5 of the part MD5s, "-" parts


@dataclass(frozen=True)
class DurableFile:
    """A file of a fetch whose blob is verified (in-order sha256, the source's check, a safetensors header) and
    durable in the store (fsynced, named): `Fetcher.ensure(on_file=...)` hands these over while the rest downloads.
    The snapshot is still published only when whole; until then the blob is an orphan a gc keeps for
    ORPHAN_BLOB_GRACE_S (store/recovery.py), so a reader opens it at once (an open file outlives an unlink)."""

    entry: FileEntry
    blob: Path
    planned: frozenset[str]  # every path of this listing (oci tar layers unexpanded): what else is coming


@dataclass
class _Item:
    """One object to fetch and what we expect of it."""

    obj: ObjectInfo
    relpath: str
    expect_sha256: str | None = None  # the bytes we download must hash to this
    source_check: tuple[str, str] | None = None  # (algorithm, hex) the source declares: crc32, ..., md5 (ETag)
    sha256: str | None = None  # known without download (trusted dedup) or computed
    trusted_sha256: str | None = None  # on evidence no source or peer can forge (peers may serve it)
    # no trusted sha256, but an origin identity with an origin checksum (source_check) the bytes are checked
    # against: peers are asked for this identity (docs/peers.md, "Objects without a SHA-256 checksum")
    peer_origin: OriginId | None = None
    size: int = 0  # of the blob linked or the file written, never the listing's claim
    partial: PartialFile | None = field(default=None, repr=False)
    in_blob: bool = False  # written straight to its blob (a whole small file): no part to move
    header_error: SafetensorsHeaderError | None = None  # its header check's refusal before naming it: _finish raises
    unsynced_blob: bool = False  # linked on the store's checksum alone: its blob may be another fetch's, not synced
    check: str = NO_SOURCE_CHECK  # what verifies it against its source (vocabulary.SOURCE_CHECKS): the manifest's
    reported: bool = False  # handed to on_file: its blob is named and durable already (_add_blobs skips it)


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
                 proxy_url: str | None = None, require_source_checksum: bool = False) -> None:
        """`cancel`: an event that, once set, stops this fetcher's downloads like close() (a caller's own stop).
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
        self._closing = cancel if cancel is not None else threading.Event()
        self._stats_lock = threading.Lock()
        self.stats: dict[str, int] = {"hits": 0, "misses": 0, "origin_bytes": 0, "peer_bytes": 0,
                                      "fetches_in_flight": 0}

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
        snap = None if looked_up else self.store.lookup(ref)
        if snap is not None and self._still_named(ref, snap):
            self._count("hits")
            return self._hand_over(snap, on_file)
        moved = snap.id if snap is not None else None  # the snapshot a moved tag no longer names
        lock_fd = self._acquire(ref, progress)
        try:
            snap = self.store.lookup(ref)
            if snap is not None and snap.id != moved and (moved is not None or self._still_named(ref, snap)):
                self._count("hits")
                return self._hand_over(snap, on_file)
            self._count("misses")
            self._count("fetches_in_flight")
            try:
                return self._fetch(ref, progress, on_file)
            finally:
                self._count("fetches_in_flight", -1)
        finally:
            os.close(lock_fd)

    def _hand_over(self, snap: Snapshot, on_file: Callable[[DurableFile], None] | None) -> Snapshot:
        """A cache hit: every file of a published snapshot is durable already."""
        if on_file is not None:
            planned = frozenset(f.path for f in snap.files)
            for f in snap.files:
                on_file(DurableFile(f, self.store.layout.blob(f.sha256), planned))
        return snap

    def lookup(self, grant: Grant) -> Snapshot | None:
        """The cached snapshot of the granted files, or None (the store serves no file the grant leaves out)."""
        snap = self.store.lookup(grant.ref)
        return snap if snap is None or self._still_named(grant.ref, snap) else None

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
                last_report = now
            time.sleep(0.05)

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[name] += n

    # -- the fetch ----------------------------------------------------------------------------------------------
    def _fetch(self, ref: ModelRef, progress: Callable[[Progress], None] | None,
               on_file: Callable[[DurableFile], None] | None = None) -> Snapshot:
        reporter = _Reporter(ref.uri, self._progress_path(ref), progress)
        reporter.on_file = on_file
        reporter.phase("listing")
        source = self._open_source(ref)
        try:
            for attempt in range(1, MAX_RESTARTS + 1):
                try:
                    return self._fetch_once(ref, source, reporter)
                except (ObjectChangedError, BlobMissingError) as exc:
                    if attempt == MAX_RESTARTS:
                        raise
                    log.warning("restarting fetch of %s (%s)", ref, exc)
            raise AssertionError("unreachable")
        except BaseException as exc:
            reporter.phase("failed", str(exc))
            raise
        finally:
            source.close()
            self._progress_path(ref).unlink(missing_ok=True)

    def _open_source(self, ref: ModelRef) -> Source:
        if self._source_factory is not None:
            return self._source_factory(ref)
        from weightcache.sources import open_source

        return open_source(ref, SourceOptions(endpoint_url=self.endpoint_url, proxy_url=self.proxy_url,
                                              pool_size=max(10, self.concurrency * 2),
                                              connect_timeout=self.connect_timeout, read_timeout=self.read_timeout,
                                              cancel=self._closing))

    def _fetch_once(self, ref: ModelRef, source: Source, reporter: _Reporter) -> Snapshot:
        started = time.monotonic()
        # tar layers (oci://): listed as one hidden object each, downloaded and verified like any file, then
        # replaced by their members (sources/oci_tar.py); taken before peers wrap the source
        expand = source.expand
        objects = source.list()
        validate_tree(o.relpath for o in objects)
        self._check_revision(ref, source, objects)
        items = [_Item(o, o.relpath) for o in objects]
        self._expectations(ref, source, items)
        self._require_checks(ref, items)
        todo = [i for i in items if i.sha256 is None]
        total = sum(i.obj.size for i in items)
        reporter.start(total, len(items), already=total - sum(i.obj.size for i in todo),
                       files_already=len(items) - len(todo))
        if reporter.on_file is not None:
            reporter.listed(frozenset(i.relpath for i in items))
            for item in items:
                if item.sha256 is not None:  # linked from a blob on trusted evidence: synced unless unsynced_blob
                    if item.unsynced_blob:
                        self.store.sync_blob(item.sha256)
                    self._report(item, reporter)
            # small files first, and of those the index, config and tokenizer before any small shard: the pod's
            # entry point waits for them and the streaming loader plans its shards from the index, so a model of
            # small shards starts loading after its first shard, not its last
            todo.sort(key=lambda i: (i.obj.size > self.chunk_size, i.relpath.endswith(".safetensors")))
        # streaming (on_file) wants the first file whole first: its ranges sized so that it alone spreads over
        # every worker, as the workers take ranges in file order; else the model's bytes are spread
        spread = max((i.obj.size for i in todo), default=0) if reporter.on_file else sum(i.obj.size for i in todo)
        range_size = self._range_size(spread)
        partial, key = self.store.partial_dir(), ref.key  # partial/ checked once: each writer opens O_NOFOLLOW
        for item in todo:
            check = item.source_check
            item.partial = PartialFile(
                partial / f"{key}.{hashlib.sha256(item.relpath.encode()).hexdigest()[:16]}.part",
                item.obj, range_size=range_size,
                source_check=_hasher_factory(check[0]) if check and not item.expect_sha256 else None,
                journalled=item.obj.size > self.chunk_size)  # a one-chunk file has nothing to resume
        _drop_leftover_parts(partial, [_partial(i) for i in todo if not _partial(i).journalled])
        resumed = sum(_partial_size(i) for i in todo)
        if self.peers is not None and todo:
            source = self._with_peers(ref, source, todo)
        self.store.ensure_space(sum(i.obj.size for i in todo) - resumed, uri=ref.uri)
        try:
            fetched = self._download(source, todo, reporter)
        finally:  # the blobs have their names now (or the fetch failed): peers find one or nothing
            self._serve_partials(todo, False)
        reporter.phase("publishing")
        listed = [FileEntry(i.relpath, i.size, i.sha256 or "", i.obj.etag, i.obj.version_id) for i in items]
        entries = expand(listed, self.store)  # `listed` itself: none to expand
        if entries is not listed:
            validate_tree(e.path for e in entries)  # members of two layers must not collide, nor with files
        # One syncfs makes the new blobs' bytes and names durable, and those of blobs linked on a checksum alone
        # (another fetch may have named them before their bytes synced). The disk works while publish links the
        # tree (2,000 small files: ~30 ms of each, overlapped); publish waits for it before the tree is renamed
        # into place.
        unsynced = bool(todo) or entries is not listed or any(i.unsynced_blob for i in items)
        with ThreadPoolExecutor(1, thread_name_prefix="wc-syncfs") as pool:
            synced = pool.submit(sync_filesystem, self.store.layout.partial) if unsynced else None
            snap = self.store.publish(ref, entries, before_commit=synced.result if synced else None,
                                      checks=_checks_of(items, entries))
        secs = time.monotonic() - started
        log.info("fetched %s: %s from origin (%d of %d files, %s already cached) in %.1fs, %.2f GB/s",
                 ref, fmt_bytes(fetched), len(todo), len(items), fmt_bytes(total - fetched), secs,
                 fetched / secs / 1e9 if secs else 0.0)
        reporter.phase("done")
        return snap

    def _with_peers(self, ref: ModelRef, source: Source, todo: list[_Item]) -> Source:
        """Peers may serve only blobs whose sha256 we know on trusted evidence: a digest the source merely claims
        could name another model's blob, and asking peers for it would widen this node's access."""
        assert self.peers is not None
        digests: dict[str, tuple[str | OriginId, int]] = {
            i.obj.key: (i.trusted_sha256, i.obj.size) for i in todo if i.trusted_sha256}
        by_identity = {i.obj.key: (i.peer_origin, i.obj.size) for i in todo if i.peer_origin and not i.trusted_sha256}
        digests.update(by_identity)
        if len(digests) < len(todo):
            log.info("%s: %d of %d files have neither a trusted sha256 nor an origin checksum peers' bytes can be "
                     "checked against: they come from the origin only", ref, len(todo) - len(digests), len(todo))
        return self.peers.wrap(source, digests) if digests else source

    def _check_revision(self, ref: ModelRef, source: Source, objects: list[ObjectInfo]) -> None:
        """A revision that is not a cached snapshot must name the source's current content (its ETag set), unless
        the source resolved the revision itself (hf://: a branch, tag or commit of the repo)."""
        if not ref.revision or source.resolves_revision:
            return
        current = source_revision(objects)
        if not current.startswith(ref.revision) or len(ref.revision) < 6:
            raise SourceNotFoundError(
                f"revision {ref.revision!r} of {ref.uri} is neither a cached snapshot nor the source's current "
                f"content (revision {current[:12]}); use `weightcache ls` for cached snapshots, or drop @revision")

    def _expectations(self, ref: ModelRef, source: Source, items: list[_Item]) -> None:
        """Fill in what downloaded bytes must match, and link (dedup) only on trusted evidence."""
        sidecars = self._read_sidecars(source, items)
        known_here = self.store.known_sha256(ref.uri)
        by_record: list[_Item] = []
        for item in items:
            obj = item.obj
            trusted = None
            if obj.checksum and obj.checksum[0] == "sha256":  # only S3's (sources/base.py: the store's own)
                item.expect_sha256 = trusted = obj.checksum[1].lower()  # computed and verified by the store
                item.check = "sha256"
            elif obj.checksum and new_hasher(obj.checksum[0]) is not None:
                item.source_check = obj.checksum
            elif (md5 := source.etag_md5(obj)) is not None:
                item.source_check = ("md5", md5)
            if item.expect_sha256 is None and item.relpath in sidecars:
                # a claim: it checks downloaded bytes, never links
                item.expect_sha256, item.check = sidecars[item.relpath]
            recorded = known_here.get((item.relpath, obj.etag, obj.size)) if obj.etag else None
            if recorded is not None and self._blob_size(recorded) is None:
                recorded = None  # evicted since: download it (peers serve only what the bytes are checked against)
            known = trusted or recorded
            item.trusted_sha256 = known
            if known and self._blob_size(known) == obj.size:
                item.sha256, item.size = known, obj.size
                item.unsynced_blob = recorded is None  # a recorded blob was synced before its manifest
                if not trusted:
                    by_record.append(item)
        self._origin_checks(source, items)
        for item in items:
            if item.check == NO_SOURCE_CHECK and item.source_check is not None:
                item.check = _check_name(item.source_check[0])
        if by_record:  # linked on this node's own record: the check its download had
            checks = self.store.known_checks(ref.uri, [(i.relpath, i.obj.etag or "", i.obj.size) for i in by_record])
            for item in by_record:
                item.check = checks.get((item.relpath, item.obj.etag or "", item.obj.size), NO_SOURCE_CHECK)

    def _origin_checks(self, source: Source, items: list[_Item]) -> None:
        """The node's own HEAD for the origin's identity and checksum (peers/identity.py) for every file peers may
        serve, when peers are configured; and for multipart S3 objects nothing else checks, the MD5 of their part
        MD5s over the part boundaries the store gives (`S3Source.multipart_check`): the check docs/peers.md
        describes for peers' bytes, here for the origin's."""
        if self.peers is not None and self.peers.urls:
            wanted = [i for i in items if i.sha256 is None and not i.trusted_sha256]
            found = origin_evidence(source, [i.obj for i in wanted]) if wanted else {}
            for item in wanted:
                if (evidence := found.get(item.obj.key)) is not None:
                    item.peer_origin, item.source_check = evidence.oid, evidence.check
        todo = [i for i in items if i.sha256 is None and i.expect_sha256 is None and i.source_check is None
                and MULTIPART_ETAG.fullmatch(i.obj.etag or "")]
        if not todo:
            return
        with ThreadPoolExecutor(min(16, len(todo)), thread_name_prefix="s3-parts") as pool:
            for item, sizes in zip(todo, pool.map(source.multipart_check, [i.obj for i in todo]), strict=True):
                if sizes:
                    item.source_check = (COMPOSITE + ",".join(map(str, sizes)), item.obj.etag or "")

    def _require_checks(self, ref: ModelRef, items: list[_Item]) -> None:
        """requireSourceChecksum: no file whose bytes nothing from the source verifies (docs/fetch.md)."""
        unchecked = [i.relpath for i in items if i.check == NO_SOURCE_CHECK]
        if self.require_source_checksum and unchecked:
            shown = ", ".join(unchecked[:5]) + (f" and {len(unchecked) - 5} more" if len(unchecked) > 5 else "")
            raise NotAllowedError(
                f"{ref}: requireSourceChecksum refuses {len(unchecked)} file(s) that nothing from the source "
                f"verifies ({shown}): no checksum, MD5 ETag or sidecar; upload them with a checksum "
                "(aws s3 cp --checksum-algorithm SHA256), add a SHA256SUMS file, or turn the policy off")

    def _blob_size(self, sha256: str) -> int | None:
        return self.store.blob_size(sha256)

    def _read_sidecars(self, source: Source, items: list[_Item]) -> dict[str, tuple[str, str]]:
        """`<file>.sha256` ("<hex> [name]") and `SHA256SUMS` (sha256sum format) the model carries, and the digests
        the source's listing names (`claimed_sha256`: the hub's lfs.sha256, an OCI layer's digest). All claims:
        they check bytes. Path -> (sha256, the check it makes: "sha256" for the source's own, else "sidecar")."""
        out: dict[str, tuple[str, str]] = {}
        for item in items:
            if digest := source.claimed_sha256(item.obj):
                out[item.relpath] = (digest, "sha256")
        for item in items:
            name = item.relpath
            if not (name.endswith(".sha256") or name.rsplit("/", 1)[-1] == "SHA256SUMS"):
                continue
            if item.obj.size > SIDECAR_MAX:
                continue
            buf = bytearray(item.obj.size)
            source.read_into(item.obj, 0, memoryview(buf))
            text = buf.decode("utf-8", "replace")
            base = name.rsplit("/", 1)[0] + "/" if "/" in name else ""
            if name.endswith(".sha256"):
                digest = text.split()[0].lower() if text.split() else ""
                if re.fullmatch(r"[0-9a-f]{64}", digest):
                    out.setdefault(name[: -len(".sha256")], (digest, "sidecar"))  # the listing's own claim first
            else:
                for line in text.splitlines():
                    m = re.fullmatch(r"([0-9a-fA-F]{64})\s+\*?(?:\./)?(.+)", line.strip())
                    if m:
                        out.setdefault(base + m.group(2), (m.group(1).lower(), "sidecar"))
        return out

    def _download(self, source: Source, todo: list[_Item], reporter: _Reporter) -> int:
        """Download every item; a file failing verification is refetched once. Returns origin bytes."""
        fetched = 0
        pending = todo
        try:
            for round_ in (1, 2):
                with self.store.blob_writer() as blobs:
                    fetched += self._download_round(source, pending, reporter, blobs)
                failed = []
                for item in pending:
                    if item.reported:  # finished, verified and made a blob in the round (_durable)
                        reporter.add(0, 1)
                        continue
                    try:
                        self._finish(item, source)
                        reporter.add(0, 1)
                    except IntegrityError as exc:
                        if round_ == 2:
                            raise
                        log.warning("%s; refetching %s", exc, item.relpath)
                        source.verification_failed(item.obj)
                        self._serve_partials([item], False)  # peers must not read what is discarded now
                        _partial(item).discard()
                        reporter.add(-item.obj.size, 0)
                        failed.append(item)
                if not failed:
                    break
                pending = failed
        except (KeyboardInterrupt, FetchCancelledError):
            raise  # stop now: a syncfs could take seconds; journalled files resume, small ones are refetched
        except BaseException:  # verified files become blobs even when another file failed: a rerun reuses them
            verified = [i for i in todo if i.sha256]
            self._add_blobs(verified)
            if verified:
                sync_filesystem(self.store.layout.partial)
            raise
        self._add_blobs(todo)  # the syncfs that makes them durable runs while publish links the tree
        return fetched

    def _durable(self, item: _Item, source: Source, reporter: _Reporter) -> None:
        """on_file's file finished in the round: verified and made a blob now, durable by its own fsyncs (the
        file, its blob directory) rather than the model's syncfs, and handed over. One that fails verification
        or its header check is left to the round's end, which refetches or refuses it as without on_file."""
        if not reporter.claim(item):  # the worker that hashed the last bytes, or another that saw it done
            return
        try:
            self._finish(item, source)
        except IntegrityError:
            reporter.unclaim(item)
            return
        except SafetensorsHeaderError as exc:
            item.header_error = exc  # _finish discarded it; the round's end raises this
            reporter.unclaim(item)
            return
        sha = item.sha256 or ""
        self._serve_partials([item], False)  # the part is moving: peers find the blob instead
        if item.in_blob:
            self.store.sync_blob(sha)
        else:
            self.store.add_blob(_partial(item).part, sha, durable=True)
            if _partial(item).journalled:
                _partial(item).journal.unlink(missing_ok=True)
        item.reported = True
        self._report(item, reporter)

    def _report(self, item: _Item, reporter: _Reporter) -> None:
        if reporter.on_file is not None and item.sha256:
            entry = FileEntry(item.relpath, item.size, item.sha256, item.obj.etag, item.obj.version_id)
            reporter.on_file(DurableFile(entry, self.store.layout.blob(item.sha256), reporter.planned))

    def _serve_partials(self, items: list[_Item], serve: bool) -> None:
        """Let this node's peer server read the journalled ranges of these downloads (trusted digests only)."""
        if self.peers is None:
            return
        for item in items:
            name = item.trusted_sha256 or (item.peer_origin.address if item.peer_origin else None)
            if name and item.partial is not None:
                if serve:
                    self.peers.inflight.add(name, item.partial)
                else:
                    self.peers.inflight.remove(name, item.partial)

    def _add_blobs(self, items: list[_Item]) -> None:
        """Verified files become blobs with syncfs calls instead of three fsyncs each (2,000 small files: seconds
        -> tens of ms). Whole small files are in their blobs already (store/blobwrite.py). Parts move to their
        blobs once a syncfs made their data durable (before a moved name promises it). The caller's syncfs, last,
        makes the new names (and the small files' bytes) durable."""
        parts = [item for item in items if not item.in_blob and not item.reported]
        if not parts:
            return
        sync_filesystem(self.store.layout.partial)
        self.store.add_blobs(((_partial(item).part, item.sha256 or "") for item in parts), durable=False)
        for item in parts:
            if _partial(item).journalled:
                _partial(item).journal.unlink(missing_ok=True)

    def _download_round(self, source: Source, items: list[_Item], reporter: _Reporter, blobs: BlobWriter) -> int:
        pieces: list[tuple[_Item, int, int]] = []
        try:
            for item in items:
                missing = _partial(item).open()
                pieces += [(item, off, n) for off, n in missing]
        except OSError as exc:
            self._discard_all(items)
            raise _space_error(exc, items, self.store) from exc
        reporter.add(sum(_partial(i).resumed_bytes for i in items), 0)
        self._serve_partials(items, True)
        # peers: nodes started together fetch different ranges first
        pieces = source.spread(_finer(pieces, source.nodes, min(PIECE, self.chunk_size)),
                               lambda p: (p[0].obj.key, p[1]))
        local = threading.local()
        abort = threading.Event()
        peer_before = source.peer_bytes
        fetched = 0
        fetched_lock = threading.Lock()
        # a worker's buffer: a whole small file, or one piece of a large one (download.PIECE: written, journalled
        # and hashed while still in the core's cache); bytearray() writes every byte, so never more than needed
        piece = min(PIECE, self.chunk_size)
        journalled = any(_partial(i).journalled for i in items)
        buf_size = max(64 << 10, piece if journalled else 0,
                       min(self.chunk_size, max((n for i, _, n in pieces if not _partial(i).journalled), default=0)))
        # scratch re-reads what waits to be hashed, a piece at a time: only journalled (large) files have any
        scratch_size = piece if journalled else 64 << 10

        def buffers() -> tuple[memoryview, memoryview]:
            if not hasattr(local, "buf"):
                local.buf = memoryview(bytearray(buf_size))
                local.scratch = memoryview(bytearray(scratch_size))
            return local.buf, local.scratch

        def check_cancel() -> None:
            if abort.is_set() or self._closing.is_set():
                raise FetchCancelledError("fetch cancelled; finished chunks are kept and resume on the next run")

        def arrived(n: int) -> None:
            """Bytes as each read() returns them: progress moves on a slow origin, and a cancel lands at once."""
            nonlocal fetched
            check_cancel()
            with fetched_lock:
                fetched += n
            reporter.add(n, 0)

        reading = _Reading(piece)

        def run(item: _Item, offset: int, length: int) -> None:
            buf, scratch = buffers()
            check_cancel()
            part = _partial(item)
            into = buf[:piece] if part.journalled else buf
            entry = reading.begin(item, offset, offset + length) if part.journalled else None
            end = offset + length
            try:
                with closing(source.read_pieces(item.obj, offset, length, into, arrived)) as pieces:
                    for pos, view in pieces:
                        if part.journalled or pos or len(view) != item.obj.size or not blobs.usable:
                            part.write(pos, view, scratch)
                        else:
                            self._write_whole(item, view, source, blobs)
                        if entry is not None and not reading.advanced(entry, pos + len(view)):
                            break  # an idle worker took the rest of this range (it stalled)
            except Later as later:  # its bytes are on their way to a peer: another range first, this one again soon
                if entry is not None:
                    end = reading.end(entry)
                    entry = None
                deferred.append((time.monotonic() + LATER_S, functools.partial(run, item, later.pos, end - later.pos)))
            finally:
                if entry is not None:
                    reading.end(entry)
            if reporter.on_file is not None and part.complete:  # the file's last bytes are hashed: hand it over
                self._durable(item, source, reporter)

        def hash_resumed(item: _Item) -> None:
            _partial(item).hash_resumed(buffers()[1])
            if reporter.on_file is not None and _partial(item).complete:
                self._durable(item, source, reporter)

        queue: deque[Callable[[], None]] = deque([
            *(functools.partial(hash_resumed, i) for i in items if _partial(i).resumed_bytes),
            *(functools.partial(run, *p) for p in pieces)])
        # (when, task): ranges a peer is still fetching from the origin (Later), taken again from `when`
        deferred: deque[tuple[float, Callable[[], None]]] = deque()
        source.defer_while(lambda: bool(queue) or len(deferred) > 1)

        def next_task() -> Callable[[], None] | None:
            """A deferred range whose wait is over, else the next in order; popleft hands each to one thread."""
            with suppress(IndexError):
                if deferred[0][0] <= time.monotonic() or not queue:
                    when, task = deferred.popleft()
                    if when > time.monotonic():
                        time.sleep(when - time.monotonic())
                    return task
            with suppress(IndexError):
                return queue.popleft()
            return None

        def worker() -> None:
            """Take the next task until none is left or the round aborts: one future per worker, not per
            piece (2,000 small files: no future, condition and queue hand-off each)."""
            while (task := next_task()) is not None:
                if abort.is_set():
                    return
                task()
            while not abort.is_set() and reading.busy():  # no task left: take over the back of a stalled range
                taken = reading.split()
                if taken is not None:
                    run(*taken)
                elif abort.wait(0.05):
                    return
                check_cancel()

        workers = self._workers(source, [*(_partial(i).resumed_bytes for i in items if _partial(i).resumed_bytes),
                                         *(n for _, _, n in pieces)])
        try:
            with ThreadPoolExecutor(workers, thread_name_prefix="wc-fetch") as pool:
                futures = [pool.submit(worker) for _ in range(workers)]
                try:
                    done, not_done = wait(futures, return_when=FIRST_EXCEPTION)
                except BaseException:  # KeyboardInterrupt in the main thread: stop the workers, keep the journal
                    abort.set()
                    for f in futures:
                        f.cancel()
                    raise
                errors = [e for f in done if (e := f.exception()) is not None]
                if errors:
                    abort.set()
                    for f in not_done:
                        f.cancel()
                    wait(not_done)
                    self._handle_failure(errors[0], items)
        finally:
            peer = source.peer_bytes - peer_before
            with fetched_lock:
                fetched -= peer
                self._count("origin_bytes", fetched)  # bytes of a failed round came from the origin all the same
                self._count("peer_bytes", peer)
        return fetched

    def _workers(self, source: Source, task_bytes: list[int]) -> int:
        """Threads hide request latency. A local source's reads are system calls with none to hide, and each
        call hands the GIL to another thread and back: 2,000 files of 4 KB took 180 ms on 8 workers, 100 ms on
        one. So a local round gets one worker per large task (disk reads and hashing of those overlap; a resumed
        file's hashing is a task too), up to `concurrency`, and one for all the small ones."""
        if not source.local:
            return max(1, min(self.concurrency, len(task_bytes)))
        large = sum(1 for n in task_bytes if n >= LOCAL_LARGE_PIECE)
        return max(1, min(self.concurrency, len(task_bytes), large))

    def _range_size(self, total: int) -> int:
        """Bytes per request, in whole chunks, at most 256 MiB: about two per worker (one that drew a slow
        connection leaves the rest to the queue), but MIN_RANGE_CHUNKS chunks or more as long as every worker
        still gets one: each request waits a first byte (at 100 MB/s per connection a 30 ms wait is 15% of a
        16 MiB request, 4% of a 64 MiB one) and some servers re-read the whole object per GET. Memory and
        retries do not grow with it: a range streams through one piece, and a failure resumes from its first
        missing piece."""
        one_each = -(-total // self.concurrency)
        size = max(min(MIN_RANGE_CHUNKS * self.chunk_size, one_each), -(-one_each // 2))
        return max(1, -(-min(256 << 20, size) // self.chunk_size)) * self.chunk_size

    def _handle_failure(self, exc: BaseException, items: list[_Item]) -> None:
        for item in items:
            _partial(item).close()
        if isinstance(exc, ObjectChangedError):
            self._discard_all(items)  # restart from a fresh listing; never a body mixed from two versions
            raise exc
        if isinstance(exc, OSError) and exc.errno in (28, 122):
            self._discard_all(items)
            raise _space_error(exc, items, self.store) from exc
        raise exc

    @staticmethod
    def _discard_all(items: list[_Item]) -> None:
        for item in items:
            if item.partial is not None:
                item.partial.discard()

    def _write_whole(self, item: _Item, data: memoryview, source: Source, blobs: BlobWriter) -> None:
        """A file read whole in one request: hashed from the worker's buffer, so its digest is known before any
        byte is written; verified, it goes straight to its blob (store/blobwrite.py), else to a part as before.
        A file failing verification is not written at all: _finish says why and it is fetched again. One failing
        its header check is not written either: _finish raises that refusal after the round, while the other
        files of the round become blobs for a rerun."""
        part = _partial(item)
        part.hash_whole(data)
        try:
            sha = _verified(item, source)
        except IntegrityError:
            return
        check = functools.partial(_check_header, item) if item.relpath.endswith(".safetensors") else None
        try:
            item.in_blob = blobs.write(sha, data, check)
        except SafetensorsHeaderError as exc:
            item.header_error = exc
            return
        if item.in_blob:
            item.sha256 = sha  # verified: _finish need not hash-compare it again
        else:
            part.write_whole_part(data)

    def _finish(self, item: _Item, source: Source) -> None:
        """Verify a fully downloaded file, validate safetensors headers, move it into blobs/."""
        part = _partial(item)
        if item.header_error is not None:  # refused before it was named: never checked (nor its workers run) twice
            part.discard()
            raise item.header_error
        if not part.complete:
            part.hash_resumed(memoryview(bytearray(4 << 20)))
        sha = item.sha256 if item.in_blob and item.sha256 else _verified(item, source)  # in_blob: verified already
        if item.relpath.endswith(".safetensors") and not item.in_blob:  # in_blob: checked before it was named
            try:
                _check_header(item, part.part)
            except SafetensorsHeaderError:
                part.discard()  # a retry must not find it and check it again
                raise
        item.size = part.written_size()
        part.close()
        item.sha256 = sha  # _add_blobs moves it into blobs/ once every file is verified


class _Reading:
    """The ranges of large files being read, so that a worker with no task left can halve a stalled one: a range
    without a piece for SPLIT_STALL seconds (5x that before its first) loses its back half, aligned to its pieces,
    to that worker, and its owner stops where the half begins (its own request goes on being retried). A slow
    origin then costs one range's front, not the fetch's tail; the journal, hashing and resume take the halves as
    any other pieces."""

    def __init__(self, piece: int) -> None:
        self.piece = piece
        self._mu = threading.Lock()
        self._ranges: dict[int, list[typing.Any]] = {}  # id -> [item, next byte, end, last progress, pieces seen]

    def begin(self, item: _Item, start: int, end: int) -> list[typing.Any]:
        entry = [item, start, end, time.monotonic(), False]
        with self._mu:
            self._ranges[id(entry)] = entry
        return entry

    def advanced(self, entry: list[typing.Any], pos: int) -> bool:
        """The owner wrote up to `pos`: False when the rest is another worker's now."""
        with self._mu:
            entry[1], entry[3], entry[4] = pos, time.monotonic(), True
            return bool(pos < entry[2])

    def end(self, entry: list[typing.Any]) -> int:
        """The range is done with; returns where it ends now (an idle worker may have taken its back half)."""
        with self._mu:
            self._ranges.pop(id(entry), None)
            return int(entry[2])

    def busy(self) -> bool:
        with self._mu:
            return bool(self._ranges)

    def split(self) -> tuple[_Item, int, int] | None:
        """The back half of the stalled range with the most bytes left, or None."""
        now = time.monotonic()
        with self._mu:
            stalled = [e for e in self._ranges.values() if e[2] - e[1] - self.piece >= SPLIT_MIN
                       and now - e[3] > (SPLIT_STALL if e[4] else 5 * SPLIT_STALL)]
            if not stalled:
                return None
            entry = max(stalled, key=lambda e: e[2] - e[1])
            item, nxt, end = entry[0], entry[1], entry[2]
            first = nxt + self.piece  # the piece in flight stays the owner's
            mid = first + (end - first) // 2 // self.piece * self.piece
            entry[2] = mid
        log.info("%s: bytes %d-%d stalled; reading %d-%d on another connection", item.relpath, nxt, end - 1,
                 mid, end - 1)
        return item, mid, end - mid


def _finer(pieces: list[tuple[_Item, int, int]], nodes: int, piece: int) -> list[tuple[_Item, int, int]]:
    """A fleet's ranges: the journalled files' ranges cut, on `piece` boundaries, so that each of `nodes` nodes
    owns about FLEET_RANGES_PER_NODE of them (PeerSource.spread), none below FLEET_MIN_PIECES pieces. With 8 ranges and
    16 nodes, two nodes owned each range and both read it from the origin; and a node reading one large range
    from the origin serves it to the others at that one connection's pace."""
    if nodes <= 1:
        return pieces
    total = sum(n for item, _, n in pieces if _partial(item).journalled)
    size = max(FLEET_MIN_PIECES, -(-total // (nodes * FLEET_RANGES_PER_NODE) // piece)) * piece
    out = []
    for item, off, n in pieces:
        if not _partial(item).journalled or n <= size:
            out.append((item, off, n))
            continue
        out += [(item, at, min(size, off + n - at)) for at in range(off, off + n, size)]
    return out


def _verified(item: _Item, source: Source) -> str:
    """The sha256 of a fully hashed download once it matches what it must (IntegrityError when not)."""
    part = _partial(item)
    sha = part.sha256.hexdigest()
    if item.expect_sha256 and sha != item.expect_sha256:
        raise IntegrityError(f"{item.relpath}: sha256 {sha} does not match the expected {item.expect_sha256}")
    if item.source_check is not None and part.source_check is not None:
        algorithm, want = item.source_check
        if algorithm == "md5":  # a GET may have shown SSE-KMS/SSE-C since planning: then the ETag is no MD5
            want = source.etag_md5(item.obj) or ""
            if not want:
                item.check = NO_SOURCE_CHECK
        got = part.source_check.hexdigest()
        if want and want not in got.split():  # a multipart ETag of inferred part sizes: one digest each
            hint = (" (the store does not say its part size; parts of another size than these would differ too)"
                    if "," in algorithm else "")
            raise IntegrityError(f"{item.relpath}: {algorithm} {got} does not match the source's {want}{hint}")
    return sha


def _check_name(algorithm: str) -> str:
    """The manifest's name (vocabulary.SOURCE_CHECKS) for a source check's algorithm."""
    if algorithm == "md5":
        return "md5-etag"
    return "multipart-md5" if algorithm.startswith(COMPOSITE) else algorithm  # crc32, crc32c, crc64nvme


def _checks_of(items: list[_Item], entries: list[FileEntry]) -> dict[str, str]:
    """Each published file's check: its item's, or for a tar layer's member (oci://) its layer's, by the layer
    digest both carry as their etag."""
    by_path = {i.relpath: i.check for i in items}
    by_etag = {i.obj.etag: i.check for i in items if i.obj.etag}
    return {e.path: by_path.get(e.path) or by_etag.get(e.etag or "") or NO_SOURCE_CHECK for e in entries}


def _check_header(item: _Item, path: str | Path) -> None:
    """The safetensors header check of a downloaded file, read through `path` (a part, or /proc/self/fd/N of an
    unnamed blob), naming the file of the model: the check names what it read, a name that means nothing to the
    user, so that name is dropped from its message."""
    from weightcache.safetensors_check import check_file

    try:
        check_file(path)
    except SafetensorsHeaderError as exc:
        problem = str(exc).removeprefix(f"{Path(path).name}: ")
        raise SafetensorsHeaderError(f"{item.relpath}: {problem}; the model at the source is damaged or not "
                                     f"safetensors: fix or exclude that file") from exc


def source_revision(objects: list[ObjectInfo]) -> str:
    """A digest of the source's current listing (path, size, ETag/version): names 'this content' for @revision."""
    h = hashlib.sha256()
    for o in sorted(objects, key=lambda o: o.relpath):
        h.update(f"{o.relpath}\0{o.size}\0{o.etag or ''}\0{o.version_id or ''}\n".encode())
    return h.hexdigest()


def _partial(item: _Item) -> PartialFile:
    if item.partial is None:
        raise AssertionError(f"{item.relpath} has no partial download")  # only items to download get one
    return item.partial


class _AnyPartSize:
    """The multipart ETag over each candidate part size at once (a store that does not say its part size):
    hexdigest() is every candidate's digest, space-separated; one matching the ETag passes (_verified)."""

    def __init__(self, sizes: list[int]) -> None:
        self._each = [CompositeMD5(size) for size in sizes]

    def update(self, data: bytes | memoryview) -> None:
        for hasher in self._each:
            hasher.update(data)

    def hexdigest(self) -> str:
        return " ".join(h.hexdigest() for h in self._each)


def _hasher_factory(algorithm: str) -> Callable[[], Hasher]:
    if algorithm == "md5":
        return lambda: hashlib.md5(usedforsecurity=False)
    if algorithm.startswith(COMPOSITE) and "," in algorithm:
        sizes = [int(size) for size in algorithm[len(COMPOSITE):].split(",")]
        return lambda: _AnyPartSize(sizes)
    if (composite := composite_factory(algorithm)) is not None:  # a multipart ETag of uniform parts
        return composite
    return lambda: new_hasher(algorithm) or hashlib.sha256()  # _expectations keeps only computable ones


def _drop_leftover_parts(partial: Path, started_over: list[PartialFile]) -> None:
    """A one-request file is started over, so a part or journal an earlier run left at its name (a crash, or a
    smaller chunk size then) is removed before a peer can open it as this download in flight. One listing of
    partial/ rather than an unlink per file: most small files find nothing."""
    names = {n for n in os.listdir(partial) if n.endswith((".part", ".journal"))} if started_over else set()
    if not names:  # the usual case: no Path built per file
        return
    for part in started_over:
        for path in (part.part, part.journal):
            if path.name in names:
                path.unlink(missing_ok=True)


def _partial_size(item: _Item) -> int:
    if not _partial(item).journalled:
        return 0  # started over: nothing of it is kept
    try:
        return _partial(item).part.stat().st_size if _partial(item).journal.exists() else 0
    except FileNotFoundError:
        return 0


def _space_error(exc: OSError, items: list[_Item], store: Store) -> InsufficientSpaceError:
    """The store checked its floor before the download: a full disk now is another writer's doing (or a budget
    above what the disk holds)."""
    need = sum(i.obj.size for i in items)
    return InsufficientSpaceError(f"disk full while fetching ({exc.strerror}); the model needs {fmt_bytes(need)}; "
                                  f"{full_disk_advice(store.root)}")


class _Reporter:
    """Aggregates byte counts from workers; calls the callback at most 5x/s and rewrites the progress file."""

    def __init__(self, uri: str, path: Path, callback: Callable[[Progress], None] | None) -> None:
        self.uri, self.path, self.callback = uri, path, callback
        self._mu = threading.Lock()
        self.done = self.total = self.files_done = self.files_total = 0
        self._phase = "queued"
        self._rate = RateMeter()
        self._last = 0.0
        self.on_file: Callable[[DurableFile], None] | None = None  # Fetcher.ensure's: files as they are durable
        self.planned: frozenset[str] = frozenset()
        self._claimed: set[int] = set()

    def listed(self, planned: frozenset[str]) -> None:
        """A new listing (a restart's too): its files, and no claims (an old item's id may be a new one's)."""
        with self._mu:
            self.planned = planned
            self._claimed.clear()

    def claim(self, item: _Item) -> bool:
        """True for the one caller that hands `item` over (several workers may see it complete)."""
        with self._mu:
            if item.reported or id(item) in self._claimed:
                return False
            self._claimed.add(id(item))
            return True

    def unclaim(self, item: _Item) -> None:
        with self._mu:
            self._claimed.discard(id(item))

    def start(self, total: int, files: int, *, already: int, files_already: int) -> None:
        with self._mu:
            self.total, self.files_total = total, files
            self.done, self.files_done = already, files_already
            self._phase = "downloading"
        self._emit(force=True)

    def add(self, nbytes: int, nfiles: int) -> None:
        with self._mu:
            self.done += nbytes
            self.files_done += nfiles
            if time.monotonic() - self._last < 0.2:  # most calls (one per small file): nothing to emit
                return
        self._emit()

    def phase(self, phase: str, message: str = "") -> None:
        with self._mu:
            self._phase = phase
            if phase == "done":
                self.done, self.files_done = self.total, self.files_total
        self._emit(force=True, message=message)

    def _emit(self, *, force: bool = False, message: str = "") -> None:
        now = time.monotonic()
        with self._mu:
            if not force and now - self._last < 0.2:
                return
            self._last = now
            rate = self._rate.update(self.done, now)
            eta = (self.total - self.done) / rate if rate > 0 else None
            p = Progress(self.uri, self._phase, self.done, self.total, self.files_done, self.files_total, rate, eta,
                         message)
        if self._phase not in ("done", "failed"):
            with suppress(OSError):  # progress is advisory; a full disk must not fail the fetch
                write_progress_file(self.path, p)
        if self.callback is not None:
            self.callback(p)
