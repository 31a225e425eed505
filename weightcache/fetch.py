"""Fetch engine: a reference becomes a published snapshot. list -> plan -> download missing blobs -> verify -> publish.

Single flight: one flock per model (`locks/<model-key>.lock`) serialises fetches of a model across threads and
processes alike (flock belongs to an open file description, so two threads conflict like two processes). Waiters
poll it, show the holder's progress file, and find the published snapshot when it is released.
Dedup: a file is not downloaded when its content is already a blob (known by a checksum, a sidecar, or an earlier
snapshot of the same model with the same ETag and size).
Memory stays bounded: each worker owns one reusable chunk buffer; bodies stream to disk, never to RAM.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from weightcache import defaults
from weightcache.download import PartialFile
from weightcache.errors import (InsufficientSpaceError, IntegrityError, ObjectChangedError, SafetensorsHeaderError,
                                SourceNotFoundError, StoreError, WeightcacheError)
from weightcache.progress import Progress, RateMeter, read_progress_file, write_progress_file
from weightcache.store import FileEntry, Snapshot, Store
from weightcache.store.paths import validate_tree
from weightcache.store.store import BlobMissingError
from weightcache.sources import ObjectInfo, Source
from weightcache.units import fmt_bytes
from weightcache.uri import ModelRef

log = logging.getLogger(__name__)

__all__ = ["FetchCancelledError", "Fetcher", "Progress"]

SIDECAR_MAX = 1 << 20
MAX_RESTARTS = 3  # object replaced mid-download, or a planned blob evicted meanwhile


class FetchCancelledError(StoreError):
    """The fetcher is shutting down; partial downloads are kept and resume on the next run."""


@dataclass
class _Item:
    """One object to fetch and what we expect of it."""

    obj: ObjectInfo
    relpath: str
    expect_sha256: str | None = None
    expect_md5: str | None = None
    sha256: str | None = None  # known without download (dedup) or computed
    partial: PartialFile | None = field(default=None, repr=False)


class Fetcher:
    """ensure(ref) -> Snapshot, single-flight in process (threads) and across processes (flock)."""

    def __init__(self, store: Store, *, concurrency: int = defaults.CONCURRENCY, chunk_size: int = defaults.CHUNK_SIZE,
                 endpoint_url: str | None = None,
                 source_factory: Callable[[ModelRef], Source] | None = None) -> None:
        self.store = store
        self.concurrency = max(1, concurrency)
        self.chunk_size = max(64 << 10, chunk_size)
        self.endpoint_url = endpoint_url
        self._source_factory = source_factory
        self._closing = threading.Event()
        self._stats_lock = threading.Lock()
        self.stats: dict[str, int] = {"hits": 0, "misses": 0, "origin_bytes": 0, "fetches_in_flight": 0}
        self.origin_bytes_by_scheme: dict[str, int] = {}

    # -- public -------------------------------------------------------------------------------------------------
    def ensure(self, ref: ModelRef, *, progress: Callable[[Progress], None] | None = None) -> Snapshot:
        """Blocking; call from a thread in async code. Cache hit returns at once."""
        snap = self.store.lookup(ref)
        if snap is not None:
            self._count("hits")
            return snap
        lock_fd = self._acquire(ref, progress)
        try:
            snap = self.store.lookup(ref)
            if snap is not None:
                self._count("hits")
                return snap
            self._count("misses")
            self._count("fetches_in_flight")
            try:
                return self._fetch(ref, progress)
            finally:
                self._count("fetches_in_flight", -1)
        finally:
            os.close(lock_fd)

    def progress(self, ref: ModelRef) -> Progress | None:
        """Progress of an in-flight fetch of `ref` (in this process, or another's via the store), else None."""
        if not self._lock_held(ref):
            return None
        return read_progress_file(self._progress_path(ref)) or Progress(ref.uri, "queued", 0, 0, 0, 0, 0.0, None)

    def close(self) -> None:
        """Stop: in-flight downloads end at their next chunk, resumable."""
        self._closing.set()

    # -- locking ------------------------------------------------------------------------------------------------
    def _progress_path(self, ref: ModelRef) -> Path:
        return self.store.layout.partial / f"{ref.key}.progress"

    def _lock_held(self, ref: ModelRef) -> bool:
        fd = os.open(self.store.layout.lock(ref.key), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def _acquire(self, ref: ModelRef, progress: Callable[[Progress], None] | None) -> int:
        fd = os.open(self.store.layout.lock(ref.key), os.O_RDWR | os.O_CREAT, 0o644)
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
    def _fetch(self, ref: ModelRef, progress: Callable[[Progress], None] | None) -> Snapshot:
        reporter = _Reporter(ref.uri, self._progress_path(ref), progress)
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

        return open_source(ref, endpoint_url=self.endpoint_url, pool_size=max(10, self.concurrency * 2))

    def _fetch_once(self, ref: ModelRef, source: Source, reporter: _Reporter) -> Snapshot:
        started = time.monotonic()
        objects = source.list()
        validate_tree(o.relpath for o in objects)
        self._check_revision(ref, objects)
        items = [_Item(o, o.relpath) for o in objects]
        self._expectations(ref, source, items)
        todo = [i for i in items if i.sha256 is None]
        total = sum(i.obj.size for i in items)
        reporter.start(total, len(items), already=total - sum(i.obj.size for i in todo),
                       files_already=len(items) - len(todo))
        range_size = self._range_size(sum(i.obj.size for i in todo))
        for item in todo:
            item.partial = PartialFile(
                self.store.layout.partial / f"{ref.key}.{hashlib.sha256(item.relpath.encode()).hexdigest()[:16]}.part",
                item.obj, range_size=range_size, want_md5=item.expect_md5 is not None)
        resumed = sum(_partial_size(i) for i in todo)
        self.store.ensure_space(sum(i.obj.size for i in todo) - resumed, uri=ref.uri)
        fetched = self._download(source, todo, reporter)
        reporter.phase("publishing")
        entries = [FileEntry(i.relpath, i.obj.size, i.sha256 or "", i.obj.etag, i.obj.version_id) for i in items]
        snap = self.store.publish(ref, entries)
        secs = time.monotonic() - started
        log.info("fetched %s: %s from origin (%d of %d files, %s already cached) in %.1fs, %.2f GB/s",
                 ref, fmt_bytes(fetched), len(todo), len(items), fmt_bytes(total - fetched), secs,
                 fetched / secs / 1e9 if secs else 0.0)
        reporter.phase("done")
        return snap

    def _check_revision(self, ref: ModelRef, objects: list[ObjectInfo]) -> None:
        """A revision that is not a cached snapshot must name the source's current content (its ETag set)."""
        if not ref.revision:
            return
        current = source_revision(objects)
        if not current.startswith(ref.revision) or len(ref.revision) < 6:
            raise SourceNotFoundError(
                f"revision {ref.revision!r} of {ref.uri} is neither a cached snapshot nor the source's current "
                f"content (revision {current[:12]}); use `weightcache ls` for cached snapshots, or drop @revision")

    def _expectations(self, ref: ModelRef, source: Source, items: list[_Item]) -> None:
        """Fill in expected digests (source checksum, sidecars, MD5 ETag) and dedup hits."""
        sidecars = self._read_sidecars(source, items)
        for item in items:
            obj = item.obj
            if obj.checksum and obj.checksum[0] == "sha256":
                item.expect_sha256 = obj.checksum[1].lower()
            elif item.relpath in sidecars:
                item.expect_sha256 = sidecars[item.relpath]
            if (source.name == "s3" and obj.etag and re.fullmatch(r"[0-9a-f]{32}", obj.etag)
                    and item.expect_sha256 is None):
                item.expect_md5 = obj.etag
            known = item.expect_sha256 or self.store.known_sha256(ref.uri, item.relpath, obj.etag, obj.size)
            if known and self.store.has_blob(known):
                item.sha256 = known

    def _read_sidecars(self, source: Source, items: list[_Item]) -> dict[str, str]:
        """`<file>.sha256` ("<hex> [name]") and `SHA256SUMS` (sha256sum format) the model carries."""
        out: dict[str, str] = {}
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
                    out[name[: -len(".sha256")]] = digest
            else:
                for line in text.splitlines():
                    m = re.fullmatch(r"([0-9a-fA-F]{64})\s+\*?(?:\./)?(.+)", line.strip())
                    if m:
                        out[base + m.group(2)] = m.group(1).lower()
        return out

    def _download(self, source: Source, todo: list[_Item], reporter: _Reporter) -> int:
        """Download every item; a file failing verification is refetched once. Returns origin bytes."""
        fetched = 0
        pending = todo
        for round_ in (1, 2):
            fetched += self._download_round(source, pending, reporter)
            failed = []
            for item in pending:
                try:
                    self._finish(item)
                    reporter.add(0, 1)
                except IntegrityError as exc:
                    if round_ == 2:
                        raise
                    log.warning("%s; refetching %s", exc, item.relpath)
                    item.partial.discard()
                    reporter.add(-item.obj.size, 0)
                    failed.append(item)
            if not failed:
                break
            pending = failed
        return fetched

    def _download_round(self, source: Source, items: list[_Item], reporter: _Reporter) -> int:
        pieces: list[tuple[_Item, int, int]] = []
        try:
            for item in items:
                missing = item.partial.open()
                reporter.add(item.partial.resumed_bytes, 0)
                pieces += [(item, off, n) for off, n in missing]
        except OSError as exc:
            self._discard_all(items)
            raise _space_error(exc, items) from exc
        local = threading.local()
        abort = threading.Event()
        fetched = 0
        fetched_lock = threading.Lock()

        def buffers() -> tuple[memoryview, memoryview]:
            if not hasattr(local, "buf"):
                local.buf = memoryview(bytearray(self.chunk_size))
                local.scratch = memoryview(bytearray(min(self.chunk_size, 4 << 20)))
            return local.buf, local.scratch

        def run(item: _Item, offset: int, length: int) -> None:
            nonlocal fetched
            buf, scratch = buffers()
            with closing(source.read_pieces(item.obj, offset, length, buf)) as pieces:
                for pos, view in pieces:
                    item.partial.write(pos, view, scratch)
                    with fetched_lock:
                        fetched += len(view)
                    reporter.add(len(view), 0)
                    if abort.is_set() or self._closing.is_set():
                        raise FetchCancelledError("fetch cancelled; finished chunks are kept and resume next run")

        def hash_resumed(item: _Item) -> None:
            item.partial.hash_resumed(buffers()[1])

        try:
            with ThreadPoolExecutor(self.concurrency, thread_name_prefix="wc-fetch") as pool:
                futures = [pool.submit(hash_resumed, i) for i in items if i.partial.resumed_bytes]
                futures += [pool.submit(run, *p) for p in pieces]
                done, not_done = wait(futures, return_when=FIRST_EXCEPTION)
                errors = [f.exception() for f in done if f.exception() is not None]
                if errors:
                    abort.set()
                    for f in not_done:
                        f.cancel()
                    wait(not_done)
                    self._handle_failure(errors[0], items)
        finally:
            with fetched_lock:
                self._count("origin_bytes", fetched)  # bytes of a failed round came from the origin all the same
        return fetched

    def _range_size(self, total: int) -> int:
        """Bytes per request: enough requests to keep every worker busy, few enough that per-request cost (and
        servers that re-read an object per GET) stays small; always whole chunks, at most 256 MiB."""
        per_worker = -(-total // (2 * self.concurrency))
        chunks = max(1, min(256 << 20, per_worker) // self.chunk_size)
        return chunks * self.chunk_size

    def _handle_failure(self, exc: BaseException, items: list[_Item]) -> None:
        for item in items:
            item.partial.close()
        if isinstance(exc, ObjectChangedError):
            self._discard_all(items)  # restart from a fresh listing; never a body mixed from two versions
            raise exc
        if isinstance(exc, OSError) and exc.errno in (28, 122) and not isinstance(exc, WeightcacheError):
            self._discard_all(items)
            raise _space_error(exc, items) from exc
        raise exc

    @staticmethod
    def _discard_all(items: list[_Item]) -> None:
        for item in items:
            if item.partial is not None:
                item.partial.discard()

    def _finish(self, item: _Item) -> None:
        """Verify a fully downloaded file, validate safetensors headers, move it into blobs/."""
        part = item.partial
        if not part.complete:
            part.hash_resumed(memoryview(bytearray(4 << 20)))
        sha = part.sha256.hexdigest()
        if item.expect_sha256 and sha != item.expect_sha256:
            raise IntegrityError(f"{item.relpath}: sha256 {sha} does not match the expected {item.expect_sha256}")
        if item.expect_md5 and part.md5 is not None and part.md5.hexdigest() != item.expect_md5:
            raise IntegrityError(f"{item.relpath}: MD5 does not match the object's ETag {item.expect_md5}")
        if item.relpath.endswith(".safetensors"):
            from weightcache.safetensors_check import check_file

            try:
                check_file(part.part)
            except SafetensorsHeaderError as exc:
                part.discard()
                raise SafetensorsHeaderError(f"{item.relpath}: {exc}; the model at the source is damaged or "
                                             f"not safetensors: fix or exclude that file") from exc
        part.fsync()
        part.close()
        item.partial.journal.unlink(missing_ok=True)
        self.store.add_blob(part.part, sha)
        item.sha256 = sha


def source_revision(objects: list[ObjectInfo]) -> str:
    """A digest of the source's current listing (path, size, ETag/version): names 'this content' for @revision."""
    h = hashlib.sha256()
    for o in sorted(objects, key=lambda o: o.relpath):
        h.update(f"{o.relpath}\0{o.size}\0{o.etag or ''}\0{o.version_id or ''}\n".encode())
    return h.hexdigest()


def _partial_size(item: _Item) -> int:
    try:
        return item.partial.part.stat().st_size if item.partial.journal.exists() else 0
    except FileNotFoundError:
        return 0


def _space_error(exc: OSError, items: list[_Item]) -> InsufficientSpaceError:
    need = sum(i.obj.size for i in items)
    return InsufficientSpaceError(f"disk full while fetching ({exc.strerror}); the model needs {fmt_bytes(need)}; "
                                  f"free disk space or lower the store's budget so eviction makes room")


class _Reporter:
    """Aggregates byte counts from workers; calls the callback at most 5x/s and rewrites the progress file."""

    def __init__(self, uri: str, path: Path, callback: Callable[[Progress], None] | None) -> None:
        self.uri, self.path, self.callback = uri, path, callback
        self._mu = threading.Lock()
        self.done = self.total = self.files_done = self.files_total = 0
        self._phase = "queued"
        self._rate = RateMeter()
        self._last = 0.0

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
            try:
                write_progress_file(self.path, p)
            except OSError:
                pass
        if self.callback is not None:
            self.callback(p)
