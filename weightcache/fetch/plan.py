"""The plan of a fetch: from a listing, what each file's downloaded bytes must match and which files are linked
without a download, on evidence this node can trust; then a part file per download, sized into ranges.

Dedup: a file is linked without downloading only on the same source object (uri, path, ETag/version, size)
recorded in a manifest this node wrote, or the store's own full-object SHA-256 (S3 computes and verifies it on
upload). A digest a file in the source names (SHA256SUMS, *.sha256) is a claim: it only checks bytes actually
downloaded, so a source cannot link another model's blob into its snapshot.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from weightcache.checksums import CRCS, InOrder, SourceCheck, new_hasher
from weightcache.download import PartialFile
from weightcache.errors import NotAllowedError, SourceNotFoundError
from weightcache.fetch.items import Item, partial
from weightcache.peers.identity import COMPOSITE, CompositeMD5, OriginId, composite_factory, origin_evidence
from weightcache.sources import ObjectInfo, Source
from weightcache.store import Store
from weightcache.uri import ModelRef
from weightcache.vocabulary import NO_SOURCE_CHECK

if TYPE_CHECKING:
    from weightcache.peers import PeerSet

log = logging.getLogger(__name__)

SIDECAR_MAX = 1 << 20
MIN_RANGE_CHUNKS = 4  # requests of 4 chunks or more (64 MiB by default) while every worker gets one (range_size)
MULTIPART_ETAG = re.compile(r"[0-9a-f]{32}-[0-9]{1,5}")  # S3's multipart ETag: MD5 of the part MD5s, "-" parts
_SUMS_LINE = re.compile(r"([0-9a-fA-F]{64})\s+\*?(?:\./)?(.+)")

Known = dict[tuple[str, str, int], str]  # (path, ETag, size) -> sha256 this node recorded (Store.known_sha256)


def source_revision(objects: list[ObjectInfo]) -> str:
    """A digest of the source's current listing (path, size, ETag/version): names 'this content' for @revision."""
    h = hashlib.sha256()
    for o in sorted(objects, key=lambda o: o.relpath):
        h.update(f"{o.relpath}\0{o.size}\0{o.etag or ''}\0{o.version_id or ''}\n".encode())
    return h.hexdigest()


def check_revision(ref: ModelRef, source: Source, objects: list[ObjectInfo]) -> None:
    """A revision that is not a cached snapshot must name the source's current content (its ETag set), unless
    the source resolved the revision itself (hf://: a branch, tag or commit of the repo)."""
    if not ref.revision or source.resolves_revision:
        return
    current = source_revision(objects)
    if not current.startswith(ref.revision) or len(ref.revision) < 6:
        raise SourceNotFoundError(
            f"revision {ref.revision!r} of {ref.uri} is neither a cached snapshot nor the source's current "
            f"content (revision {current[:12]}); use `weightcache ls` for cached snapshots, or drop @revision")


class Planner:
    """What every file of a listing must match, and which are linked from blobs the store has."""

    def __init__(self, store: Store, *, peers: PeerSet | None, require_source_checksum: bool) -> None:
        self.store, self.peers, self.require_source_checksum = store, peers, require_source_checksum

    def items(self, ref: ModelRef, source: Source, objects: list[ObjectInfo]) -> list[Item]:
        items = [Item(o, o.relpath) for o in objects]
        sidecars = read_sidecars(source, items)
        known_here = self.store.known_sha256(ref.uri)
        by_record = [item for item in items if self._expect(item, source, sidecars, known_here)]
        self._origin_checks(source, items)
        for item in items:
            if item.check == NO_SOURCE_CHECK and item.source_check is not None:
                item.check = check_name(item.source_check[0])
        if by_record:  # linked on this node's own record: the check its download had
            checks = self.store.known_checks(ref.uri, [(i.relpath, i.obj.etag or "", i.obj.size) for i in by_record])
            for item in by_record:
                item.check = checks.get((item.relpath, item.obj.etag or "", item.obj.size), NO_SOURCE_CHECK)
        self._require_checks(ref, items)
        return items

    def _expect(self, item: Item, source: Source, sidecars: dict[str, tuple[str, str]], known_here: Known) -> bool:
        """Fill in what the item's downloaded bytes must match, and link it (dedup) only on trusted evidence.
        True when it is linked on this node's own record alone."""
        obj = item.obj
        trusted = _source_check(item, source)
        if item.expect_sha256 is None and item.relpath in sidecars:
            item.expect_sha256, item.check = sidecars[item.relpath]  # a claim: it checks downloaded bytes, never links
        recorded = known_here.get((item.relpath, obj.etag, obj.size)) if obj.etag else None
        if recorded is not None and self.store.blob_size(recorded) is None:
            recorded = None  # evicted since: download it (peers serve only what the bytes are checked against)
        known = trusted or recorded
        item.trusted_sha256 = known
        if known and self.store.blob_size(known) == obj.size:
            item.sha256, item.size = known, obj.size
            item.unsynced_blob = recorded is None  # a recorded blob was synced before its manifest
            return not trusted
        return False

    def _origin_checks(self, source: Source, items: list[Item]) -> None:
        """The node's own HEAD for the origin's identity and checksum (peers/identity.py) for every file peers may
        serve, when peers are configured; and for multipart S3 objects nothing else checks, the MD5 of their part
        MD5s over the part boundaries the store gives (`S3Source.multipart_check`): the check docs/peers.md
        describes for peers' bytes, here for the origin's."""
        if self.peers is not None and self.peers.urls:
            _peer_origins(source, [i for i in items if i.sha256 is None and not i.trusted_sha256])
        _multipart_checks(source, items)

    def _require_checks(self, ref: ModelRef, items: list[Item]) -> None:
        """requireSourceChecksum: no file whose bytes nothing from the source verifies (docs/fetch.md)."""
        unchecked = [i.relpath for i in items if i.check == NO_SOURCE_CHECK]
        if self.require_source_checksum and unchecked:
            shown = ", ".join(unchecked[:5]) + (f" and {len(unchecked) - 5} more" if len(unchecked) > 5 else "")
            raise NotAllowedError(
                f"{ref}: requireSourceChecksum refuses {len(unchecked)} file(s) that nothing from the source "
                f"verifies ({shown}): no checksum, MD5 ETag or sidecar; upload them with a checksum "
                "(aws s3 cp --checksum-algorithm SHA256), add a SHA256SUMS file, or turn the policy off")


