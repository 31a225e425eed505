"""Read-only bind mounts and the kernel's mount table, via mount(2)/umount2(2) and /proc/self/mountinfo.

A snapshot is published read-only, nosuid, nodev in every mount namespace the target propagates to (the kubelet
directory is a Bidirectional mount: the host and every container with it mounted see our binds). Flags set by a
remount do not propagate to peers, so the mount is made read-only *before* it is attached: the new mount API
clones the source detached (`open_tree(OPEN_TREE_CLONE)`), sets `ro,nosuid,nodev` on the clone (`mount_setattr`)
and attaches it (`move_mount`); propagation copies the flags with the mount (kernel 5.12+). Where those syscalls
are missing or refused (an older kernel, a seccomp filter), the bind and its remount happen on a private staging
directory and the finished mount is moved onto the target (`MS_MOVE`). The result is verified by reading
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
import tempfile
from dataclasses import dataclass
from pathlib import Path

from weightcache.csi.targets import open_dir
from weightcache.errors import InvalidRequestError, MountError

logger = logging.getLogger(__name__)

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_MOVE, MS_PRIVATE = 1, 2, 4, 32, 4096, 8192, 1 << 18
# The new mount API (linux/mount.h; the syscall numbers are the same on every architecture since 5.x).
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442
OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC, AT_EMPTY_PATH = 1, os.O_CLOEXEC, 0x1000
MOVE_MOUNT_F_EMPTY_PATH, MOVE_MOUNT_T_EMPTY_PATH = 0x4, 0x40
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 1, 2, 4
STAGING = Path("/run/weightcache/mount-staging")  # private: where the fallback finishes a mount before moving it
UMOUNT_NOFOLLOW = 8  # a target that became a symlink is not followed to unmount something else
READ_ONLY_OPTIONS = frozenset({"ro", "nosuid", "nodev"})
MOUNTINFO = Path("/proc/self/mountinfo")
SCRATCH_SOURCE = "weightcache-engine-cache"  # the source of our scratch mounts (tmpfs, overlay): how we know them
SCRATCH_TYPES = frozenset({"tmpfs", "overlay"})

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long
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


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def bind_readonly_at(source: str | os.PathLike[str], parent_fd: int, name: str, shown: str, *,
                     new_api: bool = True, staging: Path = STAGING) -> MountEntry:
    """Bind-mount `source` read-only, nosuid, nodev on directory `name` (made if missing) of the directory open
    as `parent_fd`, attached with those flags already set so every peer of the target gets them too; verified in
    mountinfo. The target is the directory's O_PATH fd, so no path is resolved again after the caller walked it.
    `shown` names the target in errors. `new_api=False` takes the fallback (on `staging`) without trying."""
    src = os.fsencode(os.path.abspath(source))
    fd = open_dir(parent_fd, name, shown, create=True)
    try:
        if not (new_api and _attach_readonly_clone(src, fd, shown)):
            _attach_staged(src, fd, shown, staging)
    finally:
        os.close(fd)
    try:
        root = open_dir(parent_fd, name, shown, create=False)  # the new mount's root, not the directory under it
        try:
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


def _attach_readonly_clone(src: bytes, target_fd: int, shown: str) -> bool:
    """open_tree(OPEN_TREE_CLONE) -> mount_setattr(ro,nosuid,nodev) -> move_mount onto `target_fd`. False when
    the kernel lacks or refuses the syscalls (ENOSYS, EPERM from a seccomp filter): the caller falls back. A clone
    not attached is freed when its fd closes, so a failure leaves nothing mounted."""
    tree = _libc.syscall(SYS_OPEN_TREE, -100, src, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC)  # -100: AT_FDCWD
    if tree < 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EPERM):
            return False
        raise MountError(err, f"open_tree failed for {shown}: {os.strerror(err)}")
    try:
        attr = _MountAttr(attr_set=MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
        if _libc.syscall(SYS_MOUNT_SETATTR, tree, b"", AT_EMPTY_PATH, ctypes.byref(attr), ctypes.sizeof(attr)) < 0:
            err = ctypes.get_errno()
            if err in (errno.ENOSYS, errno.EPERM):
                return False
            raise MountError(err, f"mount_setattr ro,nosuid,nodev failed for {shown}: {os.strerror(err)}")
        flags = MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH
        _syscall("move_mount", _libc.syscall(SYS_MOVE_MOUNT, tree, b"", target_fd, b"", flags), shown)
    finally:
        os.close(tree)
    return True


def _attach_staged(src: bytes, target_fd: int, shown: str, staging: Path) -> None:
    """The fallback: bind and remount on a private staging directory, where nothing propagates, then MS_MOVE the
    finished read-only mount onto the target; the move propagates it, flags and all."""
    stage = Path(tempfile.mkdtemp(prefix="bind-", dir=_private_staging(staging)))
    try:
        _syscall("mount --bind", _libc.mount(src, bytes(stage), None, MS_BIND, None), shown)
        try:
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
            _syscall("remount ro,nosuid,nodev", _libc.mount(None, bytes(stage), None, flags, None), shown)
            _syscall("mount --move", _libc.mount(bytes(stage), _fd_path(target_fd), None, MS_MOVE, None), shown)
        except BaseException:
            unmount(stage)
            raise
    finally:
        os.rmdir(stage)


def _private_staging(staging: Path) -> Path:
    """`staging` as a private mount point of its own (a bind onto itself, then MS_PRIVATE, which is idempotent):
    mounts made under it reach no peer, and the kernel refuses to MS_MOVE a mount whose parent is shared."""
    staging.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = bytes(staging)
    if mounted_at(staging) is None:
        _syscall("mount --bind", _libc.mount(path, path, None, MS_BIND, None), str(staging))
    _syscall("mount --make-private", _libc.mount(None, path, None, MS_PRIVATE, None), str(staging))
    return staging


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
        return _scratch_at(parent_fd, name, shown, "tmpfs", {"nosuid", "nodev", "ro" if readonly else "rw"})
    except BaseException:
        unmount(shown)
        raise


def _scratch_at(parent_fd: int, name: str, shown: str, fstype: str, wanted: set[str]) -> MountEntry:
    """The scratch mount just made on `name`, as mountinfo shows it: of `fstype`, ours, with the `wanted` options."""
    root = open_dir(parent_fd, name, shown, create=False)  # the new mount's root, not the directory under it
    try:
        entry = _entry_of(root)
    finally:
        os.close(root)
    if entry is None or entry.fstype != fstype or not is_scratch(entry) or not wanted <= entry.options:
        seen = f"{entry.fstype} {sorted(entry.options)}" if entry else "nothing"
        raise MountError(errno.EIO, f"mount table shows {seen} at {shown}, wanted {fstype} {sorted(wanted)}")
    return entry


def overlay_at(parent_fd: int, name: str, shown: str, lower: str | os.PathLike[str], *, size_bytes: int,
               inodes: int) -> bool:
    """A writable view of the read-only directory `lower` (an engine cache artifact) on directory `name` of the
    directory open as `parent_fd`: a fresh tmpfs of at most `size_bytes` and `inodes` (`tmpfs_at`) holding the
    overlay's upper and work directories, and an overlayfs stacked on it, nosuid, nodev; verified in mountinfo.
    Nothing is copied: the kernel copies a file up into the tmpfs only when it is written, in the writing
    process (whose memory cgroup the pages are charged to), and `lower` is never written. True when the overlay
    has `metacopy=on` (a chmod copies up the inode alone, not the data; kernels without it: False)."""
    tmpfs_at(parent_fd, name, shown, size_bytes=size_bytes, inodes=inodes)
    try:
        scratch = open_dir(parent_fd, name, shown, create=False)
        lower_fd = os.open(lower, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.mkdir("upper", 0o777, dir_fd=scratch)
            os.chmod("upper", 0o777, dir_fd=scratch, follow_symlinks=False)  # the view's root: any uid writes
            os.mkdir("work", 0o700, dir_fd=scratch)
            base = (f"lowerdir=/proc/self/fd/{lower_fd},upperdir=/proc/self/fd/{scratch}/upper,"
                    f"workdir=/proc/self/fd/{scratch}/work")
            metacopy = True
            rc = _libc.mount(SCRATCH_SOURCE.encode(), _fd_path(scratch), b"overlay", MS_NOSUID | MS_NODEV,
                             f"{base},metacopy=on".encode())
            if rc != 0 and ctypes.get_errno() == errno.EINVAL:  # built without CONFIG_OVERLAY_FS_METACOPY
                metacopy = False
                rc = _libc.mount(SCRATCH_SOURCE.encode(), _fd_path(scratch), b"overlay", MS_NOSUID | MS_NODEV,
                                 base.encode())
            _syscall("mount overlay", rc, shown)
        finally:
            os.close(lower_fd)
            os.close(scratch)
        _scratch_at(parent_fd, name, shown, "overlay", {"rw", "nosuid", "nodev"})
    except BaseException:
        unmount(shown)
        raise
    return metacopy


def is_scratch(entry: MountEntry) -> bool:
    """Whether `entry` is one of our engine-cache scratch filesystems, a tmpfs or the overlay on one (kubelet's
    memory emptyDirs say `tmpfs` too, with another source)."""
    return entry.fstype in SCRATCH_TYPES and entry.source == SCRATCH_SOURCE


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
