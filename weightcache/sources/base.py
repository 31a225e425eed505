"""What every source gives the fetch engine: a sorted object listing and exact byte ranges of pinned versions.

A source lists current objects once; the fetch engine then asks for ranges of those very versions from many
threads. A range read either fills its buffer with exactly the requested bytes, or raises: the object changed
(`ObjectChangedError`), the source refused (`SourceNotFoundError`, `SourceAccessDeniedError`), or bounded retries
ran out (`RetriesExceededError` carrying the last failure). A short body is not an error of its own: the bytes
that arrived are kept and only the remainder is asked for again.
"""

from __future__ import annotations

import builtins
import http.client
import logging
import threading
import time
from collections.abc import Callable, Generator, Hashable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from weightcache import defaults
from weightcache.errors import SourceNotFoundError
from weightcache.ratelimit import BandwidthLimits
from weightcache.retry import PartialRead, Retry, Retryable
from weightcache.uri import ModelRef

if TYPE_CHECKING:
    import urllib3

    from weightcache.store import FileEntry, Snapshot, Store

log = logging.getLogger(__name__)

__all__ = ["ClientPool", "ObjectInfo", "OnBytes", "PartialRead", "Reader", "Retryable", "Source", "SourceOptions"]


class Closable(Protocol):
    def close(self) -> None: ...


class ClientPool:
    """Idle clients kept for the next source with the same key (S3's botocore clients: one is built in 0.02-0.10 s,
    and a kept one's pool has its connections open). A source takes a client out and gives it back at `close`, so
    no two sources share one. At most `kept`, none older than `max_age_s`. Owned by whoever composes the sources
    (the daemon, the standalone CSI server), handed down in SourceOptions and closed with them; without one, a
    source closes its client itself (a one-shot CLI fetch)."""

    def __init__(self, *, kept: int = 4, max_age_s: float = 300.0) -> None:
        self.kept, self.max_age_s = kept, max_age_s
        self._idle: list[tuple[Hashable, float, Closable]] = []  # (key, created, client), oldest first
        self._lock = threading.Lock()

    def take(self, key: Hashable) -> tuple[float, Any] | None:
        """(created, client) of the last one given back under `key` (its connections are the likeliest still
        open), or None."""
        now = time.monotonic()
        with self._lock:
            stale = [kept for kept in self._idle if now - kept[1] >= self.max_age_s]
            self._idle[:] = [kept for kept in self._idle if now - kept[1] < self.max_age_s]
            found = next((i for i in reversed(range(len(self._idle))) if self._idle[i][0] == key), None)
            taken = None if found is None else self._idle.pop(found)[1:]
        _close(stale)
        return taken

    def give_back(self, key: Hashable, created: float, client: Closable) -> None:
        with self._lock:
            self._idle.append((key, created, client))
            dropped = self._idle[:max(0, len(self._idle) - self.kept)]
            del self._idle[:len(dropped)]
        _close(dropped)

    def close(self) -> None:
        with self._lock:
            dropped, self._idle = self._idle, []
        _close(dropped)


def _close(entries: builtins.list[tuple[Hashable, float, Closable]]) -> None:
    for _, _, client in entries:
        client.close()


@dataclass(frozen=True)
class SourceOptions:
    """How a source talks to its store: every backend takes these, `open_source` builds them."""

    endpoint_url: str | None = None  # s3 only (else AWS_ENDPOINT_URL)
    proxy_url: str | None = None  # s3, http, hf, oci: an HTTP(S) forward proxy for this source (Dragonfly's dfdaemon)
    max_attempts: int = 5  # per request or range, failures included
    backoff: float = 0.2  # first retry pause's upper bound, doubling per failure up to retry.MAX_BACKOFF
    pool_size: int = 16  # pooled connections
    connect_timeout: float = defaults.CONNECT_TIMEOUT  # seconds to establish a connection
    read_timeout: float = defaults.READ_TIMEOUT  # seconds without a byte from an open connection
    cancel: threading.Event | None = None  # set: retry waits and reads stop with FetchCancelledError
    # the node's bytesPerSecond (weightcache/ratelimit.py): the daemon's one set of buckets; none by default
    limits: BandwidthLimits = field(default_factory=BandwidthLimits, compare=False, repr=False)
    # clients kept between sources (s3): the composition's own (the daemon's); none: each source closes its own
    clients: ClientPool | None = field(default=None, compare=False, repr=False)

    def retry(self, what: str) -> Retry:
        """Failure accounting for one operation under these options."""
        return Retry(what, max(1, self.max_attempts), self.backoff, self.cancel)

    def http_pool(self) -> urllib3.PoolManager:
        """The connections of a source spoken to over urllib3 (http, hf, oci): `pool_size` of them, these timeouts,
        no urllib3 retries (`retry` counts failures), through `proxy_url` when there is one."""
        import urllib3

        timeout = urllib3.Timeout(connect=self.connect_timeout, read=self.read_timeout)
        if self.proxy_url:
            return urllib3.ProxyManager(self.proxy_url, maxsize=self.pool_size, retries=False, timeout=timeout)
        return urllib3.PoolManager(maxsize=self.pool_size, retries=False, timeout=timeout)


