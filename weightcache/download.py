"""One file's download into `partial/`: ranged chunks written at offsets, a journal for resume, hashing in order.

    partial/<name>.part       the body; preallocated when journalled (ENOSPC shows before the first byte)
    partial/<name>.journal    line 1: JSON header (key, size, etag, version_id); then "offset length" per
                              finished chunk, appended after the chunk's bytes are written

After `kill -9` a rerun keeps every journalled range and refetches only what was in flight. A header that does
not match the object (new ETag, size or version) discards both files: a body is never mixed from two versions.
Chunks finish out of order; whichever worker completes the next contiguous range feeds it to sha256 (and to
the source's own checksum, on a thread beside it: a full-object CRC32 or the like, or the MD5 an ETag is), from
its own buffer when the chunk it just wrote is next, else from the page cache through a read-only mapping (no
copy; read into a buffer only when pages were evicted), so hashing overlaps the download. A multipart ETag's
part MD5s need no order across parts: each chunk is offered to them by the worker that wrote it, while it is in
that core's cache (`SourceCheck.update_at`), and the in-order pass takes only what they could not.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import functools
import hashlib
import json
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weightcache.checksums import SourceCheck
    from weightcache.sources import ObjectInfo


#: Bytes of a large file written, journalled and hashed at a time. They arrive from the socket into a buffer that
#: stays in the core's L2 cache (1 MiB or more on current servers), go on to the page cache and into sha256 from
#: there: with 16 MiB pieces every byte came back from RAM for each of those steps, and the same download took
#: three times the CPU (see docs/fetch.md, "Big files").
PIECE = 1 << 20
#: Bytes of the part mapped at a time to hash what other workers wrote (see PartialFile._hash_range).
MAP_WINDOW = 8 << 20
#: A piece at least this large has its source checksum computed on a thread of its own, beside sha256.
BESIDE_MIN = 256 << 10
#: A large file's bytes are handed to the disk in steps of this many as they arrive (see PartialFile.write).
WRITEBACK_STEP = 8 << 20
#: Hashed bytes this far behind the hash frontier leave the page cache, in steps of this size (see _drop_behind).
DROP_LAG = 4 * WRITEBACK_STEP
#: A fetch of fewer bytes than this keeps its pages (engine.py): up to 1 GB, kept and dropped pages cost the
#: same system CPU per GB (docs/fetch.md, "Cost per GB as the model grows"), while each drop waits for its bytes'
#: writeback on the hashing thread (16 ms of an 88 MB fetch's 0.25 s from radosgw), and the model's first load
#: finds it in the page cache instead of reading it from the disk.
DROP_BEHIND_MIN = 1 << 30


class PartialFile:
    """Download state of one object; thread-safe for many workers writing disjoint chunks."""

    def __init__(self, part: Path, obj: ObjectInfo, *, range_size: int,
                 source_check: Callable[[], SourceCheck] | None = None, check_beside: bool = True,
                 journalled: bool = True, drop_behind: bool = False) -> None:
        """`check_beside`: the source check is slow enough (MD5) to run on a thread beside sha256; a CRC is not
        (its hand-over to a thread cost more CPU than the CRC itself: 0.92 against 0.81 CPU s/GiB with sha256).
        `drop_behind`: nobody reads the file while it downloads (no stream), so its hashed bytes leave the page
        cache as the download goes (see _drop_behind)."""
        self.part = part
        self.journalled = journalled  # without a journal a rerun starts the file over (small files: cheaper)
        self.obj = obj
        self.range_size = range_size  # bytes asked for in one request; each chunk written inside is journalled
        self._mu = threading.Lock()
        self._done: dict[int, int] = {}  # offset -> length of finished ranges
        self._held = Runs()  # the same bytes as merged runs: `holds` answers in O(log n) under the lock
        self._hash_at = 0
        self._hashing = False
        self._drop_behind = drop_behind and journalled
        self._dropped_to = 0  # bytes below this are written back and out of the page cache (_drop_behind)
        self.sha256 = hashlib.sha256()
        self._source_check = source_check
        self.source_check: SourceCheck | None = source_check() if source_check else None  # the source's checksum
        self._check_beside = check_beside
        self.resumed_bytes = 0
        self._fd = -1
        self._jfd = -1
        self._whole_size: int | None = None  # bytes written by write_whole (its descriptor is closed at once)

    @functools.cached_property
    def journal(self) -> Path:
        """partial/<name>.journal (made only when asked: most small files never need it)."""
        return self.part.with_suffix(".journal")

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def open(self) -> list[tuple[int, int]]:
        """Open (resuming when the journal matches) and return the (offset, length) ranges still to fetch."""
        if not self.journalled:  # nothing to resume: the worker that writes it creates it (in parallel)
            if not self.obj.size:
                self._write_whole(memoryview(b""))
            return self._missing()
        header = {"key": self.obj.key, "size": self.obj.size, "etag": self.obj.etag,
                  "version_id": self.obj.version_id}
        if self.part.is_symlink() or self.journal.is_symlink():  # planted: drop the links, never follow them
            self.discard()
        ranges = self._load_journal(header)
        if ranges is None:
            self.discard()
            ranges = []
        fresh = not self.part.exists()
        self._fd = os.open(self.part, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        if fresh and self.obj.size:
            os.posix_fallocate(self._fd, 0, self.obj.size)
        self._jfd = os.open(self.journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        if fresh or not ranges:
            os.ftruncate(self._jfd, 0)
            os.write(self._jfd, (json.dumps(header) + "\n").encode())
        for start, length in _merge(ranges):
            self._done[start] = length
            self._held.add(start, start + length)
            self.resumed_bytes += length
        return self._missing()

    def _load_journal(self, header: dict[str, Any]) -> list[tuple[int, int]] | None:
        try:  # a journal is data from disk: anything unexpected in it means "start this file again"
            lines = self.journal.read_bytes().decode().splitlines()
            if not lines or json.loads(lines[0]) != header or os.lstat(self.part).st_size != self.obj.size:
                return None
        except (OSError, ValueError, RecursionError):
            return None
        out = []
        for line in lines[1:]:
            parts = line.split()
            if len(parts) == 2 and all(p.isascii() and p.isdigit() for p in parts):
                start, length = int(parts[0]), int(parts[1])
                if start + length <= self.obj.size:
                    out.append((start, length))
        return out

    def _missing(self) -> list[tuple[int, int]]:
        pieces, pos = [], 0
        for start in sorted(self._done):
            pieces += _split(pos, start - pos, self.range_size)
            pos = start + self._done[start]
        pieces += _split(pos, self.obj.size - pos, self.range_size)
        return pieces

    def close(self) -> None:
        for fd in (self._fd, self._jfd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._jfd = -1

    def discard(self) -> None:
        self.close()
        self.part.unlink(missing_ok=True)
        self.journal.unlink(missing_ok=True)
        self._done.clear()
        self._held = Runs()
        self._hash_at = self._dropped_to = 0
        self._whole_size = None
        self.sha256 = hashlib.sha256()
        self.source_check = self._source_check() if self._source_check else None

    # -- writing ------------------------------------------------------------------------------------------------
    def write(self, offset: int, data: memoryview, scratch: memoryview) -> None:
        """Write a finished chunk, journal it, then advance the in-order hash (using `scratch` to re-read). A file
        without a journal comes in one piece (_write_whole), or in several where a fleet reads it from the origin
        in relay pieces (peers/source.py `_relay_piece`) or a peer sends part of it: its part is created at the
        first of them and closed once they are all written and hashed (_unjournalled_piece)."""
        if not self.journalled:
            if offset == 0 and len(data) == self.obj.size:
                self._write_whole(data)
                return
            self._unjournalled_piece()
        view = data
        pos = offset
        while view:
            n = os.pwrite(self._fd, view, pos)
            view, pos = view[n:], pos + n
        if self._jfd >= 0:
            os.write(self._jfd, f"{offset} {len(data)}\n".encode())
        if self.source_check is not None:  # what of it the check can take now, while it is in this core's cache
            self.source_check.update_at(offset, data)
        if pos % WRITEBACK_STEP == 0:
            _start_writeback(self._fd, pos - WRITEBACK_STEP, WRITEBACK_STEP)
        with self._mu:
            self._done[offset] = len(data)
            self._held.add(offset, offset + len(data))
            if self._hashing:
                return
            self._hashing = True
            in_hand = offset == self._hash_at
        if in_hand:  # the next bytes to hash are these: feed them now instead of re-reading them from the page cache
            self._feed(data)
            with self._mu:
                self._hash_at = offset + len(data)
            if self._drop_behind:
                self._drop_to(offset + len(data) - DROP_LAG)
        self.advance_hash(scratch)
        if not self.journalled and self.complete:
            self._unjournalled_done()

    def _unjournalled_piece(self) -> None:
        """A piece of a file without a journal: its part is created now (started over) if this is the first.
        Before, there was no descriptor until a whole body came, and every piece failed with EBADF (a fleet
        reading a file of one chunk from the origin failed its fetch)."""
        with self._mu:
            if self._fd < 0:
                self._fd = _create_truncated(self.part)

    def _unjournalled_done(self) -> None:
        """Every byte of a file without a journal is written and hashed: its descriptor is closed now, not kept
        until verification (as _write_whole does: a model of many small files would hold one each, EMFILE)."""
        with self._mu:
            if self._fd < 0:
                return
            self._whole_size = os.fstat(self._fd).st_size
            os.close(self._fd)
            self._fd = -1

    def _write_whole(self, data: memoryview) -> None:
        """A one-request file in one go: create (started over, O_TRUNC|O_NOFOLLOW), write, hash from the caller's
        buffer, close. Its descriptor is not kept until verification, so a model of many small files never holds
        one descriptor per file (EMFILE). Not preallocated: its bytes follow at once (a full disk shows on the
        first write), and on ext4 preallocating 4 KB files cost a call and an extent conversion each."""
        self.write_whole_part(data)
        self.hash_whole(data)

    def write_whole_part(self, data: memoryview) -> None:
        """The file part of _write_whole: the bytes to the part, no hashing (hash_whole did it). Only now does the
        part hold them, so only now may a peer be served them (a part left by an earlier run holds other bytes)."""
        fd = _create_truncated(self.part)
        try:
            view = data
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        with self._mu:
            self._held.add(0, len(data))

    def hash_whole(self, data: memoryview) -> None:
        """Hash a one-request file's bytes and count it complete; the fetch then writes them to its blob
        directly (weightcache/store/blobwrite.py), or to the part with write_whole_part. The part holds nothing
        of them yet: `holds` stays false."""
        self._feed(data)
        with self._mu:
            self._done[0] = self._hash_at = self._whole_size = len(data)

    def advance_hash(self, scratch: memoryview) -> None:
        """Hash every contiguous finished byte; one hasher at a time, others just leave their ranges."""
        while True:
            with self._mu:
                length = self._done.get(self._hash_at)
                if length is None:
                    self._hashing = False
                    return
                start = self._hash_at
            self._hash_range(start, length, scratch)
            with self._mu:
                self._hash_at = start + length
            if self._drop_behind:
                self._drop_to(start + length - DROP_LAG)

    def _hash_range(self, start: int, length: int, scratch: memoryview) -> None:
        """Hash bytes another worker wrote: straight from the page cache through a mapping, with no copy, where
        every page of the window is resident (mincore); else (evicted: they come from the disk anyway, and a
        mapping would turn an I/O error into SIGBUS) read through `scratch`."""
        end = start + length
        while start < end:
            n = min(MAP_WINDOW, end - start)
            with _mapped(self._fd, start, n) as view:
                if view is not None:
                    self._feed(view)
                    start += n
                    continue
            n = os.preadv(self._fd, [scratch[:min(len(scratch), end - start)]], start)
            if n <= 0:
                raise OSError(f"short read of {self.part} at {start}")
            self._feed(scratch[:n])
            start += n

    def _drop_to(self, end: int) -> None:
        """Write back and drop from the page cache the hashed bytes below `end`, in whole WRITEBACK_STEPs (the
        hashing worker alone calls it). A download through the page cache otherwise leaves a model-sized trail
        of pages behind it, each a page the kernel had to find anew: on the development VM (free page reporting
        hands idle memory back to the host, and touching it again costs a fault there) writing 4 GB took 1.58
        system CPU s/GB kept against 0.27 dropped, 1 GB 0.19 (docs/fetch.md, "Cost per GB as the model grows").
        Dropped pages go back to the allocator and carry the next bytes. The wait is for writeback started
        DROP_LAG ago (write): dirty pages would stay. Whoever reads the blob later reads it from the disk."""
        end -= end % WRITEBACK_STEP
        if end - self._dropped_to < WRITEBACK_STEP:
            return
        start, self._dropped_to = self._dropped_to, end
        drop_cached(self._fd, start, end - start)

    def _feed(self, data: memoryview) -> None:
        """sha256 here and an MD5 source check on a thread beside it (both release the GIL for large buffers):
        an MD5 ETag (0.7 GB/s) no longer adds its time to sha256's (1.5 GB/s) on the hashing thread. A CRC
        (10 GB/s) runs here, a piece at a time after sha256's (a mapped 8 MiB window would otherwise come from
        RAM twice). So does a check with nothing of `data` left to hash: a multipart ETag's part MD5s took it as it
        arrived (`pending`), and handing each piece to a thread to pass over it cost more than the pass. Both are
        done with `data` when this returns (the caller reuses its buffer)."""
        check = self.source_check
        if check is None:
            self.sha256.update(data)
        elif len(data) < BESIDE_MIN or not self._check_beside or not check.pending(len(data)):
            for at in range(0, len(data), PIECE):  # a CRC right behind sha256, while the piece is in the core's cache
                piece = data[at:at + PIECE]
                self.sha256.update(piece)
                check.update(piece)
        else:
            beside = _beside().submit(check.update, data)
            try:
                self.sha256.update(data)
            finally:
                beside.result()

    def hash_resumed(self, scratch: memoryview) -> None:
        """Feed already-journalled bytes at the start of the file to the hashes (after a resume)."""
        with self._mu:
            if self._hashing:
                return
            self._hashing = True
        self.advance_hash(scratch)

    def holds(self, start: int, end: int) -> bool:
        """Bytes [start, end) are written and journalled (a peer may be served them while the download goes on)."""
        with self._mu:
            return self._held.covers(start, end)

    def held_end(self, start: int, end: int) -> int:
        """How far from `start` (at most `end`) the bytes are written and journalled (`start`: none)."""
        with self._mu:
            return min(end, self._held.reach(start))

    def holds_same(self, offset: int, data: memoryview) -> bool:
        """The part holds `data` at `offset`, written and journalled (False when it holds other bytes there, not
        all of them yet, or is closed)."""
        if not self.holds(offset, offset + len(data)) or self._fd < 0:
            return False
        try:
            return os.pread(self._fd, len(data), offset) == data
        except OSError:  # closed meanwhile (the fetch ended): no verdict, nothing to serve
            return False

    @property
    def complete(self) -> bool:
        return self._hash_at >= self.obj.size

    def written_size(self) -> int:
        """The size of what was written (a manifest records this, never a listing's claim)."""
        if self._whole_size is not None:
            return self._whole_size
        return os.fstat(self._fd).st_size



def _create_truncated(path: Path) -> int:
    """Open `path` empty for writing; a symlink planted there is removed, never followed. Created 0444, the
    mode its blob has (the descriptor still writes): the store then moves it without a chmod of its own."""
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o444)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.EACCES):  # EACCES: a 0444 leftover, to a daemon that is not root
            raise
    path.unlink()
    return os.open(path, flags, 0o444)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_PAGE = mmap.PAGESIZE
