"""Tar layers of OCI artifacts (ModelPack `*.tar`, `*.tar+gzip`; ORAS `io.deis.oras.content.unpack` directories)
unpacked safely: every member checked before one byte of it is written (docs/sources.md, "Tar layers").

    unpack_layer(stream, "weights", "tar", write) -> [Unpacked("weights/a.bin", 5, "<sha256>"), ...]

`stream` is the layer's blob, already verified against its digest by the engine (a member has no digest of its
own, so nothing of a tar is trusted before the whole blob hashed to the layer's digest). `write(relpath, size,
read)` stores one member's bytes (the engine: a blob of the store) and returns their sha256. Refused, with a
`HostileKeyError` naming the member: a symlink, a hard link to anything but an earlier regular member of the same
layer (no links out, none across layers), devices, FIFOs, sparse and contiguous files; a name that is absolute,
has `..`, NUL or more than the store allows (`store.paths.validate_relpath`), or is under `.weightcache`; a name
twice, a file under a file (`_name` says how a member's name becomes its path in the model); more than
`max_members` members, more than `max_bytes` unpacked, an extended (pax or GNU long-name) header over
`max_header_bytes` (the header checks are weightcache/intake.py's, shared with engine caches). A damaged or
truncated tar is a `SourceError`.
Nothing here writes outside what `write` does; the caller drops what was written when this raises.

    expand_layers(entries, tars, store, key=..., uri=..., keep=ref.matches) -> entries

is the fetch engine's side (OciSource.expand): each hidden entry `.weightcache/layers/<hex>` (a tar layer the
engine downloaded and verified as blob `<hex>`) replaced by the layer's members, written as blobs of `store`
through its no-follow paths (small ones by the BlobWriter, the rest as parts in partial/ that become blobs),
each member's room in the store made before its bytes are written (`intake.Room`: the disk budget and the
free-space floor a download is held to, so a gzip layer that unpacks past them stops there, not at a full disk).
The blob is hashed again while it is unpacked and the members are returned only when it hashes to the layer's
digest (an existing blob wins over a download in the store, so the bytes read are checked, not the download).
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import os
import stat
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, cast

from weightcache import intake
from weightcache.errors import HostileKeyError, InsufficientSpaceError, IntegrityError, SourceError
from weightcache.store.paths import validate_relpath
from weightcache.store.types import FileEntry

if TYPE_CHECKING:
    import tarfile

    from weightcache.store import BlobWriter, Store

MAX_MEMBERS = 100_000
MAX_BYTES = 4 << 40  # unpacked bytes of one layer: a gzip bomb stops here (the engine also checks free space)
MAX_HEADER_BYTES = intake.MAX_HEADER_BYTES
COMPRESSIONS = ("tar", "tar+gzip")  # tar+zstd needs a zstd decoder this build does not carry
HIDDEN = ".weightcache/layers/"  # a tar layer's entry until it is unpacked; no model file may be named under it
SMALL_MEMBER = 4 << 20  # a member up to this is read whole and written straight to its blob (BlobWriter)

Write = Callable[[str, int, Callable[[int], bytes]], str]


@dataclass(frozen=True)
class Unpacked:
    relpath: str
    size: int
    sha256: str


@dataclass(frozen=True)
class TarLimits:
    max_members: int = MAX_MEMBERS
    max_bytes: int = MAX_BYTES
    max_header_bytes: int = MAX_HEADER_BYTES


def member_name(raw: str) -> str:
    """A tar member's (or a tar layer's) name without `./` prefixes and a trailing `/`, not yet checked."""
    name = raw
    while name.startswith("./"):  # `tar -C model .` names every member ./...
        name = name[2:]
    return name.rstrip("/")


def _name(raw: str, layer: str) -> str:
    """A member's path in the model, checked like every key. Packers name members two ways: by their path in
    the model (modctl, oras, a tar of the model's directory: the layer's own name, under it, or a category
    layer's files anywhere in the model, as modctl extracts every member relative to the model's root), or a
    nested file by its basename alone (aikit's weights, modctl's earlier archiver), which the layer's file-path
    annotation places. Nothing may be named under the store's own `.weightcache`; a name another layer or file
    takes too is refused when the engine checks the whole tree."""
    relpath = validate_relpath(member_name(raw))
    if relpath.split("/", 1)[0] == ".weightcache":
        raise HostileKeyError(relpath, f"is a member of the tar layer {layer!r} under the store's own "
                                       "'.weightcache'")
    if relpath == layer or relpath.startswith(layer + "/"):
        return relpath
    if "/" in layer and relpath == layer.rsplit("/", 1)[1]:
        return layer
    return relpath


def unpack_layer(stream: IO[bytes], layer: str, compression: str, write: Write,
                 limits: TarLimits = TarLimits()) -> list[Unpacked]:
    """The files of one tar layer named `layer` (its file-path annotation), each stored through `write`."""
    if compression not in COMPRESSIONS:
        raise SourceError(f"the tar layer {layer!r} is {compression}; only {' and '.join(COMPRESSIONS)} are "
                          "unpacked (push it uncompressed or gzip-compressed)")
    layer = validate_relpath(layer)
    raw: IO[bytes] = cast(IO[bytes], gzip.GzipFile(fileobj=stream, mode="rb")) if compression == "tar+gzip" else stream
    unpacked = _Layer(layer, limits)
    try:
        with intake.reading(raw, max_header_bytes=limits.max_header_bytes, hard_links=True, bufsize=1 << 20) as tf:
            for member in tf:
                unpacked.add(member, tf, write)
    except intake.TarRefused as exc:
        raise HostileKeyError(exc.name, f"{exc.why} (in the tar layer {layer!r})") from None
    except intake.TarDamaged as exc:
        raise SourceError(f"the tar layer {layer!r} is damaged or truncated ({exc})") from None
    return sorted(unpacked.files.values(), key=lambda u: u.relpath)


class _Layer:
    """The members of one tar layer so far: each new one is checked against them and the limits, then stored."""

    def __init__(self, layer: str, limits: TarLimits) -> None:
        self.layer, self.limits = layer, limits
        self.files: dict[str, Unpacked] = {}
        self.dirs: set[str] = set()
        self.ancestors: set[str] = set()  # the directories above every file so far
        self.total = self.members = 0

    def add(self, member: tarfile.TarInfo, tf: tarfile.TarFile, write: Write) -> None:
        layer = self.layer
        self.members += 1
        if self.members > self.limits.max_members:
            raise HostileKeyError(f"{layer} member {self.members}", f"more than {self.limits.max_members} members")
        if member.isdir():
            self._dir(member)
            return
        relpath = self._file(member)
        if member.islnk():
            target = self.files.get(_name(member.linkname, layer)) if member.linkname else None
            if target is None:
                raise HostileKeyError(relpath, f"is a hard link to {member.linkname[:200]!r}, not to an "
                                               "earlier file of the same layer")
            self.files[relpath] = Unpacked(relpath, target.size, target.sha256)
            return
        if not member.isreg() or member.issparse():
            raise HostileKeyError(relpath, f"is of tar type {member.type!r}; regular files and directories only")
        self.total += member.size
        if self.total > self.limits.max_bytes:
            raise HostileKeyError(relpath, f"the tar layer {layer!r} unpacks to more than "
                                           f"{self.limits.max_bytes} bytes")
        data = tf.extractfile(member)
        assert data is not None  # a regular member always has a reader
        self.files[relpath] = Unpacked(relpath, member.size, write(relpath, member.size, data.read))

    def _dir(self, member: tarfile.TarInfo) -> None:
        if member_name(member.name) in ("", "."):  # the tar's own root (`tar -C model .`)
            return
        relpath = _name(member.name, self.layer)
        if relpath in self.files:
            raise HostileKeyError(relpath, f"is a file and a directory in the tar layer {self.layer!r}")
        self.dirs.add(relpath)

    def _file(self, member: tarfile.TarInfo) -> str:
        """A file's (or hard link's) path, named once and never also a directory."""
        relpath = _name(member.name, self.layer)
        if relpath in self.files or relpath in self.dirs:
            raise HostileKeyError(relpath, f"is named twice in the tar layer {self.layer!r}")
        parts = relpath.split("/")
        above = ["/".join(parts[:i]) for i in range(1, len(parts))]
        if relpath in self.ancestors or any(a in self.files for a in above):
            raise HostileKeyError(relpath, f"is a file and a directory in the tar layer {self.layer!r}")
        self.ancestors.update(above)
        return relpath


def sha256_of(read: Callable[[int], bytes], size: int, sink: Callable[[bytes], object] | None = None) -> str:
    """Read `size` bytes through `read` in 1 MiB pieces, hashing (and passing them to `sink`); a short member is
    a damaged tar."""
    h, left = hashlib.sha256(), size
    while left:
        piece = read(min(1 << 20, left))
        if not piece:
            raise SourceError(f"a tar member ends {left} bytes short")
        h.update(piece)
        if sink is not None:
            sink(piece)
        left -= len(piece)
    return h.hexdigest()


class _Hashing:
    """The blob as read: every byte hashed and counted, whatever reads it (gzip or tar)."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw, self.sha256, self.size = raw, hashlib.sha256(), 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.sha256.update(data)
        self.size += len(data)
        return data

    def drain(self) -> None:
        """Read what the tar's end left (padding, gzip trailer, anything appended) so all of it is hashed."""
        while self.read(1 << 20):
            pass