@dataclass(frozen=True)
class ObjectInfo:
    """One object of a listing, pinned to the version seen when listing."""

    key: str  # the source's full key or path
    relpath: str  # relative to the reference's prefix, '/'-separated; NOT validated (the store does that)
    size: int
    etag: str | None  # without quotes
    version_id: str | None
    # (algorithm, lowercase hex) of the FULL object, never a composite one. A sha256 here is EVIDENCE: it links an
    # existing blob without download and is asked of peers, so only a checksum the store computed and verified
    # itself may go here (S3's ChecksumSHA256); a digest a listing merely names is a claim (claimed_sha256).
    checksum: tuple[str, str] | None


T = TypeVar("T")


class Source(Protocol):
    """The interface the fetch engine calls. Implementations are thread-safe and subclass it: the optional
    capabilities below have no-op defaults, so the engine calls them on every source, and mypy checks each
    backend's overrides (no probing by name)."""

    ref: ModelRef
    name: str  # for metrics and logs: "s3", "http", "file", "gs", ...
    #: reads are system calls (file://, memory://), not requests: the engine runs fewer threads
    #: (fetch/transfer.py `Transfer.workers`)
    local: bool = False
    #: @revision is the source's own (hf://, oci://), resolved by it: the engine does not check it against the
    #: listing's ETags (fetch/plan.py `check_revision`)
    resolves_revision: bool = False
    #: bytes that came from peers, not the origin (peers/source.PeerSource)
    peer_bytes: int = 0

    def list(self) -> builtins.list[ObjectInfo]:
        """Every object under the prefix passing the globs, directory markers skipped, sorted by relpath."""
        ...

    def read_into(self, obj: ObjectInfo, offset: int, buf: memoryview) -> None:
        """Fill `buf` with exactly bytes [offset, offset + len(buf)) of the version `obj` describes."""
        ...

    def read_pieces(self, obj: ObjectInfo, offset: int, length: int, buf: memoryview,
                    on_bytes: OnBytes | None = None) -> Pieces:
        """Bytes [offset, offset + length) through `buf`, one request for the whole range where the backend can:
        yields (position, view of buf) for each piece of len(buf) bytes (the last may be shorter). The caller is
        done with a view when it asks for the next one. Retries re-request only what was not yet yielded.
        `on_bytes` hears of bytes as they arrive, before their piece is complete."""
        ...

    def etag_md5(self, obj: ObjectInfo) -> str | None:
        """The object's MD5 when its ETag is one (S3 single-part, unencrypted or SSE-S3), else None."""
        ...

    def close(self) -> None: ...

    # -- optional capabilities: the defaults are what a source without them means --------------------------------
    def claimed_sha256(self, obj: ObjectInfo) -> str | None:
        """A digest the listing names for `obj` (the hub's lfs.sha256, an OCI layer's digest): a claim that
        checks the downloaded bytes, never evidence (ObjectInfo.checksum)."""
        return None

    def multipart_check(self, obj: ObjectInfo) -> builtins.list[int] | None:
        """The part sizes to check a multipart ETag over (S3's, sources/s3.py); None: nothing to check."""
        return None

    def part_sizes_guessed(self, obj: ObjectInfo) -> bool:
        """Whether `multipart_check`'s sizes for `obj` were guessed (the store does not say them), so that a
        mismatch may be parts of another size rather than other bytes."""
        return False

    def head(self, obj: ObjectInfo, **params: Any) -> Mapping[str, Any] | None:
        """The store's HEAD of `obj`'s listed version with `params` (S3's HeadObject, which peers/identity.py
        reads an origin identity from); None where the source has no such request."""
        return None

    def still_names(self, snapshot: Snapshot) -> bool:
        """Whether this reference still names `snapshot`'s files: False vetoes a cache hit (a moved oci:// tag,
        sources/oci.py); a final reference always does."""
        return True

    def expand(self, entries: builtins.list[FileEntry], store: Store) -> builtins.list[FileEntry]:
        """The downloaded entries as published: `entries` itself unless some stand for others (an OCI tar
        layer's members, sources/oci_tar.py)."""
        return entries

    # -- peers (peers/source.PeerSource): a source read from the origin alone has one node and defers nothing ----
    @property
    def nodes(self) -> int:
        """Nodes that may fetch this model together: this one and its peers."""
        return 1

    def spread(self, ranges: builtins.list[T], key: Callable[[T], tuple[str, int, int]]) -> builtins.list[T]:
        """The fetch's ranges in this node's order (its share of a fleet's ranges first); `key`: (object key,
        offset, length)."""
        return ranges

    def defer_while(self, may_defer: Callable[[], bool], wake: Callable[[str], None]) -> None:
        """Told by the engine when a range may wait for a peer: while other work is left for a worker; and what
        takes the ranges waiting for a peer's bytes (peers/source.Later.on) again at once, the peer gone down."""

    def verification_failed(self, obj: ObjectInfo) -> None:
        """`obj`'s bytes failed verification: where they came from is not asked again for it."""


