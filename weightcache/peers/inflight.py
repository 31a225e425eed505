"""Downloads in flight that peers may read from: blob sha256 -> the PartialFile being written.

The fetch engine registers a partial download when the blob's sha256 is known on trusted evidence (the same rule
as for asking peers) and removes it once the blob is published; the peer server serves only ranges the partial
file has written and journalled (`PartialFile.holds`). Those bytes are not verified yet: the asking node verifies
the whole blob as always, and a download that fails verification is withdrawn here before it is discarded.
"""

from __future__ import annotations

import threading

from weightcache.download import PartialFile


class InFlight:
    """Thread-safe registry shared by a node's fetches and its peer server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parts: dict[str, PartialFile] = {}

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