class _Members:
    """`write` for unpack_layer: each member a blob of the store, hashed from the bytes written, its room in the
    store made first (`room`)."""

    def __init__(self, store: Store, blobs: BlobWriter, prefix: str, room: intake.Room) -> None:
        self.store, self.blobs, self.prefix, self.room = store, blobs, prefix, room
        self.partial = store.partial_dir()
        self.parts: list[tuple[str, str]] = []  # (part name in partial/, sha256), to become blobs

    def __call__(self, relpath: str, size: int, read: Callable[[int], bytes]) -> str:
        self.room.take(size)  # the header's size: a member shorter than it is a damaged tar
        if size <= SMALL_MEMBER and self.blobs.usable:
            data = bytearray()
            sha = sha256_of(read, size, data.extend)
            if self.blobs.write(sha, memoryview(data)):
                return sha

            def fill(sink: Callable[[bytes], object]) -> str:
                sink(bytes(data))
                return sha
            return self._part(fill)
        return self._part(lambda sink: sha256_of(read, size, sink))

    def _part(self, fill: Callable[[Callable[[bytes], object]], str]) -> str:
        """A part file in partial/ (named for the fetch's model, so gc leaves it while the fetch holds its lock),
        created afresh without following a link planted at its name."""
        name = f"{self.prefix}.{len(self.parts)}.part"
        with self.store.tree.dir(self.partial) as dfd:
            with suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dfd)  # a crashed run's; never followed
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444, dir_fd=dfd)
        with os.fdopen(fd, "wb") as out:
            self.parts.append((name, ""))
            sha = fill(out.write)
        self.parts[-1] = (name, sha)
        return sha

    def publish(self) -> None:
        self.store.add_blobs(((self.partial / name, sha) for name, sha in self.parts), durable=True)
        self.parts = []

    def discard(self) -> None:
        with self.store.tree.dir(self.partial) as dfd:
            for name, _ in self.parts:
                with suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=dfd)