#: A backend's reader: fill `view` with the object's bytes from `offset` and return how many it wrote before the
#: body ended; raise `PartialRead` (bytes written, then failed) or `Retryable` for failures worth another attempt.
Reader = Callable[[int, memoryview], int]
#: What read_pieces returns: (position, view of the caller's buffer) per piece; close() ends the request.
Pieces = Generator[tuple[int, memoryview], None, None]
#: Told the bytes of a body as they arrive (progress); negative when a retry drops bytes it was told of. It may
#: raise (FetchCancelledError) to stop the read.
OnBytes = Callable[[int], None]


def read_range_into(options: SourceOptions, name: str, obj: ObjectInfo, offset: int, buf: memoryview,
                    reader: Reader) -> None:
    """`read_into` for a backend with a `reader`: a range inside the object, read with retries under `options`
    (`name`: the object as errors call it)."""
    if offset < 0 or offset + len(buf) > obj.size:
        raise ValueError(f"range {offset}+{len(buf)} outside {name} of {obj.size} bytes")
    if len(buf):
        options.limits.acquire_origin(name, len(buf), options.cancel)  # the node's bytesPerSecond
        read_with_retries(reader, offset, buf, options.retry(f"reading {name} bytes {offset}-{offset + len(buf) - 1}"))


def read_with_retries(reader: Reader, offset: int, buf: memoryview, retry: Retry) -> None:
    """Call `reader` until `buf` is full, retrying only the missing remainder; `retry` counts the failures."""
    done = 0
    while done < len(buf):
        try:
            got = reader(offset + done, buf[done:])
            done += got
            if done >= len(buf):
                return
            err: Retryable = Retryable(f"short body: got {got} bytes, {len(buf) - done} still missing")
        except PartialRead as exc:
            done += exc.done
            err = exc
        except Retryable as exc:
            err = exc
        retry.failed(err)


def pieces_by_read_into(source: Source, obj: ObjectInfo, offset: int, length: int, buf: memoryview,
                        on_bytes: OnBytes | None = None) -> Pieces:
    """`read_pieces` for backends without streaming: one pinned, retried range read per piece."""
    pos, end = offset, offset + length
    while pos < end:
        view = buf[:min(len(buf), end - pos)]
        source.read_into(obj, pos, view)
        if on_bytes is not None:
            on_bytes(len(view))
        yield pos, view
        pos += len(view)


#: Open a response for bytes [pos, end) of an object; raise Retryable for failures worth another attempt.
Opener = Callable[[int, int], Any]


