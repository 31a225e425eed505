"""Engine caches: what an inference engine compiles on its first start, kept in the store as an artifact.

vLLM compiles a model with torch inductor on its first start (enforce_eager=False) and keeps the result under
VLLM_CACHE_ROOT (and TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR); a start that finds that cache skips the
compile. This module stores such a directory as an ordinary snapshot of the store (blobs + hard-linked read-only
tree + manifest + ref: `Store.publish`, nothing second), keyed by

    (model snapshot id, engine, engine version, device kind, trust domain)

The key is never taken from the artifact: the daemon computes it from the model snapshot it serves to the
requester (through the node's `Authority`: the requester must hold a Grant for that model) and the engine name,
version and device the requester declares. The trust domain is the namespace that handed the cache over (or
`_admin` for the node's admin): compile caches hold code the engine runs (inductor's generated Python, Triton's
shared objects), so a cache one namespace wrote is never served to another; one the admin put serves every
namespace that may have the model. See docs/engine-caches.md.

The artifact's reference has its own scheme, `weightcache-engine-cache://` (not in `weightcache.uri.SCHEMES`), so no
model door (CSI `model`, `PUT /v1/models`, a ModelCache) can name it: it is found only by `lookup` with its key.

Ingest (`ingest_tar`) takes an uncompressed tar stream, hostile until checked: regular files and directories only
(no symlink, hard link, device, FIFO, sparse or continuation member), every path checked by the store's
`validate_relpath` (no `..`, no absolute path, no NUL, bounded depth and length), no duplicate and no file under
a file, bounded entries, bounded bytes per file and in all, bounded extended headers (the header checks are
weightcache/intake.py's, shared with OCI tar layers). A pod's directory (`hand_over`) is counted by what its files
take on its filesystem (`st_blocks`), and a sparse file is refused: what the store writes, the pod paid for.
Files are written into `partial/` as they arrive (hashing as they are written) under the key's lock, each one's
room made first (`intake.Room`) within the engine caches' own budgets, per node and per namespace, and the store's
disk budget and floor, evicting only engine caches, never a model; only when the whole stream has been read and
checked do they become blobs and a snapshot. Anything refused leaves nothing published and removes what it wrote.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import stat
import tarfile
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, cast

from weightcache import intake
from weightcache.access import Requester
from weightcache.engine_name import EngineName
from weightcache.engine_name import invalid as _bad
from weightcache.errors import (
    HostileKeyError,
    InsufficientSpaceError,
    InvalidRequestError,
    NotCachedError,
    SourceError,
)
from weightcache.peers import PeerClient
from weightcache.retry import Retryable
from weightcache.store import FileEntry, Snapshot, SnapshotInfo, Store, validate_relpath
from weightcache.store.records import snapshot_id_for
from weightcache.units import fmt_bytes
from weightcache.uri import ModelRef
from weightcache.vocabulary import ENGINE_CACHE_ADMIN_DOMAIN, ENGINE_CACHE_READY, ENGINE_CACHE_SCHEME, ENGINE_REPORT

log = logging.getLogger(__name__)

SCHEME = ENGINE_CACHE_SCHEME
ADMIN_DOMAIN = ENGINE_CACHE_ADMIN_DOMAIN  # a cache the node's admin put: served to every granted namespace
MAX_BYTES = 4 << 30  # a vLLM compile cache of a large model is tens to hundreds of MB; Triton's a few hundred
MAX_ENTRIES = 20_000  # members of the tar (files and directories)
MAX_HEADER_BYTES = intake.MAX_HEADER_BYTES  # one pax / GNU long-name extended header
NODE_BYTES = 32 << 30  # every engine cache on the node: their own budget, beside the models'
NAMESPACE_BYTES = 8 << 30  # one namespace's engine caches (the admin's count against the node's budget only)
SPARSE_SLACK = 4096  # a file may name this many bytes more than it takes on disk (one page; inline data)
CHUNK = 1 << 20

_SNAPSHOT_ID = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


@dataclass(frozen=True)
class EngineCacheKey:
    """The whole key: the model snapshot the daemon served, the declared engine, and who may read it."""

    model_snapshot: str
    name: EngineName
    domain: str  # the namespace that put it, or ADMIN_DOMAIN

    def __post_init__(self) -> None:
        if not _SNAPSHOT_ID.fullmatch(self.model_snapshot):
            raise _bad(f"{self.model_snapshot[:80]!r} is not a snapshot id")
        if self.domain != ADMIN_DOMAIN and not _NAMESPACE.fullmatch(self.domain):
            raise _bad(f"{self.domain[:80]!r} is not a namespace name")

    @classmethod
    def for_model(cls, model: Snapshot, name: EngineName, who: Requester) -> EngineCacheKey:
        return cls(model.id, name, domain_of(who))

    @property
    def ref(self) -> ModelRef:
        """The artifact's reference in the store: its own scheme, so no model door can ask for it."""
        n = self.name  # a compile key is one more level: the keys without one keep their references
        compile = f"{n.compile}/" if n.compile else ""
        return ModelRef(SCHEME, self.model_snapshot, f"{n.engine}/{n.version}/{n.device}/{self.domain}/{compile}")

    def __str__(self) -> str:
        return f"{self.name} for snapshot {self.model_snapshot[:12]} ({self.domain})"


