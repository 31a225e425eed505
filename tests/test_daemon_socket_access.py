"""Who may use the daemon's API socket: real processes of other uids (setpriv) against a real daemon. The socket is
mode 0660 and root's, so its file mode alone let every process of group 0 be the daemon's admin; the daemon now
checks the peer's kernel credentials (SO_PEERCRED): root, its own uid, or a member of `socketGroup`."""

from __future__ import annotations

import asyncio
import grp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures_daemon import start_daemon

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                 reason="running a client as another uid needs root and setpriv")]

NOBODY = 65534
CLIENT = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(b"DELETE /v1/models/0123456789abcdef0123456789abcdef01234567 HTTP/1.0\\r\\n\\r\\n")
print(b"".join(iter(lambda: s.recv(65536), b"")).decode())
"""


def as_user(socket_path: Path, *, gid: int, groups: tuple[int, ...] = ()) -> tuple[int, str]:
    """(status, body) of an admin request (an eviction) sent by a process of uid 65534 and these groups."""
    ids = ["--reuid", str(NOBODY), "--regid", str(gid)]
    ids += ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    done = subprocess.run(["setpriv", *ids, sys.executable, "-I", "-c", CLIENT, str(socket_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    head, _, body = done.stdout.partition("\n\n")  # text mode: the CRLFs read as newlines
    return int(head.split()[1]), body


async def test_group_0_is_not_admin_and_socket_group_members_are(short_dir: Path, model_copy: Path) -> None:
    """Hardening IV: any process with group 0 was admin on the daemon's socket (its mode 0660, root:root). A
    process of uid 65534 with gid 0 is now refused with 403 saying who may; root still is admin; with
    `socketGroup: users` a member of that group is admin too (and the socket is of that group)."""
    short_dir.chmod(0o755)  # other uids may reach the socket; its own mode still decides who connects
    d = await start_daemon(short_dir, model_copy)
    try:
        status, body = await asyncio.to_thread(as_user, d.socket, gid=0)
        answer = json.loads(body)
        assert status == 403 and answer["error"] == "not_allowed", body
        assert answer["message"] == (f"uid {NOBODY} (gid 0) may not use the weightcache daemon's socket: only root "
                                     "(uid 0) may; run it as root (sudo), or name a group of its users in the "
                                     "daemon's config (socketGroup)")
        assert await asyncio.to_thread(d.client.list) == []  # root (this process) is admin
    finally:
        await d.daemon.stop()

    users = grp.getgrnam("users").gr_gid
    d = await start_daemon(short_dir, model_copy, config={"socketGroup": "users"})
    try:
        assert d.socket.stat().st_gid == users and d.socket.stat().st_mode & 0o777 == 0o660
        status, body = await asyncio.to_thread(as_user, d.socket, gid=NOBODY, groups=(users,))
        assert status == 200 and "evicted" in json.loads(body), body  # admitted: the eviction ran
    finally:
        await d.daemon.stop()