def origin_pieces(options: SourceOptions, name: str, open_range: Opener, offset: int, length: int, buf: memoryview,
                  on_bytes: OnBytes | None = None) -> Pieces:
    """`read_pieces` of a backend from its origin: `stream_range` with retries under `options` and each piece
    paced by the node's bytesPerSecond for `name` (`scheme://bucket/key`, as read_range_into's)."""
    return stream_range(open_range, offset, length, buf,
                        options.retry(f"reading {name} bytes {offset}-{offset + length - 1}"), on_bytes,
                        throttle=lambda n: options.limits.acquire_origin(name, n, options.cancel))


def stream_range(open_range: Opener, offset: int, length: int, buf: memoryview, retry: Retry,
                 on_bytes: OnBytes | None = None, *, throttle: Callable[[int], None] | None = None) -> Pieces:
    """`read_pieces` over one streamed response (urllib3-style, with `readinto`).

    Large ranges cut the request count (S3 servers and proxies pay per request; moto re-reads the whole object
    for each one) while memory stays one `buf`. A failure mid-body re-opens the range from the first byte not
    yet yielded; `retry` counts the failures. `throttle(n)` is called before each piece of `n` bytes is read
    (a rate limit: it blocks until they may come).
    """
    pos, end = offset, offset + length
    resp = None
    reads = None
    try:
        while pos < end:
            view = buf[:min(len(buf), end - pos)]
            told = _Told(on_bytes)
            if throttle is not None:
                throttle(len(view))
            try:
                if resp is None:
                    resp = open_range(pos, end)
                    reads = _Reads(resp)
                got = _readinto_all(resp, view, told, reads)
                if got < len(view):
                    raise Retryable(f"short body: {end - pos - got} bytes missing")
            except Retryable as err:
                if resp is not None:
                    resp.close()
                    resp = None
                told.take_back()  # this piece is asked for again from its first byte
                retry.failed(err)
                continue
            pos += len(view)  # before the yield: a reader that stops at the last piece has read the body whole
            yield pos - len(view), view
    finally:
        if resp is not None:
            if pos >= end and _at_eof(resp):
                resp.release_conn()
            else:
                resp.close()  # unread bytes must never reach the next request on this connection


class _Told:
    """Passes byte counts on to `on_bytes`, remembering how many, to take them back when a piece is retried."""

    def __init__(self, on_bytes: OnBytes | None) -> None:
        self.on_bytes, self.count = on_bytes, 0

    def __call__(self, n: int) -> None:
        self.count += n
        if self.on_bytes is not None:
            self.on_bytes(n)

    def take_back(self) -> None:
        if self.on_bytes is not None and self.count:
            self.on_bytes(-self.count)
        self.count = 0


#: Bytes asked of one readinto, from READ_SLICE up to READ_SLICE_MAX. Each call is a Python frame and a progress
#: callback on a worker that must take the GIL back: 1.07 GB over loopback in 8 ranged GETs on 2 cores, into a
#: buffer (no disk, no hash), took 0.59-0.73 CPU s in 128 KiB reads, 0.24-0.32 in 1 MiB, 0.19-0.25 in 4 MiB and
#: 0.25-0.32 growing as below (docs/fetch.md). But a buffered socket read blocks until it has them all, so on a
#: slow origin the size bounds how long progress and a cancel wait (128 KiB at 0.5 MB/s: 0.26 s). So each read
#: starts small and the next doubles while they come at SLICE_FAST_BPS or more (READ_SLICE_MAX in at most 0.25 s);
#: a slower one sets it back. A rate, not a time per call: with 8 workers on 2 cores a small read can wait tens of
#: ms for the GIL, and a latency threshold then never let the size grow.
#: A read of a body slower than that asks for what the body brought in SLICE_SLOW_S, from READ_SLICE_MIN up to
#: READ_SLICE: a 128 KiB read of a 300 kB/s origin blocked 0.44 s, so the fetch saw that origin's bytes, and told
#: its peers' silence probe that its link was up (a byte within SILENT_S / 2), in bursts 0.44 s apart; most of the
#: probe's verdicts on a peer cut off fell between two of them and were dropped as "nothing came from elsewhere"
#: (tests/test_peers.py::test_a_silence_probe_waits_twice_what_answers_take_its_connects_going_out_all_through_it
#: failed 3 runs of 20 under load). At 1.3 MB/s and above the size is READ_SLICE as before; below, ~10 reads a second.
READ_SLICE = 128 << 10
READ_SLICE_MIN = 16 << 10
READ_SLICE_MAX = 4 << 20
SLICE_FAST_BPS = 4 * READ_SLICE_MAX
SLICE_SLOW_S = 0.1