def domain_of(who: Requester) -> str:
    return ADMIN_DOMAIN if who.namespace is None else who.namespace


def is_engine_cache(snapshot: Snapshot) -> bool:
    """Whether a snapshot of the store is an engine cache (not a model: no DRA device, no readiness label)."""
    return snapshot.uri.startswith(SCHEME + "://")


def key_of(snapshot: Snapshot) -> EngineCacheKey | None:
    """The key an engine-cache snapshot was published under, read back from its reference (for listings); None
    for a model or for a reference that does not parse as one (never trusted for serving: `lookup` is)."""
    if not is_engine_cache(snapshot):
        return None
    parts = snapshot.uri[len(SCHEME) + 3:].split("/")
    if len(parts) not in (6, 7) or parts[-1]:
        return None
    try:
        return EngineCacheKey(parts[0], EngineName(*parts[1:4], *parts[5:6]), parts[4])
    except InvalidRequestError:
        return None


def lister(namespace: str | None) -> Requester:
    """Who asks for a listing: a namespace (its name checked) or, without one, the node's admin."""
    if namespace is not None and not _NAMESPACE.fullmatch(namespace):
        raise _bad(f"{namespace[:80]!r} is not a namespace name")
    return Requester(namespace)


def visible_to(key: EngineCacheKey, who: Requester) -> bool:
    """Whether `who` is served caches of `key`'s domain: its own, or the admin's; the admin sees all of them."""
    return who.namespace is None or key.domain in (who.namespace, ADMIN_DOMAIN)


def lookup(store: Store, model: Snapshot, name: EngineName, who: Requester) -> Snapshot | None:
    """The engine cache for exactly (the model snapshot `who` was granted, `name`): the one `who`'s own namespace
    put, else one the admin put; None when there is none. The caller authorized `who` for `model` first."""
    domains = [domain_of(who)] + ([ADMIN_DOMAIN] if who.namespace is not None else [])
    for domain in domains:
        found = _exact(store, EngineCacheKey(model.id, name, domain))
        if found is not None:
            return found
    return None


def _exact(store: Store, key: EngineCacheKey) -> Snapshot | None:
    found = store.lookup(key.ref)
    return found if found is not None and found.uri == key.ref.uri else None


@dataclass(frozen=True)
class EngineCacheLimits:
    max_bytes: int = MAX_BYTES  # one cache (and a pod's scratch)
    max_entries: int = MAX_ENTRIES
    max_header_bytes: int = MAX_HEADER_BYTES
    node_bytes: int = NODE_BYTES  # every engine cache in the store
    namespace_bytes: int = NAMESPACE_BYTES  # one namespace's


