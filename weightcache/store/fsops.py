"""File operations on the store tree that never follow a symlink the store did not create.

Anything under the root may have been planted: a symlink at `partial/`, `snapshots/<id>`, `blobs/sha256/ab`,
a `.part` file. So every path is walked from the root one component at a time with `O_NOFOLLOW`, and the last
component is acted on through `dir_fd=` calls that do not follow it either (unlink, rename, open with
`O_NOFOLLOW`). A directory component that is not a real directory is moved to `quarantine/` and, when the
caller creates, replaced by a fresh directory: the store heals instead of failing or following.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"
QUARANTINE = "quarantine"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NOT_A_DIR = (errno.ELOOP, errno.ENOTDIR)


def tmp_name(path: Path) -> Path:
    """A per-writer temporary sibling: unique across processes and threads, recognisable by recovery."""
    return path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}.{secrets.token_hex(4)}")


class Tree:
    """Symlink-safe operations on paths under one root (the root itself was resolved by whoever made it)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _parts(self, path: Path) -> tuple[str, ...]:
        parts = path.relative_to(self.root).parts
        if not parts or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"{path} is not a path inside the store at {self.root}")
        return parts

    # -- directories ----------------------------------------------------------------------------------------
    @contextmanager
    def dir(self, path: Path, *, create: bool = False) -> Iterator[int]:
        """A descriptor of directory `path` (or the root), opened without following any symlink below the root.

        Raises FileNotFoundError when a component is missing (and `create` is false) or was not a directory
        (it is quarantined, then created afresh when `create` is true).
        """
        fd = self.open_dir(path, create=create)
        try:
            yield fd
        finally:
            os.close(fd)

    def open_dir(self, path: Path, *, create: bool = False) -> int:
        """`dir()` for a caller that closes the descriptor itself (HeldDirs)."""
        parts = path.relative_to(self.root).parts
        if any(p in ("", ".", "..") for p in parts):  # '..' is no symlink: O_NOFOLLOW would not stop it
            raise ValueError(f"{path} is not a path inside the store at {self.root}")
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            done: list[str] = []
            for name in parts:
                child = self._step(fd, name, done, create)
                os.close(fd)
                fd = child
                done.append(name)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def open_child(self, dir_fd: int, path: Path, *, create: bool = False) -> int:
        """Descriptor of directory `path` whose parent directory is open as `dir_fd` (one step of the walk)."""
        return self._step(dir_fd, path.name, list(path.parent.relative_to(self.root).parts), create)

    def held(self) -> HeldDirs:
        """Directory descriptors kept open for a batch of per-file operations: see HeldDirs."""
        return HeldDirs(self)

    def _step(self, fd: int, name: str, done: list[str], create: bool) -> int:
        """Open child `name` of `fd` as a directory; heal or refuse what is not a directory."""
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                raise
        except OSError as exc:
            if exc.errno not in _NOT_A_DIR:
                raise
            self._quarantine_at(fd, name, "/".join([*done, name]), "is not a directory (a planted symlink?)")
            if not create:
                raise FileNotFoundError(errno.ENOENT, "quarantined", str(self.root.joinpath(*done, name))) from None
        with suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=fd)
        return os.open(name, _DIR_FLAGS, dir_fd=fd)

    def ensure_dir(self, path: Path) -> None:
        """Make `path` a real directory, quarantining whatever non-directory stands on the way."""
        with self.dir(path, create=True):
            pass

    def listdir(self, path: Path) -> list[str]:
        """Names in directory `path`; [] when it is missing (or was not a directory and got quarantined)."""
        try:
            with self.dir(path) as fd:
                return os.listdir(fd)
        except FileNotFoundError:
            return []

    # -- entries --------------------------------------------------------------------------------------------
    def lstat(self, path: Path) -> os.stat_result | None:
        """stat of `path` itself (a symlink is reported, not followed); None when missing."""
        try:
            with self.dir(path.parent) as fd:
                return os.stat(path.name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def is_file(self, path: Path) -> bool:
        st = self.lstat(path)
        return st is not None and stat.S_ISREG(st.st_mode)

    def read(self, path: Path, *, limit: int) -> bytes | None:
        """Bytes of regular file `path` (None when missing); a symlink, non-file or file over `limit` is quarantined."""
        try:
            with self.dir(path.parent) as dfd:
                try:
                    fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
                except OSError as exc:
                    if exc.errno != errno.ELOOP:
                        raise
                    self._quarantine_at(dfd, path.name, self._rel(path), "is a symlink")
                    return None
                try:
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
                        why = "is not a regular file" if not stat.S_ISREG(st.st_mode) else f"is over {limit} bytes"
                        self._quarantine_at(dfd, path.name, self._rel(path), why)
                        return None
                    return _read_all(fd, st.st_size, limit)
                finally:
                    os.close(fd)
        except (FileNotFoundError, IsADirectoryError):
            return None

    def unlink(self, path: Path) -> bool:
        """Remove the entry `path` (a symlink itself, never its target); False when it was missing."""
        try:
            with self.dir(path.parent) as fd:
                os.unlink(path.name, dir_fd=fd)
                return True
        except FileNotFoundError:
            return False
        except IsADirectoryError:
            self.remove_tree(path)
            return True

    def unlink_if_single_link(self, path: Path) -> int:
        """Remove regular file `path` when nothing else links it (a blob no snapshot uses); bytes freed."""
        try:
            with self.dir(path.parent) as fd:
                st = os.stat(path.name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    self._quarantine_at(fd, path.name, self._rel(path), "is not a regular file")
                    return 0
                if st.st_nlink != 1:
                    return 0
                os.unlink(path.name, dir_fd=fd)
                return st.st_size
        except FileNotFoundError:
            return 0

    def rename(self, src: Path, dst: Path) -> None:
        """Atomic rename within the tree; neither side is followed when it is a symlink."""
        with self.dir(src.parent) as sfd, self.dir(dst.parent, create=True) as dfd:
            os.rename(src.name, dst.name, src_dir_fd=sfd, dst_dir_fd=dfd)

    def write_atomic(self, path: Path, data: bytes, *, mode: int = 0o644, durable: bool = True) -> None:
        """Write `data` to `path` so readers see the old file or the whole new one, never a part.

        `durable=False` skips the fsyncs, for state that does not outlive a reboot anyway (leases of mounts).
        """
        tmp = tmp_name(path).name
        with self.dir(path.parent, create=True) as dfd:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
            try:
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    if durable:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                _unlink_quietly(dfd, tmp)
                raise
            if durable:
                os.fsync(dfd)

    def remove_tree(self, path: Path) -> None:
        """Remove `path` and everything below it without following symlinks; our 0555 directories are made
        writable again first (through their descriptors, so a planted symlink is never chmod-ed)."""
        try:
            with self.dir(path.parent) as fd:
                _remove_at(fd, path.name)
        except FileNotFoundError:
            pass

    # -- quarantine -----------------------------------------------------------------------------------------
    def quarantine(self, path: Path, reason: str) -> None:
        """Move `path` (whatever it is, never followed) to quarantine/ and log it, so it is neither read nor
        followed again and stays for a human to inspect."""
        try:
            with self.dir(path.parent) as fd:
                self._quarantine_at(fd, path.name, self._rel(path), reason)
        except FileNotFoundError:
            pass

    def _quarantine_at(self, dir_fd: int, name: str, rel: str, reason: str) -> None:
        if rel == QUARANTINE:  # quarantine/ itself was replaced: it cannot hold itself, so drop the entry
            _unlink_quietly(dir_fd, name)
            log.warning("store: %s %s; removed it", self.root / rel, reason)
            return
        dest = f"{rel.replace('/', '%2F')[-200:]}.{time.time_ns()}"
        qdir = self.root / QUARANTINE
        with self.dir(qdir, create=True) as qfd:
            try:
                os.rename(name, dest, src_dir_fd=dir_fd, dst_dir_fd=qfd)
            except FileNotFoundError:
                return
        log.warning("store: %s %s; moved it to %s (inspect it, then delete it)", self.root / rel, reason,
                    qdir / dest)

    def _rel(self, path: Path) -> str:
        return "/".join(self._parts(path))


class HeldDirs:
    """Each directory opened once, by the same no-follow walk as Tree.dir (from its nearest held ancestor), and
    kept for a batch: publishing 2,000 files would otherwise walk root -> blobs -> sha256 -> ab and close it all
    again once or twice per file. A held descriptor stays the directory it was when opened, whatever is renamed
    or planted at its path later. Close with `with` (or close())."""

    def __init__(self, tree: Tree) -> None:
        self._tree = tree
        self._fds: dict[Path, int] = {}
        self._children: dict[tuple[Path, str], int] = {}  # (parent, name) -> fd: no Path built per file
        self._walked: dict[Path, list[str]] = {}  # parent -> its components below the root (for messages)

    def child(self, parent: Path, name: str, *, create: bool = False) -> int:
        """Descriptor of directory `parent/name`, held like fd(); for a caller naming many files in a few
        directories (blobs/sha256/<ab>), where building a Path per file cost more than the system calls."""
        fd = self._children.get((parent, name))
        if fd is None:
            if not name or "/" in name or name in (".", ".."):
                raise ValueError(f"{name!r} is not a directory name")
            parent_fd = self.fd(parent, create=create)
            done = self._walked.get(parent)
            if done is None:
                done = self._walked[parent] = list(self._tree._parts(parent)) if parent != self._tree.root else []
            fd = self._children[parent, name] = self._tree._step(parent_fd, name, done, create)
        return fd

    def fd(self, path: Path, *, create: bool = False) -> int:
        """Descriptor of directory `path` (the tree's root or below it); owned by this object."""
        fd = self._fds.get(path)
        if fd is None:
            if path == self._tree.root:
                fd = self._tree.open_dir(path)
            else:
                self._tree._parts(path)  # refuses a path outside the tree or with . / .. components
                fd = self._tree.open_child(self.fd(path.parent, create=create), path, create=create)
            self._fds[path] = fd
        return fd

    def close(self) -> None:
        fds = [*self._fds.values(), *self._children.values()]
        self._fds, self._children = {}, {}
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> HeldDirs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LinkTree:
    """Hard links into the directory open as `root`, each parent directory made (mode `dir_mode`) and opened
    without following a symlink, once per directory: the one way trees of links to blobs are built (a snapshot,
    a hub cache view, a streaming view). Close with `with` (the root stays its caller's)."""

    def __init__(self, root: int, *, dir_mode: int = 0o755) -> None:
        self._mode = dir_mode
        self._fds: dict[str, int] = {"": root}

    def link(self, src_dir_fd: int, src_name: str, relpath: str) -> None:
        """Link `src_name` (not followed) of the directory open as `src_dir_fd` at `relpath` (validated)."""
        parent, _, name = relpath.rpartition("/")
        os.link(src_name, name, src_dir_fd=src_dir_fd, dst_dir_fd=self.dir(parent), follow_symlinks=False)

    def dir(self, path: str) -> int:
        """The descriptor of directory `path` below the root ("" is the root), made where missing."""
        fd = self._fds.get(path)
        if fd is None:
            up, _, name = path.rpartition("/")
            up_fd = self.dir(up)
            with suppress(FileExistsError):
                os.mkdir(name, self._mode, dir_fd=up_fd)
            fd = self._fds[path] = os.open(name, _DIR_FLAGS, dir_fd=up_fd)
        return fd

    def made(self) -> list[int]:
        """The directories below the root opened so far, deepest first."""
        return [fd for path, fd in sorted(self._fds.items(), key=lambda e: -e[0].count("/")) if path]

    def __enter__(self) -> LinkTree:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self.made():
            os.close(fd)
        self._fds = {"": self._fds[""]}


_libc = ctypes.CDLL(None, use_errno=True)
_RENAME_NOREPLACE = 1
# until the C library lacks it or a filesystem says it has no RENAME_NOREPLACE: then link + unlink
_renameat2_works = hasattr(_libc, "renameat2")


_EXT4_MAGIC, _XFS_MAGIC = 0xEF53, 0x58465342  # statfs f_type (ext2/3/4 share theirs)


def commits_in_order(fd: int) -> bool:
    """Whether one fsync on the filesystem holding `fd` makes every metadata change made before it durable: ext4
    with a journal and xfs write metadata to one log in order, and an fsync waits for the log up to the file's last
    change. Each fsync also flushes the disk's cache, even with nothing left to commit (3-4 ms each on a busy
    disk), so a caller that changed many directories fsyncs the one it changed last. Unknown: False. Asked each
    time (three system calls): a device number is reused by the next filesystem mounted there."""
    buf = ctypes.create_string_buffer(256)  # struct statfs (120 bytes on 64-bit Linux), f_type first
    if _libc.fstatfs(fd, buf) != 0:
        return False
    f_type = ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
    if f_type == _XFS_MAGIC:
        return True
    if f_type != _EXT4_MAGIC:
        return False
    dev = os.fstat(fd).st_dev
    try:  # ext4 mounted without a journal (or ext2) has no jbd2 entry: each directory then needs its own fsync
        name = os.path.basename(os.readlink(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"))
    except OSError:
        return False
    return os.path.isdir(f"/proc/fs/jbd2/{name}-8")


def move_noreplace(src_dir_fd: int, src: str, dst_dir_fd: int, dst: str) -> bool:
    """Move entry `src` to `dst` in one step that neither follows nor replaces anything: renameat2 with
    RENAME_NOREPLACE (one call where link + unlink took two), else link (not following) then unlink. False, and
    `src` left in place, when `dst` exists."""
    global _renameat2_works
    if _renameat2_works:
        if _libc.renameat2(src_dir_fd, os.fsencode(src), dst_dir_fd, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return True
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            return False
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, f"rename {src} -> {dst}: {os.strerror(err)}")
        _renameat2_works = False
    try:
        os.link(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, follow_symlinks=False)
    except FileExistsError:
        return False
    os.unlink(src, dir_fd=src_dir_fd)
    return True


def _read_all(fd: int, size: int, limit: int) -> bytes:
    chunks, total = [], 0
    while chunk := os.read(fd, max(size - total, 1 << 16)):
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:
            raise FileNotFoundError(errno.EFBIG, "record grew past its limit while read")
    return b"".join(chunks)


def _unlink_quietly(dir_fd: int, name: str) -> None:
    with suppress(OSError):
        os.unlink(name, dir_fd=dir_fd)


def _remove_at(parent_fd: int, name: str) -> None:
    """Depth-first removal below `parent_fd` with an explicit stack (deep trees must not exhaust recursion)."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        _unlink_quietly(parent_fd, name)
        return
    stack: list[tuple[int, str, int]] = [(parent_fd, name, _open_writable_dir(parent_fd, name))]
    try:
        while stack:
            pfd, dname, fd = stack[-1]
            child = _first_entry(fd)
            if child is None:
                os.close(fd)
                stack.pop()
                with suppress(FileNotFoundError):
                    os.rmdir(dname, dir_fd=pfd)
                continue
            cst = os.stat(child, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(cst.st_mode):
                stack.append((fd, child, _open_writable_dir(fd, child)))
            else:
                os.unlink(child, dir_fd=fd)
    finally:
        for _, _, fd in stack:
            os.close(fd)


def _open_writable_dir(parent_fd: int, name: str) -> int:
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    with suppress(OSError):
        os.fchmod(fd, 0o755)
    return fd


def _first_entry(fd: int) -> str | None:
    with os.scandir(fd) as it:
        for entry in it:
            return entry.name
    return None