class _Reads:
    """How a response is read, kept from one piece to the next: its readinto (body_readinto looks at the headers)
    and the size of the next read (started over at each piece, a 1 MiB piece took four reads, 128, 256, 512 and
    128 KiB, each a Python frame, a progress call and a GIL hand-over, where one does once the body is fast)."""

    def __init__(self, resp: Any) -> None:
        self.readinto = body_readinto(resp)
        self.size = READ_SLICE


def _readinto_all(resp: Any, view: memoryview, on_bytes: OnBytes | None = None, reads: _Reads | None = None) -> int:
    """Fill `view` from the body until it is full or the body ends; PartialRead(done) on a failure."""
    reads = reads or _Reads(resp)
    readinto = reads.readinto
    done = 0
    size = reads.size
    while done < len(view):
        started = time.monotonic()
        try:
            n = readinto(view[done:done + size])
        except Exception as exc:
            raise PartialRead(done, f"{type(exc).__name__} after {done} bytes of the body") from exc
        if not n:
            break
        done += n
        took = time.monotonic() - started
        if n >= SLICE_FAST_BPS * took:
            size = min(size * 2, READ_SLICE_MAX)
        else:  # what it brought in SLICE_SLOW_S, in whole pages
            size = min(READ_SLICE, max(READ_SLICE_MIN, int(n * SLICE_SLOW_S / took) >> 12 << 12))
        reads.size = size
        if on_bytes is not None:
            on_bytes(n)  # outside the try: a cancel it raises is no network failure
    return done


def body_readinto(resp: Any) -> Callable[[memoryview], int]:
    """The readinto that fills our buffer straight from the socket. urllib3 2's `readinto` reads a new bytes
    object and copies it over (a malloc and a memmove per call, and twice the cache footprint); below it,
    http.client's fills the buffer itself and keeps its own count, closing at the body's end (urllib3's `closed`
    then says so, and `release_conn` pools the connection as before). Only where urllib3 has nothing to decode:
    a body it would decompress (Content-Encoding, with decode_content on) goes through urllib3."""
    fp = getattr(resp, "_fp", None)
    encoded = getattr(resp, "decode_content", False) and \
        str(resp.headers.get("Content-Encoding", "identity")).strip().lower() not in ("", "identity")
    if isinstance(fp, http.client.HTTPResponse) and not encoded and not getattr(resp, "_decoded_buffer", None):
        return fp.readinto
    return resp.readinto  # type: ignore[no-any-return]


def _at_eof(resp: Any) -> bool:
    """The whole body was read (so the connection may serve the next request)."""
    return bool(resp.length_remaining == 0 or resp.closed)


def finish_listing(ref: ModelRef, objects: list[ObjectInfo], *, hint: str) -> list[ObjectInfo]:
    """Apply the reference's globs, sort by relpath, refuse an empty result with a hint that says what to do."""
    kept = sorted((o for o in objects if o.relpath and ref.matches(o.relpath)), key=lambda o: o.relpath)
    if kept:
        return kept
    globs = ""
    if ref.include or ref.exclude:
        globs = f" matching include={list(ref.include)} exclude={list(ref.exclude)}"
        if objects:
            hint = f"{len(objects)} objects exist there but none pass the globs; loosen --include/--exclude"
    raise SourceNotFoundError(f"no objects under {ref.uri}{globs}; {hint}")


def read_body_into(resp: Any, view: memoryview) -> int:
    """Read a urllib3 response body into `view`; return the count, or raise PartialRead with it.

    A body read to its end returns the connection to the pool; any other outcome closes it (unread bytes must
    never reach the next request).
    """
    try:
        done = _readinto_all(resp, view)
    except PartialRead:
        resp.close()
        raise
    if resp.closed:  # read to the end of the body
        resp.release_conn()
    else:
        resp.close()
    return done