def _open_blob(store: Store, hexdigest: str, size: int) -> IO[bytes]:
    """The downloaded layer's blob, opened without following a link; of the layer's size."""
    from weightcache.store import BlobMissingError

    blob = store.layout.blob(hexdigest)
    try:
        with store.tree.dir(blob.parent) as dfd:
            fd = os.open(blob.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ELOOP):
            raise
        raise BlobMissingError(f"the tar layer's blob {hexdigest} vanished before it was unpacked") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        os.close(fd)
        raise IntegrityError(f"the blob {hexdigest} of a tar layer is not a file of {size} bytes; run "
                             "`weightcache verify` and fetch again")
    return os.fdopen(fd, "rb")


def expand_layers(entries: list[FileEntry], tars: dict[str, tuple[str, str]], store: Store, *, key: str, uri: str,
                  keep: Callable[[str], bool], limits: TarLimits = TarLimits()) -> list[FileEntry]:
    """`entries` with each hidden tar-layer entry replaced by the layer's members that `keep` (the reference's
    globs), each member's etag the layer's digest (what OciSource.still_names compares). `tars`: the listing's
    hex digest -> (layer name, compression). Members are written whether kept or not (a hard link may name a
    member the globs leave out): the blobs of those left out are no file of the snapshot and go with gc. The
    layer's own blob is removed once unpacked (the disk would hold the model twice), unless a snapshot links it;
    a fetch of another model unpacking the same layer then finds it gone (BlobMissingError) and the engine
    starts that fetch over."""
    out = [e for e in entries if not e.path.startswith(HIDDEN)]
    hidden = [e for e in entries if e.path.startswith(HIDDEN)]
    room = intake.Room(store, uri=uri)  # every layer's members: what one unpacked counts for the next
    for entry in hidden:
        hexdigest = entry.path[len(HIDDEN):]
        name, compression = tars[hexdigest]
        if entry.sha256 != hexdigest:  # the engine verified the download against the digest: never the case
            raise IntegrityError(f"{name}: the tar layer {hexdigest} was stored as {entry.sha256}")
        with store.blob_writer() as blobs:
            members = _Members(store, blobs, f"{key}.tar-{hexdigest[:16]}", room)
            try:
                with _open_blob(store, hexdigest, entry.size) as raw:
                    stream = _Hashing(raw)
                    unpacked = unpack_layer(cast(IO[bytes], stream), name, compression, members, limits)
                    stream.drain()
                got = stream.sha256.hexdigest()
                if got != hexdigest or stream.size != entry.size:
                    raise IntegrityError(f"{name}: the tar layer's blob hashes to {got} ({stream.size} bytes), not "
                                         f"to its digest {hexdigest}; run `weightcache verify` and fetch again")
                if not unpacked:  # it would name no file of the snapshot, and a moved tag could not be told
                    raise SourceError(f"{name}: the tar layer {hexdigest[:12]} holds no file; push files, or drop "
                                      "the layer")
                members.publish()
            except BaseException as exc:
                members.discard()
                if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise InsufficientSpaceError(
                        f"disk full unpacking the tar layer {name!r} of {uri} ({exc.strerror}; a gzip layer unpacks "
                        "to more than its size); free disk space or lower the store's budget so eviction makes "
                        "room") from exc
                raise
        with store.locked():  # no publish links it meanwhile: the layer's blob is no file of a snapshot
            store.tree.unlink_if_single_link(store.layout.blob(hexdigest))
        out += [FileEntry(u.relpath, u.size, u.sha256, hexdigest, None) for u in unpacked if keep(u.relpath)]
    return out


__all__ = ["COMPRESSIONS", "HIDDEN", "TarLimits", "Unpacked", "expand_layers", "member_name", "sha256_of",
           "unpack_layer"]
