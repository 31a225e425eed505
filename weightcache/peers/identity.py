"""Objects addressed by the origin's identity, for blobs whose sha256 no origin vouches for (docs/peers.md,
"Objects without a SHA-256 checksum").

An `OriginId` is what the asking node itself got from the origin's listing and HEAD under its own credentials:
(scheme, bucket, key, ETag, version, size). A peer maps it to a blob only from records of its own downloads of
that very identity (manifests it wrote: model URI + path = key, ETag, version, size), so a bucket can only ever
be answered with bytes that bucket served; the identity names bucket and key, so no listing can alias another
bucket's or prefix's blob. The asking node checks what it receives against the origin's own checksum
(`origin_check`): the ETag as MD5 (single part), the multipart ETag as MD5 of part MD5s (part size from the
node's own HEAD ?partNumber=1), else a full-object CRC32/CRC32C/CRC64NVME.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from weightcache.checksums import FACTORIES
from weightcache.sources.base import ObjectInfo, Source

log = logging.getLogger(__name__)

MIN_PEER_BYTES = 1 << 20  # smaller objects come from the origin: a HEAD of our own costs about what they do
COMPOSITE = "md5-parts:"  # + part size: the multipart ETag, MD5 of the part MD5s, "-" N
_MD5 = re.compile(r"[0-9a-f]{32}")
_MULTIPART = re.compile(r"([0-9a-f]{32})-([0-9]{1,5})")


@dataclass(frozen=True)
class OriginId:
    """One object version as its origin names it. `address` keys it in a node's downloads in flight."""

    scheme: str
    bucket: str
    key: str
    etag: str
    version: str | None
    size: int

    @property
    def address(self) -> str:
        text = "\0".join([self.scheme, self.bucket, self.key, self.etag, self.version or "", str(self.size)])
        return "origin-" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()

    def query(self) -> dict[str, str]:
        out = {"scheme": self.scheme, "bucket": self.bucket, "key": self.key, "etag": self.etag,
               "size": str(self.size)}
        if self.version:
            out["version"] = self.version
        return out

    @classmethod
    def from_query(cls, q: Any) -> OriginId | None:
        """From a request's query (untrusted): None when a field is missing or malformed."""
        try:
            scheme, bucket, key, etag = (str(q[n]) for n in ("scheme", "bucket", "key", "etag"))
            size_text = str(q["size"])
        except KeyError:
            return None
        version = q.get("version")
        if (scheme != "s3" or not bucket or not key or not etag or len(key) > 4096 or len(etag) > 64
                or not re.fullmatch(r"[0-9]{1,19}", size_text)):
            return None
        return cls(scheme, bucket, key, etag, str(version) if version else None, int(size_text))


def record_matches(oid: OriginId, uri: str, path: str, etag: str | None, version: str | None, size: int) -> bool:
    """A manifest row of this node (model `uri`, `path` in it) records exactly the object `oid` names."""
    if etag != oid.etag or size != oid.size or (oid.version and version and oid.version != version):
        return False
    return uri == f"{oid.scheme}://{oid.bucket}/{oid.key[:len(oid.key) - len(path)]}" and oid.key.endswith(path)


