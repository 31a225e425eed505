#!/usr/bin/env python3
"""A burst of connects at a guarded listener's cap (weightcache/listener.py), with raw sockets: a site of cap 4
holds 3 keep-alive connections idle since their first answer and 1 half-sent request; then 8 clients connect one
after another, each sending a whole request at once (`Connection: close`), and the script counts what each got
(200, 408, closed or reset) and what the half-sent one got, with the site's counters. One run; no arguments.

    PYTHONPATH=. .venv/bin/python scripts/listener_cap_burst.py
"""

from __future__ import annotations

import asyncio
import collections
import socket

from aiohttp import web

from weightcache.listener import ConnectionLimits, GuardedTCPSite

WHOLE = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


def _answer(sock: socket.socket) -> str:
    sock.settimeout(3)
    try:
        got = sock.recv(1000)
    except OSError as exc:
        return type(exc).__name__
    return got[9:12].decode() if got.startswith(b"HTTP/1.1 ") else "closed"


def _burst(port: int) -> collections.Counter[str]:
    held = []
    for _ in range(3):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _answer(sock) == "200"
        held.append(sock)
    slow = socket.create_connection(("127.0.0.1", port))
    slow.sendall(b"GET / HTTP/1.1\r\nHo")
    held.append(slow)
    burst = []
    for _ in range(8):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(WHOLE)
        burst.append(sock)
    counts = collections.Counter(_answer(sock) for sock in burst)
    counts["half-sent: " + _answer(slow)] += 1
    for sock in held + burst:
        sock.close()
    return counts


async def main() -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", ok)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=600)
    await runner.setup()
    site = GuardedTCPSite(runner, "127.0.0.1", 0, limits=ConnectionLimits(4, header_timeout_s=600,
                                                                 body_timeout_s=600, idle_timeout_s=600))
    await site.start()
    await asyncio.sleep(0.1)
    try:
        counts = await asyncio.to_thread(_burst, site.port)
    finally:
        await runner.cleanup()
    stats = site.stats
    print(dict(counts), f"idle_closed {getattr(stats, 'idle_closed', '-')} shed {stats.shed} refused {stats.refused}")


if __name__ == "__main__":
    asyncio.run(main())
