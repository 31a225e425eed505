"""Unix socket paths the node's servers listen on (daemon API, CSI, DRA): free a stale one, refuse a live one; and
who may use the daemon's API socket, by the peer's credentials (SO_PEERCRED), not by its file mode alone.

The socket is mode 0660 and root's: without a check of the peer, every process of group 0 on the node (many
images run as root:root with a uid of their own, or add group 0 for OpenShift) was the daemon's admin. The
kernel's credentials of the connecting process decide: uid 0, the daemon's own uid, or a member of the group the
config names (`socketGroup`: its primary group, or one of its supplementary groups as /proc/<pid>/status lists
them); anyone else gets 403 with what to do.
"""

from __future__ import annotations

import grp
import os
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightcache.errors import ConfigError

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int


def peer_of(sock: Any) -> Peer:
    """The credentials the kernel recorded for the process at the other end of a connected Unix socket."""
    return Peer(*_UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)))


@dataclass(frozen=True)
class SocketAccess:
    """Who may use the API socket: root, the daemon's own uid, and members of `gid` (`socketGroup`)."""

    uids: frozenset[int]
    gid: int | None = None
    group: str = ""  # as the config names it, for messages

    @classmethod
    def configured(cls, group: str | None) -> SocketAccess:
        """Root and this process's uid; with `group` (a name or a number), its members too (ConfigError when
        the node has no such group)."""
        uids = frozenset({0, os.geteuid()})
        if not group:
            return cls(uids)
        try:
            gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
        except KeyError:
            raise ConfigError(f"socketGroup: the node has no group {group[:64]!r}; create it, or name an existing "
                              "group (or its number)") from None
        return cls(uids, gid, group)

    def refusal(self, peer: Peer) -> str | None:
        """None when `peer` may use the API; else the message its 403 carries."""
        if peer.uid in self.uids or (self.gid is not None and self.gid in _groups(peer)):
            return None
        who = "root (uid 0)" + (f" and members of group {self.group!r} (socketGroup)" if self.gid is not None
                                else "")
        fix = (f"run it as root (sudo) or as a member of group {self.group!r}" if self.gid is not None else
               "run it as root (sudo), or name a group of its users in the daemon's config (socketGroup)")
        return (f"uid {peer.uid} (gid {peer.gid}) may not use the weightcache daemon's socket: only {who} may; "
                f"{fix}")


def _groups(peer: Peer) -> set[int]:
    """The peer's primary and supplementary groups (only the primary one when /proc cannot say: the process left)."""
    groups = {peer.gid}
    try:
        with open(f"/proc/{peer.pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Groups:"):
                    groups.update(int(g) for g in line.split()[1:] if g.isdigit())
                    break
    except OSError:
        pass
    return groups


def claim_socket_path(path: Path, *, change: str) -> None:
    """Make `path` ready to bind: its directory exists and a socket left by a killed process is removed.

    Anything else there is refused with a ConfigError that says to remove it or change `change` (the setting that
    chose the path): a file that is not a socket, or a socket another live process still serves.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"{path} exists and is not a socket; remove it or change {change}")
    if _alive(path):
        raise ConfigError(f"another process serves {path}; stop it (another weightcache on this node?) or change "
                          f"{change}")
    path.unlink()


def _alive(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True
