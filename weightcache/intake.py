"""Bytes from outside written into the store: one reader of hostile tar streams, and room reserved as bytes arrive.

Two writers take a tar from someone the node does not trust, and neither knows its size before the bytes come: an
OCI tar layer (sources/oci_tar.py; a gzip layer of a few MiB can unpack to terabytes) and an engine cache that a
pod or an admin hands over (engine_cache.py). Both read it through `reading`: tarfile's stream mode with every
header checked before its data is read (`_proc_member`, the one place tarfile shows a caller a header first):

- an extended header (pax, GNU long name or link) over `max_header_bytes` is refused (tarfile reads one of any
  size into memory);
- a symlink, character or block device, FIFO, contiguous or sparse member is refused, and a hard link unless the
  caller takes them (an OCI layer may link to an earlier member of itself; an engine cache takes none).

What is refused raises `TarRefused(name, why)`, a damaged or truncated stream `TarDamaged`; each caller says them
in its own words. Errors of the disk (an OSError with an errno) pass through as they are.

`Room` is the space check a download makes before it starts (`Store.ensure_space`: the disk budget, the free-space
floor, LRU eviction), made for a writer that grows: before each member or file is written, ahead in steps of
`STEP`, counting what the writer has written so far. A gzip bomb stops at the budget with InsufficientSpaceError
(exit 5) before its bytes reach the disk, instead of filling the filesystem and failing there.
"""

from __future__ import annotations

import gzip
import tarfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

from weightcache.errors import InsufficientSpaceError
from weightcache.store import Snapshot, Store

MAX_HEADER_BYTES = 64 << 10  # one pax / GNU long-name header: a real one is a path or a few attributes
STEP = 64 << 20  # room is made this far ahead: one ensure_space (an index query, a statvfs) per 64 MiB, not per file

EXTENDED = frozenset({tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
                      tarfile.GNUTYPE_LONGLINK})
_KINDS = {tarfile.SYMTYPE: "a symlink", tarfile.CHRTYPE: "a character device", tarfile.BLKTYPE: "a block device",
          tarfile.FIFOTYPE: "a FIFO", tarfile.CONTTYPE: "a contiguous file", tarfile.GNUTYPE_SPARSE: "a sparse file"}


class TarRefused(Exception):
    """A member the reader does not take, told from its header before any of its data was read."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"{name!r} {why}")
        self.name, self.why = name, why


class TarDamaged(Exception):
    """Not a tar stream, or a damaged or truncated one (gzip's errors included)."""


def _tarinfo_class(max_header_bytes: int, hard_links: bool) -> type[tarfile.TarInfo]:
    refused = dict(_KINDS) if hard_links else {**_KINDS, tarfile.LNKTYPE: "a hard link"}

    class BoundedTarInfo(tarfile.TarInfo):
        def _proc_member(self, tf: tarfile.TarFile) -> Any:  # every header, before its data is read
            if self.type in EXTENDED and self.size > max_header_bytes:
                raise TarRefused(self.name[:200], f"is an extended tar header of {self.size} bytes (at most "
                                                  f"{max_header_bytes})")
            if self.type in refused:
                raise TarRefused(self.name[:200], f"is {refused[self.type]}; only regular files and directories "
                                                  "are taken")
            return super()._proc_member(tf)  # type: ignore[misc]
    return BoundedTarInfo


@contextmanager
def reading(stream: IO[bytes], *, max_header_bytes: int = MAX_HEADER_BYTES, hard_links: bool = False,
            bufsize: int = tarfile.RECORDSIZE) -> Iterator[tarfile.TarFile]:
    """The tar `stream` read once, front to back (`for member in tf`, `tf.extractfile(member)`), each header
    checked before its data is read. Raises TarRefused and TarDamaged as the module says; what the caller's
    block raises passes through."""
    try:
        with tarfile.open(fileobj=stream, mode="r|", tarinfo=_tarinfo_class(max_header_bytes, hard_links),
                          bufsize=bufsize) as tf:
            yield tf
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise TarDamaged(str(exc)[:200]) from None
    except OSError as exc:
        if exc.errno is not None and not isinstance(exc, gzip.BadGzipFile):
            raise  # the disk's error, not the stream's
        raise TarDamaged(str(exc)[:200]) from None


class Room:
    """Room in `store` for a writer whose size is known only as its bytes arrive: `take(n)` before `n` more bytes
    are written. Made `STEP` ahead (at most `cap`), else for exactly what is written so far, so a writer that fits
    is never refused for the step; `budget(total)`, when given, is asked first (the engine caches' own budgets);
    `evictable` says which snapshots may go to make room (None: any unleased, unpinned one, as for a download).
    Raises InsufficientSpaceError before the bytes that do not fit are written."""

    def __init__(self, store: Store, *, uri: str, cap: int | None = None,
                 evictable: Callable[[Snapshot], bool] | None = None,
                 budget: Callable[[int], None] | None = None) -> None:
        self.store, self.uri, self.cap = store, uri, cap
        self.evictable, self.budget = evictable, budget
        self.written = 0
        self.reserved = 0

    def take(self, n: int) -> None:
        already = self.written
        self.written += n
        if self.written <= self.reserved:
            return
        ahead = self.written + STEP if self.cap is None else min(self.written + STEP, self.cap)
        if ahead > self.written:
            try:
                self._reserve(ahead, already)
            except InsufficientSpaceError:
                pass  # it may still fit without the step
            else:
                self.reserved = ahead
                return
        self._reserve(self.written, already)
        self.reserved = self.written

    def _reserve(self, total: int, already: int) -> None:
        if self.budget is not None:
            self.budget(total)
        self.store.ensure_space(total, uri=self.uri, already=already, evictable=self.evictable)


__all__ = ["EXTENDED", "MAX_HEADER_BYTES", "STEP", "Room", "TarDamaged", "TarRefused", "reading"]
