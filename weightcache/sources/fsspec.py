"""Every non-S3 store through fsspec: file://, memory:// (tests, local mirrors), gs:// (gcsfs), az:// (adlfs).

fsspec lists (`find`), except local files: one `scandir` per directory, one stat per file. Reads go straight
into the caller's buffer for local files (`preadv`) and memory files, and through `cat_file` ranges for remote
filesystems.
Every object is pinned to the version listed. gs:// reads name the listed generation (gcsfs `version_aware`,
`path#generation`: another generation is never read), az:// reads send the listed ETag with
`match_condition=IfNotModified` (412 when it changed). A pinned read that fails (a generation gone: 404; an ETag
no longer current: 412) is compared with the object now: a changed or deleted object raises ObjectChangedError,
and the fetch restarts from a new listing (a gs:// object that shrank ended in `HttpError 416`, exit 6, when reads
were unpinned and checked after). Local files are pinned by a token of inode, ctime, mtime and size, memory files
by creation time and size, checked after each read (memory before too; a local file's inode or ctime changes with
any rewrite, so a change before the read shows after it).
Local symlinks to files count as the files they point to (a Hugging Face cache snapshot is a tree of them).
"""

from __future__ import annotations

import base64
import builtins
import logging
import os
import stat
from collections.abc import Callable
from typing import Any

import fsspec

from weightcache.errors import (
    BackendMissingError,
    ObjectChangedError,
    SourceAccessDeniedError,
    SourceError,
    SourceNotFoundError,
    WeightcacheError,
)
from weightcache.policy import confine_file
from weightcache.redact import shorten
from weightcache.sources.base import (
    ObjectInfo,
    OnBytes,
    Pieces,
    Retryable,
    Source,
    SourceOptions,
    finish_listing,
    pieces_by_read_into,
    read_range_into,
)
from weightcache.uri import ModelRef

log = logging.getLogger(__name__)

#: our scheme -> (fsspec protocol, the package that provides it)
PROTOCOLS: dict[str, tuple[str, str | None]] = {
    "file": ("file", None),
    "memory": ("memory", None),
    "gs": ("gcs", "gcsfs"),
    "az": ("az", "adlfs"),
}
_CHANGED = "the object changed since it was listed; fetch again to get the new version"
#: builtin exception fsspec raises -> ours; checked in order (the first match wins).
ERRORS: tuple[tuple[type[BaseException], type[SourceError], str], ...] = (
    (FileNotFoundError, SourceNotFoundError, "check that the path exists and is spelled as listed"),
    (PermissionError, SourceAccessDeniedError, "grant the daemon read access to it"),
)
RETRYABLE: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError)


