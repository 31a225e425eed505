"""What every source gives the fetch engine: a sorted object listing and exact byte ranges of pinned versions.

A source lists current objects once; the fetch engine then asks for ranges of those very versions from many
threads. A range read either fills its buffer with exactly the requested bytes, or raises: the object changed
(`ObjectChangedError`), the source refused (`SourceNotFoundError`, `SourceAccessDeniedError`), or bounded retries
ran out (`RetriesExceededError` carrying the last failure). A short body is not an error of its own: the bytes
that arrived are kept and only the remainder is asked for again.
"""

from __future__ import annotations

import http.client
import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from weightcache.errors import RetriesExceededError, SourceNotFoundError
from weightcache.uri import ModelRef

log = logging.getLogger(__name__)

MAX_BACKOFF = 10.0  # seconds; also the cap on a server's Retry-After


@dataclass(frozen=True)
class ObjectInfo:
    """One object of a listing, pinned to the version seen when listing."""

    key: str  # the source's full key or path
    relpath: str  # relative to the reference's prefix, '/'-separated; NOT validated (the store does that)
    size: int
    etag: str | None  # without quotes
    version_id: str | None
    checksum: tuple[str, str] | None  # (algorithm, lowercase hex) of the FULL object, never a composite one


class Source(Protocol):
    """The interface the fetch engine calls. Implementations are thread-safe."""

    ref: ModelRef
    name: str  # for metrics and logs: "s3", "http", "file", "gs", ...

    def list(self) -> list[ObjectInfo]:
        """Every object under the prefix passing the globs, directory markers skipped, sorted by relpath."""
        ...

    def read_into(self, obj: ObjectInfo, offset: int, buf: memoryview) -> None:
        """Fill `buf` with exactly bytes [offset, offset + len(buf)) of the version `obj` describes."""
        ...

    def read_pieces(self, obj: ObjectInfo, offset: int, length: int, buf: memoryview) -> Iterator[tuple[int, memoryview]]:
        """Bytes [offset, offset + length) through `buf`, one request for the whole range where the backend can:
        yields (position, view of buf) for each piece of len(buf) bytes (the last may be shorter). The caller is
        done with a view when it asks for the next one. Retries re-request only what was not yet yielded."""
        ...

    def stream(self, obj: ObjectInfo, offset: int = 0, chunk: int = 8 << 20) -> Iterator[bytes]:
        """The object's bytes from `offset` to the end, in pieces of at most `chunk` bytes."""
        ...

    def close(self) -> None: ...


class Retryable(Exception):
    """Raised by a backend's reader for a failure worth another attempt; the cause is chained."""

    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


#: A backend's reader: fill `view` with the object's bytes from `offset` and return how many it wrote before the
#: body ended; raise `PartialRead` (bytes written, then failed) or `Retryable` for failures worth another attempt.
Reader = Callable[[int, memoryview], int]


class PartialRead(Retryable):
    """A read failed after writing `done` bytes of its view."""

    def __init__(self, done: int, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason, retry_after)
        self.done = done


def read_with_retries(
    reader: Reader, offset: int, buf: memoryview, *, what: str, max_attempts: int, backoff: float
) -> None:
    """Call `reader` until `buf` is full, retrying only the missing remainder, at most `max_attempts` failures."""
    done = failures = 0
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
        failures += 1
        if failures >= max_attempts:
            raise RetriesExceededError(
                f"reading {what} bytes {offset}-{offset + len(buf) - 1} failed {failures} times, last: {err.reason}; "
                "check the network and the object store, then fetch again (finished ranges are kept)",
                err.__cause__ or err,
            ) from (err.__cause__ or err)
        pause = backoff_pause(failures, backoff, err.retry_after)
        log.debug("retrying %s at byte %d in %.2fs after: %s", what, offset + done, pause, err.reason)
        time.sleep(pause)


