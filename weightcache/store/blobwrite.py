"""Small files written straight to their blob: no part file, no rename.

A file the fetch reads whole in one request is hashed from the worker's buffer before it is written, so its
digest is known first. Its bytes then go to an unnamed file made in its own blob directory (`O_TMPFILE`), which
gets its name by `linkat(fd, "", AT_EMPTY_PATH)` (or of `/proc/self/fd/<fd>`): linkat never replaces (an existing
blob wins) and links the inode this descriptor wrote, so nothing can be swapped in and no partial file is ever
visible under a blob name. Per file: open, write, link, close, where the part path took create, write, close,
lstat, rename, lstat.

A blob name may now reach the disk before its bytes do (the fetch syncs the filesystem once, before it
publishes). So an existing blob found at the name is compared with the bytes in hand: one left by a crash
before that sync (empty or short on ext4) is quarantined and replaced instead of trusted. Where the filesystem
has no `O_TMPFILE` or `/proc` is not mounted, `write` returns False and the caller takes the part path.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from weightcache.store.fsops import HeldDirs
    from weightcache.store.layout import Layout

# O_TMPFILE refused: the filesystem lacks it (EOPNOTSUPP), or a kernel before 3.11 read it as O_DIRECTORY (EISDIR)
_NO_TMPFILE = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL)
_PROC_FD = "/proc/self/fd"
_AT_EMPTY_PATH = 0x1000
_libc = ctypes.CDLL(None, use_errno=True)


class BlobWriter:
    """Writes verified small files as blobs for one fetch; thread-safe (workers share it). Close it (`with`)."""

    def __init__(self, layout: Layout, dirs: HeldDirs, blob_dir: Callable[[str], int]) -> None:
        """`dirs` holds the blob directories that `blob_dir` (sha256 -> descriptor, thread-safe) opens; closed with
        this."""
        self._layout, self._dirs, self._blob_dir = layout, dirs, blob_dir
        self.usable = hasattr(os, "O_TMPFILE") and os.path.isdir(_PROC_FD)  # False after the first refusal
        # linkat(fd, "", AT_EMPTY_PATH) skips resolving /proc/self/fd/N (about a third of a link's cost); it needs
        # CAP_DAC_READ_SEARCH before Linux 6.10, so a refusal sends the links through /proc
        self._empty_path = True

    def write(self, sha256: str, data: memoryview, check: Callable[[str], None] | None = None) -> bool:
        """Make `data` (whose sha256 the caller computed from these very bytes) blob `sha256`, 0444. True when
        the blob holds these bytes (ours, or one already there); False when this store cannot write in place (the
        caller writes a part instead). `check(path)` reads the written file through `path` before it gets its
        name and raises to refuse it (the safetensors header check)."""
        if not self.usable:
            return False
        dfd = self._blob_dir(sha256)  # refuses what is not a digest
        try:
            fd = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o444, dir_fd=dfd)
        except OSError as exc:
            if exc.errno not in _NO_TMPFILE:
                raise
            self.usable = False
            return False
        try:
            view = data
            while view:
                view = view[os.write(fd, view):]
            if check is not None:
                check(f"{_PROC_FD}/{fd}")
            self._link(fd, dfd, sha256, data)
        finally:
            os.close(fd)
        return True

    def _link(self, fd: int, dfd: int, sha256: str, data: memoryview) -> None:
        """Name the unnamed file; an existing blob with other bytes than `data` is quarantined, then replaced."""
        for _ in range(2):
            err = self._linkat(fd, dfd, sha256)
            if not err:
                return
            if err != errno.EEXIST:
                raise OSError(err, f"cannot name blob {sha256}: {os.strerror(err)}")
            if _holds(dfd, sha256, data):
                return  # the same content, one inode: ours goes with its descriptor
            self._layout.tree.quarantine(self._layout.blob(sha256), "does not hold the bytes its name is the digest of "
                                         "(written before a crash and never synced, or tampered with)")
        raise OSError(errno.EEXIST, f"blob {sha256} keeps being replaced by other bytes; fetch again")

    def _linkat(self, fd: int, dfd: int, name: str) -> int:
        """Link the file open as `fd` as `name` in `dfd` (never replacing); 0, or the errno."""
        if self._empty_path:
            if _libc.linkat(fd, b"", dfd, name.encode(), _AT_EMPTY_PATH) == 0:
                return 0
            err = ctypes.get_errno()
            if err not in (errno.ENOENT, errno.EPERM, errno.EINVAL):
                return err
            self._empty_path = False
        try:
            os.link(f"{_PROC_FD}/{fd}", name, dst_dir_fd=dfd, follow_symlinks=True)
        except OSError as exc:
            return exc.errno or errno.EIO
        return 0

    def close(self) -> None:
        self._dirs.close()

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _holds(dfd: int, name: str, data: memoryview) -> bool:
    """Whether entry `name` is a regular file of exactly these bytes. Anything else there (a symlink, FIFO,
    device, directory) is never opened, and the file opened is checked again (it may have been swapped)."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or st.st_size != len(data):
            return False
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOENT):
            return False
        raise
    try:
        st = os.fstat(fd)
        return stat.S_ISREG(st.st_mode) and st.st_size == len(data) and os.pread(fd, len(data) + 1, 0) == data
    finally:
        os.close(fd)