class CompositeMD5:
    """The multipart ETag of uniform parts of `part_size`: MD5 of the concatenated part MD5s, then "-N".

    Each part's MD5 is its own, so a part's bytes may be taken as they arrive (`update_at`, by the worker that
    received them, while they are in its core's cache) wherever they continue what that part has taken; `update`
    takes every byte in order and passes over what `update_at` took. The MD5 then runs beside the download on
    every worker instead of after it on one thread: it is 0.65 GB/s here, and at the in-order frontier most of
    a model read on parallel ranges waited for it after its last byte (docs/fetch.md, "Small models")."""

    def __init__(self, part_size: int) -> None:
        self.part_size = part_size
        self._parts: dict[int, _Part] = {}
        self._mu = threading.Lock()
        self._pos = 0  # bytes `update` has seen

    def update(self, data: bytes | memoryview) -> None:
        for index, within, piece in self._slices(self._pos, data):
            self._part(index).take(within, piece, only_next=False)
        self._pos += len(data)

    def update_at(self, offset: int, data: memoryview) -> None:
        """Bytes at `offset`, arrived in any order: each part takes those that continue it; `update` the rest."""
        for index, within, piece in self._slices(offset, data):
            self._part(index).take(within, piece, only_next=True)

    def pending(self, length: int) -> bool:
        """Whether `update` of the next `length` bytes hashes any: a part they do not all continue from what it
        took. Usually none does (each byte continued its part as it arrived); a resumed file's, a split range's."""
        offset, end = self._pos, self._pos + length
        while offset < end:
            index, within = divmod(offset, self.part_size)
            n = min(self.part_size - within, end - offset)
            if self._part(index).taken < within + n:
                return True
            offset += n
        return False

    def hexdigest(self) -> str:
        digests = [self._parts[i].digest() for i in range(-(-self._pos // self.part_size))]
        return f"{hashlib.md5(b''.join(digests), usedforsecurity=False).hexdigest()}-{len(digests)}"

    def _slices(self, offset: int, data: bytes | memoryview) -> Iterator[tuple[int, int, memoryview]]:
        view = memoryview(data)
        while len(view):
            index, within = divmod(offset, self.part_size)
            n = min(self.part_size - within, len(view))
            yield index, within, view[:n]
            view, offset = view[n:], offset + n

    def _part(self, index: int) -> _Part:
        with self._mu:
            part = self._parts.get(index)
            if part is None:
                part = self._parts[index] = _Part()
            return part


class _Part:
    """One part's MD5 and how many of its bytes it has taken; one taker at a time."""

    def __init__(self) -> None:
        self._md5 = hashlib.md5(usedforsecurity=False)
        self._taken = 0
        self._mu = threading.Lock()

    def take(self, within: int, data: memoryview, *, only_next: bool) -> None:
        """Bytes at `within` of the part: those past what it has taken, when they continue it (`only_next`:
        else none). Without `only_next` they always do: `update` comes in order."""
        with self._mu:
            skip = self._taken - within
            if skip < 0 or skip >= len(data) or (only_next and skip):
                return
            self._md5.update(data[skip:])
            self._taken = within + len(data)

    @property
    def taken(self) -> int:
        """Bytes of the part hashed so far (it only grows: a read without the lock is at most behind)."""
        return self._taken

    def digest(self) -> bytes:
        with self._mu:
            return self._md5.digest()


def composite_factory(algorithm: str) -> Callable[[], CompositeMD5] | None:
    """The hasher of a `COMPOSITE` algorithm name, else None."""
    if not algorithm.startswith(COMPOSITE):
        return None
    part = int(algorithm[len(COMPOSITE):])
    return lambda: CompositeMD5(part)


@dataclass(frozen=True)
class OriginEvidence:
    oid: OriginId
    check: tuple[str, str]  # (algorithm, want) the received bytes must match: md5, md5-parts:N, crc32, ...


def origin_evidence(source: Source, objects: Iterable[ObjectInfo]) -> dict[str, OriginEvidence]:
    """Object key -> identity and origin check, for the objects peers may serve by identity: S3 objects of
    MIN_PEER_BYTES or more with an MD5 ETag (single part or uniform parts) or a full-object CRC, as this node's
    own HEAD (?partNumber=1, If-Match the listed ETag) shows them. Others are left out (the origin serves them)."""
    bucket = source.ref.bucket
    if source.name != "s3":
        return {}
    prefix = source.ref.prefix
    wanted = [o for o in objects if o.etag and o.size >= MIN_PEER_BYTES and o.key == prefix + o.relpath]
    if not wanted:
        return {}

    def one(obj: ObjectInfo) -> OriginEvidence | None:
        try:
            return _evidence(source, bucket, obj)
        except Exception as exc:  # no evidence: the origin serves it, as before
            log.info("s3://%s/%s: no origin evidence for peers (%s: %s)", bucket, obj.key, type(exc).__name__, exc)
            return None

    with ThreadPoolExecutor(min(16, len(wanted)), thread_name_prefix="s3-evidence") as pool:
        found = list(pool.map(one, wanted))
    return {o.key: e for o, e in zip(wanted, found, strict=True) if e is not None}


def _evidence(source: Source, bucket: str, obj: ObjectInfo) -> OriginEvidence | None:
    etag = obj.etag or ""
    head = source.head(obj, IfMatch=f'"{etag}"')
    if head is None:
        return None
    encrypted = str(head.get("ServerSideEncryption", "")).startswith("aws:kms") or head.get("SSECustomerAlgorithm")
    version = head.get("VersionId") or obj.version_id
    oid = OriginId("s3", bucket, obj.key, etag, version if version and version != "null" else None, obj.size)
    if int(head.get("ContentLength", -1)) != obj.size:
        return None
    if not encrypted and (check := _etag_check(source, obj, etag)) is not None:
        return OriginEvidence(oid, check)
    if obj.checksum and obj.checksum[0] in FACTORIES and obj.checksum[0] != "sha256":
        return OriginEvidence(oid, obj.checksum)
    return None


def _etag_check(source: Source, obj: ObjectInfo, etag: str) -> tuple[str, str] | None:
    """The ETag as a check of the bytes: the MD5 of a single-part object, or the MD5 of the part MD5s where the
    parts are of one size (from ?partNumber=1; the last part's size checked against it)."""
    if _MD5.fullmatch(etag):
        return ("md5", etag)
    m = _MULTIPART.fullmatch(etag)
    if m is None:
        return None
    first = source.head(obj, PartNumber=1) or {}
    parts, part = int(first.get("PartsCount") or 0), int(first.get("ContentLength") or 0)
    if parts != int(m[2]) or part <= 0 or -(-obj.size // part) != parts:
        return None
    last = obj.size - (parts - 1) * part
    if parts > 1 and int((source.head(obj, PartNumber=parts) or {}).get("ContentLength", -1)) != last:
        return None
    return (f"{COMPOSITE}{part}", etag)