_MAP_FAILED = ctypes.c_void_p(-1).value
_RESIDENT = bytes(i & 1 for i in range(256))  # mincore: bit 0 of each page's byte says resident
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE_WAIT_ALL = 1 | 2 | 4  # wait for writeback in flight, start it, wait for it


def _start_writeback(fd: int, start: int, length: int) -> None:
    """Start writing bytes [start, start + length) of `fd` to the disk, without waiting for them.

    Without it the kernel leaves a fetch's pages dirty until its own thresholds (10 % of RAM, or 30 s), so the
    fsync that makes a file durable wrote all of it at the end: 1.4-2.0 s for each of four 370 MB shards,
    after the last byte had arrived (scripts/bench_stream.py; docs/fetch.md). Started as each 8 MiB is
    written, the disk works while the download goes on and that fsync waits for little. The fsync is still what
    makes the bytes durable: this is a hint, and a filesystem that refuses it (EINVAL, ESPIPE) loses nothing."""
    if start >= 0:
        _libc.sync_file_range(fd, start, length, _SYNC_FILE_RANGE_WRITE)


def drop_cached(fd: int, start: int, length: int) -> None:
    """Take bytes [start, start + length) of `fd` out of the page cache (length 0: to the end). DONTNEED leaves
    dirty pages and those under writeback where they are, so they are written first and waited for (no device
    flush: clean is what is needed here, not durable)."""
    _libc.sync_file_range(fd, start, length, _SYNC_FILE_RANGE_WAIT_ALL)
    os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)


