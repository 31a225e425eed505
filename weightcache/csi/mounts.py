"""Read-only bind mounts and the kernel's mount table, via mount(2)/umount2(2) and /proc/self/mountinfo.

A snapshot is published by two syscalls: a plain bind, then a remount of that bind with
`ro,nosuid,nodev` (the kernel ignores those flags on the first bind call). The result is verified by reading
mountinfo, never assumed. All functions block: call them from a thread in async code.

mountinfo line (proc(5)); spaces, tabs, newlines and backslashes in paths are written as octal escapes (\\040):

    36 35 259:1 /snapshots/ab12 /var/lib/kubelet/pods/u/volumes/.../mount ro,nosuid,nodev - ext4 /dev/nvme0n1 rw
    id parent dev   root            mount point                              options [optional] - fstype source super
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from weightcache.csi.targets import open_dir
from weightcache.errors import InvalidRequestError, MountError

logger = logging.getLogger(__name__)

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 1, 2, 4, 32, 4096
UMOUNT_NOFOLLOW = 8  # a target that became a symlink is not followed to unmount something else
READ_ONLY_OPTIONS = frozenset({"ro", "nosuid", "nodev"})
MOUNTINFO = Path("/proc/self/mountinfo")
SCRATCH_SOURCE = "weightcache-engine-cache"  # the source of our tmpfs scratch mounts: how unpublish knows its own

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class MountEntry:
    """One line of mountinfo."""

    mount_id: int
    parent_id: int
    device: str  # "major:minor"
    root: str  # path inside the source filesystem that is mounted here
    mount_point: str
    options: frozenset[str]  # per-mount options (ro, nosuid, nodev, ...)
    fstype: str
    source: str


def _unescape(field: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[MountEntry]:
    """Parse mountinfo text; malformed lines are skipped (the kernel does not write them)."""
    entries = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
            entries.append(MountEntry(
                mount_id=int(fields[0]), parent_id=int(fields[1]), device=fields[2], root=_unescape(fields[3]),
                mount_point=_unescape(fields[4]), options=frozenset(fields[5].split(",")),
                fstype=fields[sep + 1], source=_unescape(fields[sep + 2]),
            ))
        except (ValueError, IndexError):
            continue
    return entries


def mount_table(path: Path = MOUNTINFO) -> list[MountEntry]:
    return parse_mountinfo(path.read_text())


def mounted_at(target: str | os.PathLike[str], table: list[MountEntry] | None = None) -> MountEntry | None:
    """The topmost mount on exactly `target` (the one a process sees), or None. A lookup by name, for reports and
    reconcile; mountinfo names the real path, so symlinks in the parents (a moved kubeletDir) are resolved.
    To act on a mount, use `top_mount_at` and `unmount_top_at`."""
    path = os.path.abspath(target)
    wanted = {path, os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))}
    found = None
    for entry in table if table is not None else mount_table():
        if entry.mount_point in wanted:
            found = entry  # later lines are mounted on top of earlier ones
    return found


def _syscall(name: str, rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise MountError(err, f"{name} failed for {what}: {os.strerror(err)}")


def bind_readonly_at(source: str | os.PathLike[str], parent_fd: int, name: str, shown: str) -> MountEntry:
    """Bind-mount `source` read-only, nosuid, nodev on directory `name` (made if missing) of the directory open
    as `parent_fd`; verified in mountinfo. The mount goes through /proc/self/fd/N of the directory's O_PATH fd,
    so no path is resolved again after the caller walked it. `shown` names the target in errors."""
    src = os.fsencode(os.path.abspath(source))
    fd = open_dir(parent_fd, name, shown, create=True)
    try:
        _syscall("mount --bind", _libc.mount(src, _fd_path(fd), None, MS_BIND, None), shown)
    finally:
        os.close(fd)
    try:
        root = open_dir(parent_fd, name, shown, create=False)  # the new mount's root, not the directory under it
        try:
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
            _syscall("remount ro,nosuid,nodev", _libc.mount(None, _fd_path(root), None, flags, None), shown)
            entry = _entry_of(root)
        finally:
            os.close(root)
        if entry is None or not READ_ONLY_OPTIONS.issubset(entry.options):
            seen = sorted(entry.options) if entry else "nothing"
            raise MountError(errno.EIO, f"mount table shows {seen} at {shown}, wanted ro,nosuid,nodev")
    except BaseException:
        unmount(shown)
        raise
    return entry


def tmpfs_at(parent_fd: int, name: str, shown: str, *, size_bytes: int, inodes: int,
             readonly: bool = False) -> MountEntry:
    """Mount a fresh tmpfs of at most `size_bytes` and `inodes` (nosuid, nodev; `ro` when `readonly`) on directory
    `name` of the directory open as `parent_fd`, like `bind_readonly_at`; verified in mountinfo. A pod's engine
    cache scratch: the filesystem's own bounds stop a pod that writes more (it gets ENOSPC, nobody else does),
    its pages are charged to the memory cgroup of whoever writes them, and it is gone with the unmount."""
    flags = MS_NOSUID | MS_NODEV | (MS_RDONLY if readonly else 0)
    options = f"size={int(size_bytes)},nr_inodes={int(inodes)},mode=0777".encode()
    fd = open_dir(parent_fd, name, shown, create=True)
    try:
        _syscall("mount tmpfs", _libc.mount(SCRATCH_SOURCE.encode(), _fd_path(fd), b"tmpfs", flags, options), shown)
    finally:
        os.close(fd)
    try:
        root = open_dir(parent_fd, name, shown, create=False)
        try:
            entry = _entry_of(root)
        finally:
            os.close(root)
        wanted = {"nosuid", "nodev", "ro" if readonly else "rw"}
        if entry is None or not is_scratch(entry) or not wanted.issubset(entry.options):
            seen = f"{entry.fstype} {sorted(entry.options)}" if entry else "nothing"
            raise MountError(errno.EIO, f"mount table shows {seen} at {shown}, wanted tmpfs {sorted(wanted)}")
    except BaseException:
        unmount(shown)
        raise
    return entry


def is_scratch(entry: MountEntry) -> bool:
    """Whether `entry` is one of our engine-cache scratch filesystems (kubelet's memory emptyDirs say `tmpfs`)."""
    return entry.fstype == "tmpfs" and entry.source == SCRATCH_SOURCE


def _fd_path(fd: int) -> bytes:
    return f"/proc/self/fd/{fd}".encode()


def _mount_id(fd: int) -> int:
    """The id of the mount `fd` lies on (/proc/self/fdinfo; O_PATH fds have one too)."""
    for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("mnt_id:"):
            return int(line.split()[1])
    raise MountError(errno.EIO, f"/proc/self/fdinfo/{fd} shows no mnt_id (is /proc mounted?)")


def _entry_of(fd: int) -> MountEntry | None:
    """The mountinfo line of the mount `fd` lies on."""
    mount_id = _mount_id(fd)
    return next((e for e in mount_table() if e.mount_id == mount_id), None)


def top_mount_at(parent_fd: int, name: str, shown: str) -> MountEntry | None:
    """The topmost mount on directory `name` of the directory open as `parent_fd`, or None when it is not a mount
    point (or missing). Told by mount ids, not by path strings: the directory, opened without following a symlink,
    lies on another mount than its parent exactly when something is mounted there. A file or a symlink there is
    None too: we mount only on directories, and a link is never followed."""
    try:
        fd = open_dir(parent_fd, name, shown, create=False)
    except (FileNotFoundError, InvalidRequestError):
        return None
    try:
        mount_id = _mount_id(fd)
        if mount_id == _mount_id(parent_fd):
            return None
        return next((e for e in mount_table() if e.mount_id == mount_id), None)
    finally:
        os.close(fd)


def unmount(target: str | os.PathLike[str]) -> int:
    """Unmount every mount stacked on `target`; returns how many. Not mounted is not an error."""
    count = 0
    while mounted_at(target) is not None and unmount_top(target):
        count += 1
    return count


def unmount_top(target: str | os.PathLike[str], shown: str | None = None) -> bool:
    """Unmount the topmost mount on `target`; False when there was none (raced)."""
    if _libc.umount2(os.fsencode(os.path.abspath(target)), UMOUNT_NOFOLLOW) != 0:
        err = ctypes.get_errno()
        if err == errno.EINVAL:  # not a mount point (any more)
            return False
        raise MountError(err, f"umount failed for {shown or target}: {os.strerror(err)}")
    return True


def unmount_top_at(parent_fd: int, name: str, shown: str) -> bool:
    """`unmount_top` of directory `name` of the directory open as `parent_fd`: the parents are not walked again
    (the kernel resolves /proc/self/fd/N to the very directory the caller checked) and `name` is not followed if
    it became a symlink. No fd is held on the mount itself, which would make it busy."""
    return unmount_top(f"/proc/self/fd/{parent_fd}/{name}", shown)


def remove_target(target: str | os.PathLike[str]) -> None:
    """Remove the (empty, unmounted) target directory; never recursive and never a file, so nothing that is not
    ours is touched."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        os.rmdir(target)
