"""Fetch engine. (API contract; bodies land shortly.)"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from weightcache.store import Snapshot, Store
from weightcache.uri import ModelRef


@dataclass(frozen=True)
class Progress:
    uri: str
    phase: str  # "queued" | "listing" | "downloading" | "verifying" | "publishing" | "done" | "failed"
    bytes_done: int
    bytes_total: int
    files_done: int
    files_total: int
    rate: float  # bytes/s over the recent window
    eta: float | None  # seconds

    def describe(self) -> str:
        """`fetching s3://models/llama/: 37% (12.3 of 33.0 GB), ETA 40s`"""
        raise NotImplementedError


class Fetcher:
    """ensure(ref) -> Snapshot, single-flight in process (threads) and across processes (flock)."""

    def __init__(self, store: Store, *, concurrency: int = 8, chunk_size: int = 16 << 20,
                 endpoint_url: str | None = None) -> None:
        raise NotImplementedError

    def ensure(self, ref: ModelRef, *, progress: Callable[[Progress], None] | None = None) -> Snapshot:
        """Blocking; call from a thread in async code. Cache hit returns at once."""
        raise NotImplementedError

    def progress(self, ref: ModelRef) -> Progress | None:
        """Progress of an in-flight fetch of `ref` (in this process, or another's via the store), else None."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError
