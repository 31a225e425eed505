"""What quarantine/ holds and how long: entries the store refused to read (a damaged record, a planted symlink, an
unusable index) are kept there for a human, but not for ever and not without bound, since each can be as large as
what it replaced. `prune` drops entries older than `QUARANTINE_MAX_AGE_S`, then the oldest until the rest fit in
`QUARANTINE_MAX_BYTES`; it runs at store start (before anything is written) and with every `gc`. `usage` feeds
metrics (weightcache_store_quarantine_bytes / _entries) so an operator learns that something was refused.

Entry names end in `.<time_ns>` (fsops.Tree._quarantine_at); sizes are counted with lstat through directory fds,
never following a symlink, so a planted link inside an entry counts as a link.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from dataclasses import dataclass

from weightcache.store.view import LayoutView
from weightcache.units import ascii_int

log = logging.getLogger(__name__)

QUARANTINE_MAX_AGE_S = 7 * 86400.0  # a week for a human to look; the log line names each entry when it is moved
QUARANTINE_MAX_BYTES = 1 << 30


@dataclass(frozen=True)
class Entry:
    name: str
    moved_at: float  # seconds since the epoch
    size: int  # bytes of the entry and everything below it


@dataclass(frozen=True)
class QuarantineUsage:
    entries: int
    bytes: int


def entries(store: LayoutView) -> list[Entry]:
    """The quarantine's entries, oldest first."""
    qdir = store.layout.quarantine
    found = []
    with store.tree.dir(qdir, create=True) as qfd:
        for name in os.listdir(qfd):
            try:
                st = os.stat(name, dir_fd=qfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            stamp = name.rpartition(".")[2]
            nanoseconds = ascii_int(stamp) if len(stamp) >= 18 else None
            moved_at = nanoseconds / 1e9 if nanoseconds is not None else st.st_mtime
            size = _size_below(qfd, name) if stat.S_ISDIR(st.st_mode) else st.st_size
            found.append(Entry(name, moved_at, size))
    return sorted(found, key=lambda e: (e.moved_at, e.name))


def usage(store: LayoutView) -> QuarantineUsage:
    found = entries(store)
    return QuarantineUsage(len(found), sum(e.size for e in found))


def prune(store: LayoutView, *, max_age_s: float = QUARANTINE_MAX_AGE_S, max_bytes: int = QUARANTINE_MAX_BYTES,
          now: float | None = None) -> int:
    """Remove entries older than `max_age_s`, then the oldest until the rest total at most `max_bytes`; returns
    the bytes freed. Only deletes (no index writes), so it is safe on a full disk."""
    now = time.time() if now is None else now
    found = entries(store)
    left = sum(e.size for e in found)
    freed = 0
    for entry in found:
        if now - entry.moved_at <= max_age_s and left <= max_bytes:
            break  # oldest first: everything after this one is younger and fits
        store.tree.remove_tree(store.layout.quarantine / entry.name)
        left -= entry.size
        freed += entry.size
        log.info("store: removed quarantined %s (%d bytes, moved there %.0f s ago)", entry.name, entry.size,
                 now - entry.moved_at)
    return freed


def _size_below(parent_fd: int, name: str) -> int:
    """Bytes below directory `name`, walked with an explicit stack of names (a planted tree thousands of levels
    deep must not exhaust recursion or file descriptors): one fd open at a time, each opened O_NOFOLLOW."""
    total = 0
    stack = [name]
    while stack:
        path = stack.pop()
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
        except OSError:  # gone, or not a directory any more
            continue
        try:
            with os.scandir(fd) as it:
                for child in it:
                    st = child.stat(follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(f"{path}/{child.name}")
                    else:
                        total += st.st_size
        finally:
            os.close(fd)
    return total