def _peer_origins(source: Source, wanted: list[Item]) -> None:
    found = origin_evidence(source, [i.obj for i in wanted]) if wanted else {}
    for item in wanted:
        if (evidence := found.get(item.obj.key)) is not None:
            item.peer_origin, item.source_check = evidence.oid, evidence.check


def _multipart_checks(source: Source, items: list[Item]) -> None:
    todo = [i for i in items if i.sha256 is None and i.expect_sha256 is None and i.source_check is None
            and MULTIPART_ETAG.fullmatch(i.obj.etag or "")]
    if not todo:
        return
    with ThreadPoolExecutor(min(16, len(todo)), thread_name_prefix="s3-parts") as pool:
        for item, sizes in zip(todo, pool.map(source.multipart_check, [i.obj for i in todo]), strict=True):
            if sizes:
                item.source_check = (COMPOSITE + ",".join(map(str, sizes)), item.obj.etag or "")


def _source_check(item: Item, source: Source) -> str | None:
    """The check the source's listing gives: a sha256 only S3's own (sources/base.py: computed and verified by the
    store), returned as trusted; else a checksum we can compute, else an MD5 ETag."""
    obj = item.obj
    if obj.checksum and obj.checksum[0] == "sha256":
        item.expect_sha256 = obj.checksum[1].lower()
        item.check = "sha256"
        return item.expect_sha256
    if obj.checksum and (obj.checksum[0] == "md5" or new_hasher(obj.checksum[0]) is not None):
        item.source_check = obj.checksum  # S3's CRCs; gs:// md5Hash or crc32c, az:// Content-MD5
        item.check = obj.checksum[0]
    elif (md5 := source.etag_md5(obj)) is not None:
        item.source_check = ("md5", md5)
        item.check = "md5-etag"
    return None


def read_sidecars(source: Source, items: list[Item]) -> dict[str, tuple[str, str]]:
    """`<file>.sha256` ("<hex> [name]") and `SHA256SUMS` (sha256sum format) the model carries, and the digests
    the source's listing names (`claimed_sha256`: the hub's lfs.sha256, an OCI layer's digest). All claims:
    they check bytes. Path -> (sha256, the check it makes: "sha256" for the source's own, else "sidecar")."""
    out: dict[str, tuple[str, str]] = {}
    for item in items:
        if digest := source.claimed_sha256(item.obj):
            out[item.relpath] = (digest, "sha256")
    for item in items:
        name = item.relpath
        if not (name.endswith(".sha256") or name.rsplit("/", 1)[-1] == "SHA256SUMS") or item.obj.size > SIDECAR_MAX:
            continue
        buf = bytearray(item.obj.size)
        source.read_into(item.obj, 0, memoryview(buf))
        for path, digest in _sidecar_digests(name, buf.decode("utf-8", "replace")):
            out.setdefault(path, (digest, "sidecar"))  # the listing's own claim first
    return out


def _sidecar_digests(name: str, text: str) -> Iterator[tuple[str, str]]:
    if name.endswith(".sha256"):
        digest = text.split()[0].lower() if text.split() else ""
        if re.fullmatch(r"[0-9a-f]{64}", digest):
            yield name[: -len(".sha256")], digest
        return
    base = name.rsplit("/", 1)[0] + "/" if "/" in name else ""
    for line in text.splitlines():
        if m := _SUMS_LINE.fullmatch(line.strip()):
            yield base + m.group(2), m.group(1).lower()


def check_name(algorithm: str) -> str:
    """The manifest's name (vocabulary.SOURCE_CHECKS) for a source check's algorithm."""
    if algorithm == "md5":
        return "md5-etag"
    return "multipart-md5" if algorithm.startswith(COMPOSITE) else algorithm  # crc32, crc32c, crc64nvme