@contextlib.contextmanager
def _mapped(fd: int, start: int, length: int) -> Iterator[memoryview | None]:
    """Bytes [start, start + length) of `fd` as a read-only view of the page cache (MAP_POPULATE: mapped in one
    call, not a fault per page), or None when any page of them is not resident or the mapping fails. Hashing
    a mapped piece costs what hashing it in the core's cache does; reading it into a buffer first took about
    0.5 CPU s more per GB on the development VM (docs/fetch.md, "Big files"). The view is released before the
    mapping goes: nothing may keep it."""
    lead = start % _PAGE
    size = lead + length
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED | mmap.MAP_POPULATE, fd, start - lead)
    if addr is None or addr == _MAP_FAILED:
        yield None
        return
    try:
        pages = -(-size // _PAGE)
        vec = ctypes.create_string_buffer(pages)
        if _libc.mincore(addr, size, vec) != 0 or 0 in vec.raw[:pages].translate(_RESIDENT):
            yield None
            return
        whole = memoryview((ctypes.c_char * size).from_address(addr))
        view = whole.cast("B")[lead:]
        try:
            yield view
        finally:
            view.release()
            whole.release()
    finally:
        _libc.munmap(addr, size)


@functools.cache
def _beside() -> ThreadPoolExecutor:
    """The threads that compute source checksums beside sha256 (one per hashing worker at most: each waits for
    its own before going on)."""
    return ThreadPoolExecutor(max(2, os.cpu_count() or 2), thread_name_prefix="wc-check")


def sync_filesystem(path: Path) -> None:
    """syncfs(2) the filesystem holding `path`: every file's data and every directory entry written so far is
    durable when it returns (os has no syncfs; os.sync would flush every disk of the node)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs {path}: {os.strerror(err)}")
    finally:
        os.close(fd)


class Runs:
    """Disjoint, sorted [start, end) runs of bytes, merged as they are added. A peer asks `holds` about thirty
    times per range it serves (a binary search for the journalled end): sorting a 10 GB file's 10,000 piece
    entries each time took 140 ms of the GIL per search."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        i = bisect.bisect_left(self.ends, start)  # the first run that ends at or after `start`: touches or overlaps
        j = bisect.bisect_right(self.starts, end)  # runs from i to j-1 touch or overlap [start, end)
        if i < j:
            start, end = min(start, self.starts[i]), max(end, self.ends[j - 1])
        self.starts[i:j], self.ends[i:j] = [start], [end]

    def covers(self, start: int, end: int) -> bool:
        return end <= start or self.reach(start) >= end

    def reach(self, start: int) -> int:
        """The end of the run holding byte `start`; `start` itself when none does."""
        i = bisect.bisect_right(self.starts, start) - 1
        return max(start, self.ends[i]) if i >= 0 else start


def _split(start: int, length: int, chunk: int) -> list[tuple[int, int]]:
    return [(o, min(chunk, start + length - o)) for o in range(start, start + length, chunk)]


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for start, length in sorted(ranges):
        if out and start <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], start + length - out[-1][0])
        else:
            out.append([start, length])
    return [(s, n) for s, n in out]