def backoff_pause(failures: int, backoff: float, retry_after: float | None = None) -> float:
    """Seconds to wait: exponential backoff with full jitter, at least a server's Retry-After (both capped)."""
    pause = random.uniform(0, min(MAX_BACKOFF, backoff * 2 ** (failures - 1)))
    if retry_after:
        pause = max(pause, min(retry_after, MAX_BACKOFF))
    return pause


def pieces_by_read_into(source: Source, obj: ObjectInfo, offset: int, length: int,
                        buf: memoryview) -> Iterator[tuple[int, memoryview]]:
    """`read_pieces` for backends without streaming: one pinned, retried range read per piece."""
    pos, end = offset, offset + length
    while pos < end:
        view = buf[:min(len(buf), end - pos)]
        source.read_into(obj, pos, view)
        yield pos, view
        pos += len(view)


#: Open a response for bytes [pos, end) of an object; raise Retryable for failures worth another attempt.
Opener = Callable[[int, int], Any]


def stream_range(open_range: Opener, offset: int, length: int, buf: memoryview, *, what: str, max_attempts: int,
                 backoff: float) -> Iterator[tuple[int, memoryview]]:
    """`read_pieces` over one streamed response (urllib3-style, with `readinto`).

    Large ranges cut the request count (S3 servers and proxies pay per request; moto re-reads the whole object
    for each one) while memory stays one `buf`. A failure mid-body re-opens the range from the first byte not
    yet yielded, at most `max_attempts` failures in all.
    """
    pos, end, failures = offset, offset + length, 0
    resp = None
    try:
        while pos < end:
            view = buf[:min(len(buf), end - pos)]
            try:
                if resp is None:
                    resp = open_range(pos, end)
                got = _readinto_all(resp, view)
                if got < len(view):
                    raise Retryable(f"short body: {end - pos - got} bytes missing")
            except Retryable as err:
                if resp is not None:
                    resp.close()
                    resp = None
                failures += 1
                if failures >= max_attempts:
                    raise RetriesExceededError(
                        f"reading {what} bytes {pos}-{end - 1} failed {failures} times, last: {err.reason}; "
                        "check the network and the object store, then fetch again (finished ranges are kept)",
                        err.__cause__ or err) from (err.__cause__ or err)
                time.sleep(backoff_pause(failures, backoff, err.retry_after))
                continue
            yield pos, view
            pos += len(view)
    finally:
        if resp is not None:
            if pos >= end and _at_eof(resp):
                resp.release_conn()
            else:
                resp.close()  # unread bytes must never reach the next request on this connection


def _readinto_all(resp: Any, view: memoryview) -> int:
    """Fill `view` from the body until it is full or the body ends; PartialRead(done) on a failure.

    http.client's readinto receives straight into our buffer, urllib3's and botocore's copy through bytes, so
    the first is used when the response wraps one.
    """
    fp = getattr(resp, "_fp", None)
    readinto = fp.readinto if isinstance(fp, http.client.HTTPResponse) else resp.readinto
    done = 0
    try:
        while done < len(view):
            n = readinto(view[done:])
            if not n:
                break
            done += n
    except Exception as exc:
        raise PartialRead(done, f"{type(exc).__name__} after {done} bytes of the body") from exc
    return done


def _at_eof(resp: Any) -> bool:
    fp = getattr(resp, "_fp", None)
    if isinstance(fp, http.client.HTTPResponse):
        return fp.isclosed() or fp.length == 0
    return bool(getattr(resp, "closed", False))


def stream_by_ranges(source: Source, obj: ObjectInfo, offset: int, chunk: int) -> Iterator[bytes]:
    """`Source.stream` from `read_into`: each piece is one pinned, retried range read."""
    pos = offset
    while pos < obj.size:
        piece = bytearray(min(chunk, obj.size - pos))
        source.read_into(obj, pos, memoryview(piece))
        pos += len(piece)
        yield bytes(piece)


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