class FsspecSource(Source):
    """Lists and reads a prefix of any fsspec filesystem. Thread-safe as far as the filesystem is."""

    def __init__(self, ref: ModelRef, options: SourceOptions | None = None) -> None:
        self.ref = ref
        self.name = ref.scheme
        self.options = options or SourceOptions()  # endpoint_url and pool_size are s3's and http's
        protocol, package = PROTOCOLS[ref.scheme]
        try:  # gs: reads of `path#generation` (one generation, never mixed with the next)
            self.fs: Any = fsspec.filesystem(protocol, **({"version_aware": True} if protocol == "gcs" else {}))
        except ImportError as exc:
            raise BackendMissingError(
                f"reading {ref.scheme}:// models needs the {package} package: pip install {package}", name=package
            ) from exc
        except Exception as exc:  # adlfs refuses a malformed connection string here, gcsfs unreadable credentials
            raise translate(exc, ref.uri, ref.scheme) from exc
        self.root = self.fs._strip_protocol(ref.uri).rstrip("/") + "/"
        self._protocol = protocol
        self.local = protocol in ("file", "memory")  # reads are system calls (or memory), not requests

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.ref.uri!r})"

    def list(self) -> list[ObjectInfo]:
        def walk() -> list[ObjectInfo]:
            self.fs.invalidate_cache(self.root)  # gcsfs and adlfs cache listings: a fetch must see the store now
            try:
                found: dict[str, dict[str, Any]] = self.fs.find(self.root, detail=True)
            except FileNotFoundError:
                found = {}
            return [self._object(path, info) for path, info in found.items() if info.get("type") != "directory"]

        objects = self._listing(self._walk_local if self._protocol == "file" else walk)
        return finish_listing(self.ref, objects, hint="check that the directory exists and holds the model's files")

    def _listing(self, walk: Callable[[], builtins.list[ObjectInfo]]) -> builtins.list[ObjectInfo]:
        """`walk()` with transient failures retried and the rest translated by the error table."""
        def attempt() -> list[ObjectInfo]:
            try:
                return walk()
            except (WeightcacheError, Retryable):
                raise
            except RETRYABLE as exc:
                raise Retryable(f"{type(exc).__name__} listing {self.ref.uri}") from exc
            except Exception as exc:
                raise translate(exc, self.ref.uri, self.ref.scheme) from exc

        return self.options.retry(f"listing {self.ref.uri}").call(attempt)

    def _walk_local(self) -> builtins.list[ObjectInfo]:
        """file://: one scandir per directory and one stat per file (fsspec's find paid three stats, and confining
        paid a realpath per file). Real directories are descended, never a symlink to one (it is listed, then
        refused as not a regular file); so only a symlink entry can lead outside the model's tree, and only
        those are resolved and confined. An explicit stack: a hostile tree's depth is refused later, by name."""
        out: list[ObjectInfo] = []
        stack = [""]
        while stack:
            rel_dir = stack.pop()
            try:
                entries = os.scandir(self.root + rel_dir)
            except (FileNotFoundError, NotADirectoryError):
                if not rel_dir:
                    return []  # no such model: finish_listing says what to check
                continue  # removed while we walked: its files are not in this listing
            with entries:
                for entry in entries:
                    rel = rel_dir + entry.name
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(rel + "/")
                    else:
                        out.append(self._local_object(entry, rel))
        return out

    def _local_object(self, entry: os.DirEntry[str], relpath: str) -> ObjectInfo:
        if entry.is_symlink():  # a Hugging Face snapshot is made of them: they stand for their targets ...
            st = _stat_file(entry.path)
            confine_file(entry.path, self.root, relpath)  # ... inside the model's own tree only
        else:
            try:
                st = _regular_file(entry.path, entry.stat(follow_symlinks=False))
            except FileNotFoundError:
                raise SourceNotFoundError(f"{entry.path} vanished while listing; fetch again") from None
        return ObjectInfo(entry.path, relpath, st.st_size, stat_token(st), None, None)

    def read_into(self, obj: ObjectInfo, offset: int, buf: memoryview) -> None:
        read_range_into(self.options, obj.key, obj, offset, buf, lambda pos, view: self._read_range(obj, pos, view))

    def read_pieces(self, obj: ObjectInfo, offset: int, length: int, buf: memoryview,
                    on_bytes: OnBytes | None = None) -> Pieces:
        return pieces_by_read_into(self, obj, offset, length, buf, on_bytes)

    def etag_md5(self, obj: ObjectInfo) -> str | None:
        return None  # S3's alone

    def close(self) -> None:
        pass  # fsspec caches filesystem instances and their sessions process-wide

    def _object(self, path: str, info: dict[str, Any]) -> ObjectInfo:
        relpath = path[len(self.root):] if path.startswith(self.root) else ""
        generation = str(info["generation"]) if self._protocol == "gcs" and info.get("generation") else None
        return ObjectInfo(path, relpath, int(info["size"]), version_token(info), generation,
                          listed_checksum(info) if self._protocol in ("gcs", "az") else None)

    def _read_range(self, obj: ObjectInfo, pos: int, view: memoryview) -> int:
        """Read, then confirm the listed version is still the one there: a version that changed before or
        during the read raises ObjectChangedError, so no range mixes bytes of two versions."""
        try:
            if self._protocol == "file":  # preadv lands in `view` directly; O_NONBLOCK: a FIFO put there never
                fd = os.open(obj.key, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # blocks (its token differs)
                try:  # one check, after the read: a change before it shows then too (new inode or ctime)
                    try:
                        n = _pread_fill(fd, view, pos)
                    except OSError:  # a FIFO or directory swapped in (ESPIPE, EISDIR) is a change, not a failure
                        self._same_version(obj, stat_token(os.fstat(fd)))
                        raise
                    self._same_version(obj, stat_token(os.fstat(fd)))
                    return n
                finally:
                    os.close(fd)
            if self._protocol == "memory":
                self._same_version(obj, version_token(self.fs.info(obj.key)))
                with self.fs.open(obj.key, "rb") as f:
                    f.seek(pos)
                    n = _fill(f, view)
                self._same_version(obj, version_token(self.fs.info(obj.key)))
                return n
            return self._read_remote(obj, pos, view)
        except WeightcacheError:
            raise
        except RETRYABLE as exc:
            raise Retryable(f"{type(exc).__name__} reading {obj.key}") from exc
        except Exception as exc:
            raise translate(exc, obj.key, self.ref.scheme) from exc

    def _read_remote(self, obj: ObjectInfo, pos: int, view: memoryview) -> int:
        """A range of the listed version (gs: its generation; az: If-Match its ETag), else read and checked after.
        A failed pinned read of an object that changed since listing is ObjectChangedError."""
        try:
            if self._protocol == "gcs" and obj.version_id:
                data = self.fs.cat_file(f"{obj.key}#{obj.version_id}", start=pos, end=pos + len(view))
            elif self._protocol == "az" and obj.etag:
                data = self._az_range(obj, pos, len(view))
            else:
                data = self.fs.cat_file(obj.key, start=pos, end=pos + len(view))
                self._changed_since(obj)
        except WeightcacheError:
            raise
        except RETRYABLE:
            raise
        except Exception as exc:
            if getattr(exc, "status_code", None) == 412:  # az: the ETag is no longer the blob's
                raise ObjectChangedError(f"{obj.key} was modified after listing; {_CHANGED}") from exc
            self._changed_since(obj)  # a generation gone (404), a range past a new end (416): a change, if so
            raise
        view[:len(data)] = data
        return len(data)

    def _az_range(self, obj: ObjectInfo, pos: int, length: int) -> bytes:
        """adlfs reads cannot be pinned: the Azure SDK's own download, on adlfs's client and event loop, with the
        listed ETag and IfNotModified."""
        from azure.core import MatchConditions
        from fsspec.asyn import sync

        container, _, blob = obj.key.partition("/")

        async def download() -> bytes:
            client = self.fs.service_client.get_blob_client(container, blob)
            stream = await client.download_blob(offset=pos, length=length, etag=f'"{obj.etag}"',
                                                match_condition=MatchConditions.IfNotModified)
            return bytes(await stream.readall())

        return bytes(sync(self.fs.loop, download))

    def _changed_since(self, obj: ObjectInfo) -> None:
        """ObjectChangedError when the object is gone or another version than listed; else nothing."""
        self.fs.invalidate_cache(obj.key)  # gcsfs answers info from its listing cache: the object as listed
        try:
            info = self.fs.info(obj.key)
        except FileNotFoundError:
            raise ObjectChangedError(f"{obj.key} was deleted after listing; {_CHANGED}") from None
        self._same_version(obj, version_token(info))

    @staticmethod
    def _same_version(obj: ObjectInfo, token: str | None) -> None:
        if obj.etag and token != obj.etag:
            raise ObjectChangedError(f"{obj.key} was modified after listing; {_CHANGED}")


#: Where each remote store's endpoint is set, for the hint when what answered was no such store.
ENDPOINTS = {"gs": ("Google Cloud Storage", "STORAGE_EMULATOR_HOST (unset for Google's own)"),
             "az": ("Azure Blob Storage", "the account's blob endpoint (AZURE_STORAGE_CONNECTION_STRING's "
                                          "BlobEndpoint, AZURE_STORAGE_ACCOUNT_NAME)")}


def translate(exc: BaseException, what: str, scheme: str = "file") -> SourceError:
    """The fsspec error table: builtin exceptions become ours; an error with an HTTP status a SourceError naming
    it; anything else a remote library raises (a redirect loop, an HTML page it cannot parse) means the endpoint
    is no such store, and says where that is set. The cause is chained."""
    for builtin, ours, hint in ERRORS:
        if isinstance(exc, builtin):
            return ours(f"{what}: {type(exc).__name__}; {hint}")
    detail = shorten(f"{type(exc).__name__}: {exc}", 300)
    status = getattr(exc, "code", None) or getattr(exc, "status_code", None)
    if scheme in ENDPOINTS and not isinstance(status, int):
        store, where = ENDPOINTS[scheme]
        return SourceError(f"{what}: the endpoint did not answer like {store} ({detail}); check {where}")
    return SourceError(f"{what}: {detail}")


def version_token(info: dict[str, Any]) -> str | None:
    """What pins a version: the store's ETag or generation, else modification time and size (local, memory)."""
    for key in ("ETag", "etag", "generation"):
        if info.get(key):
            return str(info[key]).strip('"')
    stamp = info.get("mtime") or info.get("created")
    if stamp is None:
        return None
    stamp = stamp.timestamp() if hasattr(stamp, "timestamp") else stamp
    return f"{stamp!r}-{info.get('size')}"


def listed_checksum(info: dict[str, Any]) -> tuple[str, str] | None:
    """The full-object checksum a gs:// or az:// listing carries, as (algorithm, lowercase hex), to check the
    downloaded bytes against (never evidence to link a blob: only S3's SHA-256 is, ObjectInfo.checksum):
    gs:// `md5Hash` (Google computes it on upload; a composed object has none), else its `crc32c` (every object,
    big-endian); az:// `Content-MD5` (computed by the service for a blob uploaded whole; for one committed from
    blocks, whatever the uploader set, usually nothing). Anything malformed counts as no checksum."""
    settings: Any = info.get("content_settings")  # azure.storage.blob's ContentSettings, a dict-like
    candidates = (("md5", info.get("md5Hash"), 16), ("crc32c", info.get("crc32c"), 4),
                  ("md5", settings.get("content_md5") if settings is not None else None, 16))
    for algorithm, value, size in candidates:
        if not value:
            continue
        try:
            raw = bytes(value) if isinstance(value, (bytes, bytearray)) else base64.b64decode(str(value), validate=True)
        except ValueError:
            continue
        if len(raw) == size:
            return algorithm, raw.hex()
    return None


def stat_token(st: os.stat_result) -> str:
    """A local file's version: inode, change and modification times (ns), size. ctime catches a rewrite that
    restores the old mtime (utime sets ctime too); the inode, a file replaced by rename."""
    return f"{st.st_ino:x}-{st.st_ctime_ns:x}-{st.st_mtime_ns:x}-{st.st_size:x}"


def _stat_file(path: str) -> os.stat_result:
    """stat through symlinks; anything but a regular file (a link to a directory, a socket) is refused."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise SourceNotFoundError(f"{path} vanished or is a broken symlink; fix or remove it") from None
    except OSError as exc:
        raise translate(exc, path) from exc
    return _regular_file(path, st)


def _regular_file(path: str, st: os.stat_result) -> os.stat_result:
    if not stat.S_ISREG(st.st_mode):
        raise SourceError(f"{path} is not a regular file (a symlink to a directory?); "
                          "copy the files in, or point the reference at the target directory")
    return st


def _pread_fill(fd: int, view: memoryview, pos: int) -> int:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], pos + done)
        if not n:
            break
        done += n
    return done


def _fill(f: Any, view: memoryview) -> int:
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            break
        done += n
    return done
