"""Unix socket paths the node's servers listen on (daemon API, CSI, DRA): free a stale one, refuse a live one."""

from __future__ import annotations

import socket
import stat
from pathlib import Path

from weightcache.errors import ConfigError


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
