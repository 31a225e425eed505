"""Downloads in flight that peers may read from: blob sha256 -> the PartialFile being written, and the byte
ranges this node is reading from the origin right now (its claims).

The fetch engine registers a partial download when the blob's sha256 is known on trusted evidence (the same rule
as for asking peers) and removes it once the blob is published; the peer server serves ranges the partial file
has written and journalled (`PartialFile.holds`) and streams a claimed range as its chunks are journalled, so a
node that starts together with this one waits for a piece this node is fetching instead of asking the origin for
it again. Those bytes are not verified yet: the asking node verifies the whole blob as always, and a download
that fails verification is withdrawn here before it is discarded.
"""

from __future__ import annotations

import threading

from weightcache.download import PartialFile

Claim = tuple[str, int, int]  # (sha256, start, end): a range being read from the origin


class InFlight:
    """Thread-safe registry shared by a node's fetches and its peer server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parts: dict[str, PartialFile] = {}
        self._claims: list[Claim] = []

    def add(self, sha256: str, part: PartialFile) -> None:
        with self._lock:
            self._parts.setdefault(sha256, part)

    def remove(self, sha256: str, part: PartialFile) -> None:
        with self._lock:
            if self._parts.get(sha256) is part:
                del self._parts[sha256]

    def get(self, sha256: str) -> PartialFile | None:
        with self._lock:
            return self._parts.get(sha256)

    def claim(self, sha256: str, start: int, end: int) -> Claim:
        """This node reads [start, end) of the blob from the origin now; `release` the result when done."""
        claim = (sha256, start, end)
        with self._lock:
            self._claims.append(claim)
        return claim

    def release(self, claim: Claim) -> None:
        with self._lock:
            self._claims.remove(claim)

    def claimed_end(self, sha256: str, pos: int) -> int:
        """The end of the furthest claim covering byte `pos` (`pos` itself when none does)."""
        with self._lock:
            return max([e for s, a, e in self._claims if s == sha256 and a <= pos < e], default=pos)

    def servable_end(self, sha256: str, part: PartialFile, start: int, end: int) -> int:
        """How far from `start` (at most `end`) the peer server can send: journalled bytes, then claimed ranges
        whose bytes are on their way."""
        pos = start
        while pos < end:
            further = max(held_end(part, pos, end), min(end, self.claimed_end(sha256, pos)))
            if further == pos:
                break
            pos = further
        return pos


def held_end(part: PartialFile, start: int, end: int) -> int:
    """The end of the journalled bytes from `start` on, at most `end` (binary search over `holds`)."""
    lo, hi = start, end
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if part.holds(start, mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
