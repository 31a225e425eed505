"""Read-only bind mounts and the kernel's mount table, via mount(2)/umount2(2) and /proc/self/mountinfo.

A snapshot is published by two syscalls: a plain bind, then a remount of that bind with
`ro,nosuid,nodev` (the kernel ignores those flags on the first bind call). The result is verified by reading
mountinfo, never assumed. All functions block: call them from a thread in async code.

mountinfo line (proc(5)); spaces, tabs, newlines and backslashes in paths are written as octal escapes (\\040):

    36 35 259:1 /snapshots/ab12 /var/lib/kubelet/pods/u/volumes/.../mount ro,nosuid,nodev - ext4 /dev/nvme0n1 rw
    id parent dev   root            mount point                              options [optional] - fstype source super
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from weightcache.errors import MountError

logger = logging.getLogger(__name__)

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 1, 2, 4, 32, 4096
READ_ONLY_OPTIONS = frozenset({"ro", "nosuid", "nodev"})
MOUNTINFO = Path("/proc/self/mountinfo")

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
    """The topmost mount on exactly `target` (the one a process sees), or None."""
    wanted = os.path.abspath(target)
    found = None
    for entry in table if table is not None else mount_table():
        if entry.mount_point == wanted:
            found = entry  # later lines are mounted on top of earlier ones
    return found


def _syscall(name: str, rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise MountError(err, f"{name} failed for {what}: {os.strerror(err)}")


def bind_readonly(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> MountEntry:
    """Bind-mount `source` on `target` (created if missing) read-only, nosuid, nodev; verified in mountinfo."""
    src, dst = os.fsencode(os.path.abspath(source)), os.fsencode(os.path.abspath(target))
    os.makedirs(dst, mode=0o750, exist_ok=True)
    _syscall("mount --bind", _libc.mount(src, dst, None, MS_BIND, None), f"{target}")
    try:
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
        _syscall("remount ro,nosuid,nodev", _libc.mount(None, dst, None, flags, None), f"{target}")
        entry = mounted_at(target)
        if entry is None or not READ_ONLY_OPTIONS.issubset(entry.options):
            shown = sorted(entry.options) if entry else "nothing"
            raise MountError(errno.EIO, f"mount table shows {shown} at {target}, wanted ro,nosuid,nodev")
    except BaseException:
        unmount(target)
        raise
    return entry


def unmount(target: str | os.PathLike[str]) -> int:
    """Unmount every mount stacked on `target`; returns how many. Not mounted is not an error."""
    dst = os.fsencode(os.path.abspath(target))
    count = 0
    while mounted_at(target) is not None:
        if _libc.umount2(dst, 0) != 0:
            err = ctypes.get_errno()
            if err == errno.EINVAL:  # raced: no longer a mount point
                break
            raise MountError(err, f"umount failed for {target}: {os.strerror(err)}")
        count += 1
    return count


def remove_target(target: str | os.PathLike[str]) -> None:
    """Remove the (empty, unmounted) target directory; never recursive, so nothing behind a mount is touched."""
    try:
        os.rmdir(target)
    except FileNotFoundError:
        pass
    except NotADirectoryError:
        os.unlink(target)
