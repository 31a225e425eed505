"""What the phases of a fetch (plan.py, transfer.py, publish.py) share: one `Item` per object of the listing and
what is known and expected of it, filled in by the plan, its bytes by the transfer, its blob by publish."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from weightcache.download import PartialFile
from weightcache.errors import SafetensorsHeaderError
from weightcache.peers.identity import OriginId
from weightcache.sources import ObjectInfo
from weightcache.vocabulary import NO_SOURCE_CHECK

if TYPE_CHECKING:
    from weightcache.peers import PeerSet


@dataclass
class Item:
    """One object to fetch and what we expect of it."""

    obj: ObjectInfo
    relpath: str
    expect_sha256: str | None = None  # the bytes we download must hash to this
    source_check: tuple[str, str] | None = None  # (algorithm, hex) the source declares: crc32, ..., md5 (ETag)
    sha256: str | None = None  # known without download (trusted dedup) or computed
    trusted_sha256: str | None = None  # on evidence no source or peer can forge (peers may serve it)
    # no trusted sha256, but an origin identity with an origin checksum (source_check) the bytes are checked
    # against: peers are asked for this identity (docs/peers.md, "Objects without a SHA-256 checksum")
    peer_origin: OriginId | None = None
    size: int = 0  # of the blob linked or the file written, never the listing's claim
    partial: PartialFile | None = field(default=None, repr=False)
    in_blob: bool = False  # written straight to its blob (a whole small file): no part to move
    header_error: SafetensorsHeaderError | None = None  # its header check's refusal before naming it: finish raises
    unsynced_blob: bool = False  # linked on the store's checksum alone: its blob may be another fetch's, not synced
    check: str = NO_SOURCE_CHECK  # what verifies it against its source (vocabulary.SOURCE_CHECKS): the manifest's
    reported: bool = False  # handed to on_file: its blob is named and durable already (add_blobs skips it)


def partial(item: Item) -> PartialFile:
    if item.partial is None:
        raise AssertionError(f"{item.relpath} has no partial download")  # only items to download get one
    return item.partial


def serve_partials(peers: PeerSet | None, items: list[Item], serve: bool) -> None:
    """Let this node's peer server read the journalled ranges of these downloads (trusted digests only)."""
    if peers is None:
        return
    for item in items:
        name = item.trusted_sha256 or (item.peer_origin.address if item.peer_origin else None)
        if name and item.partial is not None:
            if serve:
                peers.inflight.add(name, item.partial)
            else:
                peers.inflight.remove(name, item.partial)