class Readable(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


class _Staging:
    """Files written into partial/ under the key's lock, hashed as written; blobs and a snapshot only at commit."""

    def __init__(self, store: Store, key: EngineCacheKey, limits: EngineCacheLimits) -> None:
        self.store, self.key, self.limits = store, key, limits
        self.files: list[tuple[FileEntry, Path]] = []
        self.paths: set[str] = set()
        self.dirs: set[str] = set()
        self.total = 0
        self.entries = 0
        self.room = _room(store, key, limits)

    def count_entry(self) -> None:
        self.entries += 1
        if self.entries > self.limits.max_entries:
            raise _bad(f"more than {self.limits.max_entries} entries; an engine cache holds at most that many")

    def add_dir(self, relpath: str) -> None:
        relpath = _clean(relpath)
        if relpath and relpath in self.paths:
            raise _bad(f"{relpath!r} is both a file and a directory")
        if relpath:
            self._note_parents(relpath + "/x")
            self.dirs.add(relpath)

    def add_file(self, relpath: str, size: int, read: Callable[[int], bytes], *, charge: int | None = None) -> None:
        """One file of `size` bytes read through `read`; `charge`: what it counts against the bounds and the
        budgets when more than its size (what it takes on the pod's filesystem)."""
        charge = size if charge is None else max(size, charge)
        relpath = _clean(relpath)
        if not relpath:
            raise _bad("a file with an empty name")
        if relpath in self.paths or relpath in self.dirs:
            raise _bad(f"{relpath!r} appears twice")
        self._note_parents(relpath)
        if size < 0 or charge > self.limits.max_bytes - self.total:
            raise _bad(f"{relpath!r} ({charge} bytes) takes the cache past {self.limits.max_bytes} bytes")
        self.paths.add(relpath)
        self.room.take(charge)
        name = f"{self.key.ref.key}.ec{len(self.files)}"
        part = self.store.partial_path(name)
        digest = hashlib.sha256()
        written = 0
        with self.store.tree.dir(part.parent, create=True) as dfd:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=dfd)
        self.files.append((FileEntry(relpath, size, ""), part))  # registered at once: abort removes it
        try:
            while written < size:
                data = read(min(CHUNK, size - written))
                if not data:
                    raise _bad(f"{relpath!r} ends after {written} of its {size} bytes (a truncated stream)")
                digest.update(data)
                _write_all(fd, data)
                written += len(data)
        finally:
            os.close(fd)
        self.total += charge
        self.files[-1] = (FileEntry(relpath, size, digest.hexdigest()), part)

    def _note_parents(self, relpath: str) -> None:
        parts = relpath.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            parent = "/".join(parts[:i])
            if parent in self.paths:
                raise _bad(f"{relpath!r} lies under {parent!r}, which is a file")
            self.dirs.add(parent)

    def commit(self) -> Snapshot:
        if not self.files:
            raise _bad("the cache holds no file")
        self.store.add_blobs([(part, entry.sha256) for entry, part in self.files])
        moved = list(self.files)
        self.files = []  # the parts are blobs now (or were dropped as duplicates): nothing of them to remove
        return self.store.publish(self.key.ref, [entry for entry, _ in moved])

    def abort(self) -> None:
        for _, part in self.files:
            try:
                self.store.tree.unlink(part)
            except OSError as exc:
                log.warning("could not remove %s of a refused engine cache: %s", part, exc)
        self.files = []


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _clean(name: str) -> str:
    """A member name as a store path: a leading './' and a trailing '/' dropped, then the store's own check."""
    while name.startswith("./"):
        name = name[2:]
    name = name.rstrip("/")
    if name in ("", "."):
        return ""
    try:
        return validate_relpath(name)
    except HostileKeyError as exc:
        raise _bad(f"refusing path {name[:200]!r}: {exc.reason}") from None


def _room(store: Store, key: EngineCacheKey, limits: EngineCacheLimits) -> intake.Room:
    """Room for the files of engine cache `key` as they are written: the engine caches' budgets (`_make_room`),
    then the store's disk budget and floor, evicting only engine caches."""
    return intake.Room(store, uri=key.ref.uri, cap=limits.max_bytes, evictable=is_engine_cache,
                       budget=lambda total: _make_room(store, key, total, limits))


