"""Values the store hands out. Frozen: a snapshot never changes after publish."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class FileEntry:
    """One file of a snapshot, as its manifest records it."""

    path: str  # relative, '/'-separated, validated
    size: int
    sha256: str  # hex; the blob's name
    etag: str | None = None
    version_id: str | None = None


@dataclass(frozen=True)
class Snapshot:
    """A published, immutable model tree: `path` is what a pod sees (directories 0555, files 0444)."""

    id: str
    path: Path
    uri: str  # canonical model uri (weightcache.uri.ModelRef.uri)
    revision: str | None
    size: int  # bytes of all files
    files: tuple[FileEntry, ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class SnapshotInfo:
    """A snapshot with its bookkeeping, for `ls`, the API and eviction."""

    snapshot: Snapshot
    refs: tuple[str, ...]  # "uri@revision" strings that resolve to it
    last_used: float  # unix time
    pinned: bool
    leases: tuple[str, ...]  # holder ids
    unique_bytes: int  # bytes freed if only this snapshot were evicted (blobs no other snapshot shares)
    # files per what verified them against the source ("md5-etag": 3, "none": 1), from the manifest's record
    # (vocabulary.SOURCE_CHECKS); empty for a snapshot published before the record existed
    source_checks: dict[str, int] = field(default_factory=dict)
    # what verified its model.sig, when a signature was asked for (signatures.SignatureRecord.to_json); else empty
    signature: dict[str, str | int] = field(default_factory=dict)
