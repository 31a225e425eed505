"""Tar layers of OCI artifacts (ModelPack `*.tar`, `*.tar+gzip`; ORAS `io.deis.oras.content.unpack` directories)
unpacked safely: every member checked before one byte of it is written (docs/sources.md, "Tar layers").

    unpack_layer(stream, "weights", "tar", write) -> [Unpacked("weights/a.bin", 5, "<sha256>"), ...]

`stream` is the layer's blob, already verified against its digest by the engine (a member has no digest of its
own, so nothing of a tar is trusted before the whole blob hashed to the layer's digest). `write(relpath, size,
read)` stores one member's bytes (the engine: a blob of the store) and returns their sha256. Refused, with a
`HostileKeyError` naming the member: a symlink, a hard link to anything but an earlier regular member of the same
layer (no links out, none across layers), devices, FIFOs, sparse and contiguous files; a name that is absolute,
has `..`, NUL or more than the store allows (`store.paths.validate_relpath`), or is not the layer's own name or
under it; a name twice, a file under a file; more than `max_members` members, more than `max_bytes` unpacked, an
extended (pax or GNU long-name) header over `max_header_bytes`. A damaged or truncated tar is a `SourceError`.
Nothing here writes outside what `write` does; the caller drops what was written when this raises.
"""

from __future__ import annotations

import gzip
import hashlib
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any, cast

from weightcache.errors import HostileKeyError, SourceError
from weightcache.store.paths import validate_relpath

MAX_MEMBERS = 100_000
MAX_BYTES = 4 << 40  # unpacked bytes of one layer: a gzip bomb stops here (the engine also checks free space)
MAX_HEADER_BYTES = 64 << 10
COMPRESSIONS = ("tar", "tar+gzip")  # tar+zstd needs a zstd decoder this build does not carry

_EXTENDED = {tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
             tarfile.GNUTYPE_LONGLINK}
_KINDS = {tarfile.SYMTYPE: "a symlink", tarfile.CHRTYPE: "a character device", tarfile.BLKTYPE: "a block device",
          tarfile.FIFOTYPE: "a FIFO", tarfile.CONTTYPE: "a contiguous file", tarfile.GNUTYPE_SPARSE: "a sparse file"}

Write = Callable[[str, int, Callable[[int], bytes]], str]


@dataclass(frozen=True)
class Unpacked:
    relpath: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Limits:
    max_members: int = MAX_MEMBERS
    max_bytes: int = MAX_BYTES
    max_header_bytes: int = MAX_HEADER_BYTES


class _Refused(Exception):
    """Raised inside tarfile's header parsing, before a member's data is read."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(why)
        self.name, self.why = name, why


def _tarinfo_class(limits: Limits) -> type[tarfile.TarInfo]:
    class BoundedTarInfo(tarfile.TarInfo):
        def _proc_member(self, tf: tarfile.TarFile) -> Any:  # every header, before its data is read
            if self.type in _EXTENDED and self.size > limits.max_header_bytes:
                raise _Refused(self.name[:200], f"an extended tar header of {self.size} bytes (at most "
                                                f"{limits.max_header_bytes})")
            if self.type in _KINDS:
                raise _Refused(self.name[:200], f"is {_KINDS[self.type]}; a model layer holds regular files and "
                                                "directories only")
            return super()._proc_member(tf)  # type: ignore[misc]
    return BoundedTarInfo


def _name(raw: str, layer: str) -> str:
    """A member's path in the model: checked like every key, and the layer's own name or under it."""
    name = raw[2:] if raw.startswith("./") else raw
    name = name.rstrip("/")
    relpath = validate_relpath(name)
    if relpath != layer and not relpath.startswith(layer + "/"):
        raise HostileKeyError(relpath, f"is a member of the tar layer {layer!r} but not under that name")
    return relpath


def unpack_layer(stream: IO[bytes], layer: str, compression: str, write: Write,
                 limits: Limits = Limits()) -> list[Unpacked]:
    """The files of one tar layer named `layer` (its file-path annotation), each stored through `write`."""
    if compression not in COMPRESSIONS:
        raise SourceError(f"the tar layer {layer!r} is {compression}; only {' and '.join(COMPRESSIONS)} are "
                          "unpacked (push it uncompressed or gzip-compressed)")
    layer = validate_relpath(layer)
    raw: IO[bytes] = cast(IO[bytes], gzip.GzipFile(fileobj=stream, mode="rb")) if compression == "tar+gzip" else stream
    files: dict[str, Unpacked] = {}
    dirs: set[str] = set()
    ancestors: set[str] = set()  # the directories above every file so far
    total = members = 0
    try:
        with tarfile.open(fileobj=raw, mode="r|", tarinfo=_tarinfo_class(limits)) as tf:
            for member in tf:
                members += 1
                if members > limits.max_members:
                    raise HostileKeyError(f"{layer} member {members}", f"more than {limits.max_members} members")
                if member.isdir():
                    relpath = _name(member.name, layer)
                    if relpath in files:
                        raise HostileKeyError(relpath, f"is a file and a directory in the tar layer {layer!r}")
                    dirs.add(relpath)
                    continue
                relpath = _name(member.name, layer)
                if relpath in files or relpath in dirs:
                    raise HostileKeyError(relpath, f"is named twice in the tar layer {layer!r}")
                parts = relpath.split("/")
                above = ["/".join(parts[:i]) for i in range(1, len(parts))]
                if relpath in ancestors or any(a in files for a in above):
                    raise HostileKeyError(relpath, f"is a file and a directory in the tar layer {layer!r}")
                ancestors.update(above)
                if member.islnk():
                    target = files.get(_name(member.linkname, layer)) if member.linkname else None
                    if target is None:
                        raise HostileKeyError(relpath, f"is a hard link to {member.linkname[:200]!r}, not to an "
                                                       "earlier file of the same layer")
                    files[relpath] = Unpacked(relpath, target.size, target.sha256)
                    continue
                if not member.isreg() or member.issparse():
                    raise HostileKeyError(relpath, f"is of tar type {member.type!r}; regular files and directories "
                                                   "only")
                total += member.size
                if total > limits.max_bytes:
                    raise HostileKeyError(relpath, f"the tar layer {layer!r} unpacks to more than "
                                                   f"{limits.max_bytes} bytes")
                data = tf.extractfile(member)
                assert data is not None  # a regular member always has a reader
                sha256 = write(relpath, member.size, data.read)
                files[relpath] = Unpacked(relpath, member.size, sha256)
    except _Refused as exc:
        raise HostileKeyError(exc.name, exc.why) from None
    except (tarfile.TarError, EOFError, gzip.BadGzipFile, OSError) as exc:
        if isinstance(exc, OSError) and not isinstance(exc, gzip.BadGzipFile) and exc.errno is not None:
            raise  # the disk's error, not the tar's
        raise SourceError(f"the tar layer {layer!r} is damaged or truncated ({str(exc)[:200]})") from None
    return sorted(files.values(), key=lambda u: u.relpath)


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


__all__ = ["COMPRESSIONS", "Limits", "Unpacked", "sha256_of", "unpack_layer"]