def _make_room(store: Store, key: EngineCacheKey, total: int, limits: EngineCacheLimits) -> None:
    """Room for `total` bytes of engine cache `key` within the engine caches' own budgets: the node's, and the
    namespace's own (a cache the admin put counts against the node's only). Made by evicting engine caches alone,
    least recently used, unleased and unpinned (for a namespace's budget, its own): a hand-over never costs
    anyone's model its place. InsufficientSpaceError when that cannot free enough."""
    budgets: list[tuple[int, str, Callable[[EngineCacheKey], bool]]] = [
        (limits.node_bytes, "this node's engine caches", lambda _: True)]
    if key.domain != ADMIN_DOMAIN:
        budgets.append((limits.namespace_bytes, f"namespace {key.domain}'s engine caches",
                        lambda k: k.domain == key.domain))
    for budget, whose, counted in budgets:
        infos = store.list()
        ids = {i.snapshot.id for i in infos if (k := key_of(i.snapshot)) is not None and counted(k)}
        used = _distinct_bytes(infos, ids)
        if used + total <= budget:
            continue
        keep = frozenset(i.snapshot.id for i in infos if i.snapshot.id not in ids)
        with contextlib.suppress(InsufficientSpaceError):
            if total <= budget:
                store.evict_to(budget - total, keep=keep, used=used)
        used = _distinct_bytes(store.list(), ids)
        if used + total > budget:
            raise InsufficientSpaceError(
                f"engine cache {key} needs {fmt_bytes(total)}, but {whose} use {fmt_bytes(used)} of their budget of "
                f"{fmt_bytes(budget)} and the rest are in use by pods or pinned; nothing was handed over (models "
                "are never evicted for an engine cache)")


def _distinct_bytes(infos: Sequence[SnapshotInfo], ids: set[str]) -> int:
    """Bytes the snapshots `ids` hold, each blob once."""
    return sum({f.sha256: f.size for i in infos if i.snapshot.id in ids for f in i.snapshot.files}.values())


@contextmanager
def _locked(store: Store, key: EngineCacheKey) -> Iterator[None]:
    fd = store.open_lock(key.ref.key)  # gc keeps partial files whose key's lock is held
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def ingest_tar(store: Store, key: EngineCacheKey, stream: Readable,
               limits: EngineCacheLimits = EngineCacheLimits()) -> Snapshot:
    """Publish the uncompressed tar `stream` as the engine cache `key`; raises InvalidRequestError naming what
    was refused, with nothing published and nothing left in partial/."""
    staging = _Staging(store, key, limits)
    with _locked(store, key):
        try:
            with intake.reading(cast(IO[bytes], stream), max_header_bytes=limits.max_header_bytes) as tf:
                for member in tf:
                    staging.count_entry()
                    if member.type in (tarfile.REGTYPE, tarfile.AREGTYPE) and not member.issparse():
                        data = tf.extractfile(member)
                        assert data is not None  # a regular member always has a reader
                        staging.add_file(member.name, member.size, data.read)
                    elif member.type == tarfile.DIRTYPE:
                        staging.add_dir(member.name)
                    else:
                        raise _bad(f"{member.name[:200]!r} is of tar type {member.type!r}; only regular files "
                                   "and directories are taken")
            snapshot = staging.commit()
        except intake.TarRefused as exc:
            staging.abort()
            raise _bad(str(exc)) from None
        except intake.TarDamaged as exc:
            staging.abort()
            raise _bad(f"the body is not an uncompressed tar stream, or is damaged or truncated ({exc})") from None
        except BaseException:
            staging.abort()
            raise
    log.info("engine cache %s published as snapshot %s (%d bytes)", key, snapshot.id[:12], snapshot.size)
    return snapshot


def ingest_dir(store: Store, key: EngineCacheKey, directory: str | Path,
               limits: EngineCacheLimits = EngineCacheLimits()) -> Snapshot:
    """Publish directory `directory` (e.g. under a pod's volume) as the engine cache `key`: walked one component
    at a time with O_NOFOLLOW through directory descriptors, so a symlink anywhere is refused, never followed;
    only directories and regular files; the same bounds as a tar."""
    with _locked(store, key):
        return _ingest_dir(store, key, directory, limits)


def hand_over(store: Store, key: EngineCacheKey, directory: str | Path,
              limits: EngineCacheLimits = EngineCacheLimits()) -> Snapshot | None:
    """A pod's engine-cache volume, read back when the pod has ended (csi/engine_volumes.py): published as `key`
    when it holds the pod's ready file (vocabulary.ENGINE_CACHE_READY, a regular file at its root: the engine
    served) and no cache has that key yet (the first hand-over wins; a later one never replaces what pods already
    got). The ready file and the engine's report (csi/telemetry.py) are not part of the cache. None when nothing
    was handed over; InvalidRequestError when the directory was refused (a symlink, a FIFO, past the bounds)."""
    with _locked(store, key):
        if _exact(store, key) is not None:
            log.info("engine cache %s exists already; the pod's copy is not handed over", key)
            return None
        if not is_ready(directory):
            log.info("engine cache %s: the pod wrote no %s at its volume's root (its engine never served), so "
                     "nothing is handed over", key, ENGINE_CACHE_READY)
            return None
        return _ingest_dir(store, key, directory, limits, skip=frozenset({ENGINE_CACHE_READY, ENGINE_REPORT}))