def peer_digests(ref: ModelRef, todo: list[Item]) -> dict[str, tuple[str | OriginId, int]]:
    """Peers may serve only blobs whose sha256 we know on trusted evidence: a digest the source merely claims
    could name another model's blob, and asking peers for it would widen this node's access."""
    digests: dict[str, tuple[str | OriginId, int]] = {
        i.obj.key: (i.trusted_sha256, i.obj.size) for i in todo if i.trusted_sha256}
    digests.update({i.obj.key: (i.peer_origin, i.obj.size) for i in todo if i.peer_origin and not i.trusted_sha256})
    if len(digests) < len(todo):
        log.info("%s: %d of %d files have neither a trusted sha256 nor an origin checksum peers' bytes can be "
                 "checked against: they come from the origin only", ref, len(todo) - len(digests), len(todo))
    return digests


def range_size(total: int, *, concurrency: int, chunk_size: int) -> int:
    """Bytes per request, in whole chunks, at most 256 MiB: about two per worker (one that drew a slow
    connection leaves the rest to the queue), but MIN_RANGE_CHUNKS chunks or more as long as every worker
    still gets one: each request waits a first byte (at 100 MB/s per connection a 30 ms wait is 15% of a
    16 MiB request, 4% of a 64 MiB one) and some servers re-read the whole object per GET. Memory and
    retries do not grow with it: a range streams through one piece, and a failure resumes from its first
    missing piece."""
    one_each = -(-total // concurrency)
    size = max(min(MIN_RANGE_CHUNKS * chunk_size, one_each), -(-one_each // 2))
    return max(1, -(-min(256 << 20, size) // chunk_size)) * chunk_size


def open_parts(ref: ModelRef, store: Store, todo: list[Item], *, range_size: int, chunk_size: int,
               drop_behind: bool = False) -> int:
    """A part file for each download (journalled when it has more than one chunk to resume); returns the bytes
    resumed from an earlier run's journals. `drop_behind`: no one reads the files as they arrive (no stream)
    and the fetch is large (download.DROP_BEHIND_MIN): their hashed bytes leave the page cache
    (download.PartialFile._drop_to)."""
    parts = store.partial_dir()  # checked once: each writer opens O_NOFOLLOW
    for item in todo:
        check = item.source_check
        item.partial = PartialFile(
            parts / f"{ref.key}.{hashlib.sha256(item.relpath.encode()).hexdigest()[:16]}.part",
            item.obj, range_size=range_size,
            source_check=_hasher_factory(check[0]) if check and not item.expect_sha256 else None,
            check_beside=not check or check[0] not in CRCS,
            journalled=item.obj.size > chunk_size,  # a one-chunk file has nothing to resume
            drop_behind=drop_behind)
    _drop_leftover_parts(parts, [partial(i) for i in todo if not partial(i).journalled])
    return sum(_resumed_size(i) for i in todo)


class _AnyPartSize:
    """The multipart ETag over each candidate part size at once (a store that does not say its part size):
    hexdigest() is every candidate's digest, space-separated; one matching the ETag passes (publish.verified)."""

    def __init__(self, sizes: list[int]) -> None:
        self._each = [CompositeMD5(size) for size in sizes]

    def update(self, data: bytes | memoryview) -> None:
        for hasher in self._each:
            hasher.update(data)

    def update_at(self, offset: int, data: memoryview) -> None:
        for hasher in self._each:
            hasher.update_at(offset, data)

    def pending(self, length: int) -> bool:
        return any(hasher.pending(length) for hasher in self._each)

    def hexdigest(self) -> str:
        return " ".join(h.hexdigest() for h in self._each)


def _hasher_factory(algorithm: str) -> Callable[[], SourceCheck]:
    if algorithm == "md5":
        return lambda: InOrder(hashlib.md5(usedforsecurity=False))
    if algorithm.startswith(COMPOSITE) and "," in algorithm:
        sizes = [int(size) for size in algorithm[len(COMPOSITE):].split(",")]
        return lambda: _AnyPartSize(sizes)
    if (composite := composite_factory(algorithm)) is not None:  # a multipart ETag of uniform parts
        return composite
    return lambda: InOrder(new_hasher(algorithm) or hashlib.sha256())  # _source_check keeps only computable ones


def _drop_leftover_parts(parts: Path, started_over: list[PartialFile]) -> None:
    """A one-request file is started over, so a part or journal an earlier run left at its name (a crash, or a
    smaller chunk size then) is removed before a peer can open it as this download in flight. One listing of
    partial/ rather than an unlink per file: most small files find nothing."""
    names = {n for n in os.listdir(parts) if n.endswith((".part", ".journal"))} if started_over else set()
    if not names:  # the usual case: no Path built per file
        return
    for part in started_over:
        for path in (part.part, part.journal):
            if path.name in names:
                path.unlink(missing_ok=True)


def _resumed_size(item: Item) -> int:
    if not partial(item).journalled:
        return 0  # started over: nothing of it is kept
    try:
        return partial(item).part.stat().st_size if partial(item).journal.exists() else 0
    except FileNotFoundError:
        return 0