def is_ready(directory: str | Path) -> bool:
    """Whether `directory` holds the ready file at its root, a regular file (never through a link)."""
    try:
        top = os.open(directory, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.stat(ENGINE_CACHE_READY, dir_fd=top, follow_symlinks=False).st_mode)
    except OSError:
        return False
    finally:
        os.close(top)


def _ingest_dir(store: Store, key: EngineCacheKey, directory: str | Path, limits: EngineCacheLimits,
                skip: frozenset[str] = frozenset()) -> Snapshot:
    """ingest_dir under the key's lock, which the caller holds; `skip`: names at the top left out."""
    staging = _Staging(store, key, limits)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        top = os.open(directory, flags | os.O_DIRECTORY)
    except OSError as exc:
        raise _bad(f"{str(directory)[:200]!r} is not a directory that can be read without following a "
                   f"symlink ({os.strerror(exc.errno or errno.EIO)})") from None
    try:
        _walk(top, "", staging, flags, skip)
        snapshot = staging.commit()
    except BaseException:
        staging.abort()
        raise
    finally:
        os.close(top)
    log.info("engine cache %s published from %s as snapshot %s", key, directory, snapshot.id[:12])
    return snapshot


def open_up(snapshot: Snapshot, directory: str | Path, *, files: bool = True) -> None:
    """Make engine cache `snapshot`, seen through a pod's fresh overlay at `directory` (csi/mounts.overlay_at),
    writable by any uid: the engine writes into its cache root on a hit too, and a pod may run as any uid.
    Directories become 0777 and, when `files` (an overlay with metacopy), files 0666: each chmod copies up only
    the inode, never the data, and the artifact under the overlay stays 0444. Without metacopy a chmod would copy
    the whole file into the daemon's memory, so files keep 0444 (a pod replaces them rather than rewriting them).
    The tree is the store's own (no link in it) and no container has seen the mount yet, so paths are used."""
    dirs = {"/".join(parts[:i]) for entry in snapshot.files
            for parts in [validate_relpath(entry.path).split("/")] for i in range(1, len(parts))}
    top = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for rel in sorted(dirs):
            os.chmod(f"/proc/self/fd/{top}/{rel}", 0o777, follow_symlinks=False)
        for entry in snapshot.files if files else ():
            os.chmod(f"/proc/self/fd/{top}/{entry.path}", 0o666, follow_symlinks=False)
    finally:
        os.close(top)


def fill_from_peers(store: Store, key: EngineCacheKey, snapshot_id: str, peers: Sequence[PeerClient],
                    limits: EngineCacheLimits = EngineCacheLimits()) -> Snapshot:
    """Take the admin's engine cache `key` from a peer that holds snapshot `snapshot_id` of it: the id is the
    evidence (the first 40 hex of the tree's content digest, as `put` printed it on the node that has it), given
    by the node's admin, never by the peer. A peer's file list counts only if its digest is that id, and each
    blob only if its bytes hash to the digest in that list; a peer that lies is skipped for the next. Only the
    admin's domain: a namespace's caches stay on the node it handed them to. NotCachedError when no peer has it."""
    if key.domain != ADMIN_DOMAIN:
        raise _bad("only an admin's engine cache is taken from a peer; a namespace's caches stay on the node it "
                   "handed them to")
    if not _SNAPSHOT_ID.fullmatch(snapshot_id):
        raise _bad(f"{snapshot_id[:80]!r} is not a snapshot id (40 lowercase hex, as put printed it)")
    have = _exact(store, key)
    if have is not None and have.id == snapshot_id:
        return have
    listing = _peer_listing(peers, snapshot_id, limits)
    if listing is None:
        raise NotCachedError(f"no peer holds engine cache snapshot {snapshot_id[:12]}; put it on one node first "
                             "(weightcache engine-cache put), then fill the others from it")
    holder, files = listing
    ordered = [holder, *(p for p in peers if p is not holder)]
    with _locked(store, key):
        _room(store, key, limits).take(sum(f.size for f in files))
        parts: list[tuple[Path, str]] = []
        try:
            for i, entry in enumerate(files):
                if not store.has_blob(entry.sha256) and all(entry.sha256 != d for _, d in parts):
                    parts.append((_blob_from_peers(store, key, i, entry, ordered), entry.sha256))
            store.add_blobs(parts)
        except BaseException:
            for part, _ in parts:
                with contextlib.suppress(OSError):
                    store.tree.unlink(part)
            raise
        snapshot = store.publish(key.ref, files)
    log.info("engine cache %s filled from peer %s as snapshot %s (%d files, %d bytes)", key, holder.url,
             snapshot.id[:12], len(files), snapshot.size)
    return snapshot


def _peer_listing(peers: Sequence[PeerClient], snapshot_id: str,
                  limits: EngineCacheLimits) -> tuple[PeerClient, list[FileEntry]] | None:
    """The first peer whose file list of `snapshot_id` is well formed, within the bounds and digests to it."""
    for peer in peers:
        try:
            body = peer.engine_cache_files(snapshot_id, limit=limits.max_entries * 4096)
            if body is None:
                continue
            files = _checked_listing(body, limits)
        except (SourceError, InvalidRequestError) as exc:
            log.warning("engine cache %s: %s", snapshot_id[:12], exc)
            continue
        if snapshot_id_for(files) != snapshot_id:
            log.warning("peer %s sent a file list for engine cache %s that digests to another snapshot; ignored",
                        peer.url, snapshot_id[:12])
            continue
        return peer, files
    return None


def _checked_listing(body: Any, limits: EngineCacheLimits) -> list[FileEntry]:
    rows = body.get("files") if isinstance(body, dict) else None
    if not isinstance(rows, list) or not rows or len(rows) > limits.max_entries:
        raise _bad(f"a peer's file list is not 1 to {limits.max_entries} [path, size, sha256] rows")
    files, total, seen = [], 0, set()
    for row in rows:
        if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str) and type(row[1]) is int
                and isinstance(row[2], str) and _SHA256.fullmatch(row[2]) and 0 <= row[1] <= limits.max_bytes):
            raise _bad(f"a peer's file list holds a malformed row {str(row)[:120]!r}")
        path = _clean(row[0])
        total += row[1]
        if not path or path in seen or total > limits.max_bytes:
            raise _bad(f"a peer's file list repeats {path!r}, names an empty path or passes {limits.max_bytes} bytes")
        seen.add(path)
        files.append(FileEntry(path, row[1], row[2]))
    return files


def _blob_from_peers(store: Store, key: EngineCacheKey, index: int, entry: FileEntry,
                     peers: Sequence[PeerClient]) -> Path:
    """One blob of the cache into partial/ (under the key's lock), from the first peer whose bytes hash to it."""
    name = f"{key.ref.key}.ecp{index}"
    part = store.partial_path(name)
    for peer in peers:
        digest = hashlib.sha256()
        with store.tree.dir(part.parent, create=True) as dfd:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=dfd)
        try:
            written = 0
            if entry.size:
                resp = peer.open_range(entry.sha256, 0, entry.size)
                try:
                    while written < entry.size and (data := resp.read(min(CHUNK, entry.size - written))):
                        digest.update(data)
                        _write_all(fd, data)
                        written += len(data)
                finally:
                    resp.release_conn()
        except (SourceError, Retryable, OSError) as exc:
            log.info("engine cache blob %s from peer %s: %s", entry.sha256[:12], peer.url, exc)
            continue
        finally:
            os.close(fd)
        if written == entry.size and digest.hexdigest() == entry.sha256:
            return part
        log.warning("peer %s sent bytes for blob %s of %s that do not hash to it; asking the next", peer.url,
                    entry.sha256[:12], entry.path)
    with contextlib.suppress(OSError):
        store.tree.unlink(part)
    raise NotCachedError(f"no peer sent blob {entry.sha256[:12]} ({entry.path}) of engine cache {key} whole "
                         "and intact; try again, or put the cache on this node")


def scratch_bounds(limits: EngineCacheLimits = EngineCacheLimits(), hit: Snapshot | None = None) -> tuple[int, int]:
    """(bytes, inodes) of a pod's engine-cache scratch filesystem: what a hand-over may take, the root directory
    and the ready file beside it; over a `hit`, room for an inode per entry of it as well (the overlay copies up
    each directory and, with metacopy, each file's inode when `open_up` opens it to every uid). The filesystem's
    own limits are what bound a pod that writes more."""
    extra = 0 if hit is None else 2 * len(hit.files) + 2  # its files, at most as many directories, upper and work
    return limits.max_bytes, limits.max_entries + 2 + extra


def _walk(dfd: int, prefix: str, staging: _Staging, flags: int, skip: frozenset[str] = frozenset()) -> None:
    for name in sorted(os.listdir(dfd)):
        if name in skip:
            continue
        staging.count_entry()
        rel = f"{prefix}{name}"
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            staging.add_dir(rel)
            sub = os.open(name, flags | os.O_DIRECTORY, dir_fd=dfd)
            try:
                _walk(sub, rel + "/", staging, flags)
            finally:
                os.close(sub)
        elif stat.S_ISREG(st.st_mode):
            fd = os.open(name, flags | os.O_NONBLOCK, dir_fd=dfd)
            try:
                now = os.fstat(fd)
                if not stat.S_ISREG(now.st_mode) or now.st_ino != st.st_ino:
                    raise _bad(f"{rel[:200]!r} was replaced while it was read")
                taken = now.st_blocks * 512  # what the pod paid for, on its own filesystem
                if now.st_size > taken + SPARSE_SLACK:  # holes read back as zeros: the store would write them all
                    raise _bad(f"{rel[:200]!r} is a sparse file ({now.st_size} bytes, {taken} of them on disk); "
                               "an engine cache holds files written whole")
                staging.add_file(rel, now.st_size, _reader(fd), charge=taken)
            finally:
                os.close(fd)
        else:
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file or directory"
            raise _bad(f"{rel[:200]!r} is {kind}; only regular files and directories are taken")


def _reader(fd: int) -> Callable[[int], bytes]:
    return lambda n: os.read(fd, n)


class Pipe:
    """A bounded, blocking byte pipe: an event loop `feed`s a request body in, `ingest_tar` reads it on a thread.
    At most `limit` bytes pass (more is refused: the body cap); `close(error)` ends it."""

    def __init__(self, limit: int, depth: int = 8) -> None:
        self.limit, self.passed = limit, 0
        self._chunks: list[bytes] = []
        self._cond = threading.Condition()
        self._depth = depth
        self._closed = False
        self._error: BaseException | None = None
        self._buf = b""

    def feed(self, data: bytes) -> None:
        """Blocks while `depth` chunks wait (call it from a thread); raises when the body passes the limit."""
        self.passed += len(data)
        if self.passed > self.limit:
            self.close(_bad(f"the body is larger than {self.limit} bytes"))
            raise _bad(f"the body is larger than {self.limit} bytes")
        with self._cond:
            while len(self._chunks) >= self._depth and not self._closed:
                self._cond.wait()
            if self._closed:
                return
            self._chunks.append(data)
            self._cond.notify_all()

    def close(self, error: BaseException | None = None) -> None:
        with self._cond:
            if error is not None and self._error is None:
                self._error = error
            self._closed = True
            self._cond.notify_all()

    def read(self, n: int = -1) -> bytes:
        out = bytearray()
        while n < 0 or len(out) < n:
            if not self._buf:
                with self._cond:
                    while not self._chunks and not self._closed:
                        self._cond.wait()
                    if self._chunks:
                        self._buf = self._chunks.pop(0)
                        self._cond.notify_all()
                    elif self._error is not None:
                        raise self._error
                    else:
                        break
            take = len(self._buf) if n < 0 else min(n - len(out), len(self._buf))
            out += self._buf[:take]
            self._buf = self._buf[take:]
        return bytes(out)


def body_limit(limits: EngineCacheLimits) -> int:
    """The most bytes a tar of a cache within `limits` can take: contents, a header and padding per entry."""
    return limits.max_bytes + limits.max_entries * (1024 + 2 * limits.max_header_bytes) + (1 << 20)


__all__ = [
    "ADMIN_DOMAIN",
    "SCHEME",
    "EngineCacheKey",
    "EngineCacheLimits",
    "EngineName",
    "Pipe",
    "body_limit",
    "domain_of",
    "fill_from_peers",
    "hand_over",
    "ingest_dir",
    "ingest_tar",
    "is_engine_cache",
    "is_ready",
    "key_of",
    "lister",
    "lookup",
    "open_up",
    "scratch_bounds",
    "visible_to",
]
