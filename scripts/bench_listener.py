#!/usr/bin/env python3
"""Slowloris against the daemon API's TCP listener, side by side with a plain aiohttp TCPSite (what the daemon
used before, and what a user would write): the same app, each server in its own process.

The attacker opens --connections connections and sends each a request line and one header, never the blank line
that ends the headers. While they hang, a client sends whole requests (`GET /healthz`) one at a time; then the
script waits --hold seconds and counts what the server still holds. Per server: file descriptors the server
process holds at the peak, the share of whole requests answered 200 during the attack and their median latency,
half-sent connections still open after --hold seconds, and bytes the server logged. One run each; the table
shows the ratio.

    .venv/bin/python scripts/bench_listener.py [--connections 400] [--hold 12] [--probes 20]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SERVER = r"""
import asyncio, logging, sys
from aiohttp import web
from weightcache.listener import GuardedTCPSite

async def healthz(request):
    return web.json_response({"ok": True})

async def main(mode):
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    if mode == "guarded":
        site = GuardedTCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site.port
    else:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
    print(port, flush=True)
    await asyncio.Event().wait()

asyncio.run(main(sys.argv[1]))
"""


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def probe(port: int) -> float | None:
    """Seconds for one whole request; None when it was not answered 200."""
    started = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n")
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
    except OSError:
        return None
    return time.perf_counter() - started if reply.startswith(b"HTTP/1.1 200") else None


def still_open(socks: list[socket.socket]) -> int:
    """Connections the server has not closed: a non-blocking read finds neither EOF nor a reset."""
    count = 0
    for sock in socks:
        sock.setblocking(False)
        try:
            data = sock.recv(65536)
            count += 0 if data == b"" or data.startswith(b"HTTP/1.1 408") else 1
        except BlockingIOError:
            count += 1
        except OSError:
            pass
    return count


def attack(mode: str, args: argparse.Namespace, log_path: Path) -> dict[str, float]:
    with log_path.open("wb") as log:
        server = subprocess.Popen([sys.executable, "-c", SERVER, mode], stdout=subprocess.PIPE, stderr=log,
                                  text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        baseline_fds = fds(server.pid)
        socks = []
        for _ in range(args.connections):
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: b\r\nX-Slow: ")
                socks.append(sock)
            except OSError:
                break
        time.sleep(0.5)
        peak_fds = fds(server.pid) - baseline_fds
        probes = [probe(port) for _ in range(args.probes)]
        latencies = [p for p in probes if p is not None]
        time.sleep(args.hold)
        held = still_open(socks)
        for sock in socks:
            sock.close()
    finally:
        server.kill()
        server.wait()
    return {"fds": peak_fds, "served": len(latencies) / len(probes) * 100,
            "latency_ms": statistics.median(latencies) * 1000 if latencies else float("nan"), "held": held,
            "log_bytes": log_path.stat().st_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=400)
    parser.add_argument("--hold", type=float, default=12.0, help="seconds after the attack before counting")
    parser.add_argument("--probes", type=int, default=20)
    args = parser.parse_args()
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    ours = attack("guarded", args, tmp / "bench_listener_guarded.log")
    plain = attack("plain", args, tmp / "bench_listener_plain.log")
    print(f"slowloris: {args.connections} half-sent requests, counted {args.hold:g}s later")
    print(f"{'':34} {'weightcache':>12} {'aiohttp TCPSite':>16} {'ratio':>8}")
    rows = [("server fds held at peak", "fds", "{:.0f}"), ("whole requests served (%)", "served", "{:.0f}"),
            ("whole request latency (ms, median)", "latency_ms", "{:.1f}"),
            ("half-sent connections still open", "held", "{:.0f}"), ("server log bytes", "log_bytes", "{:.0f}")]
    for label, key, fmt in rows:
        ratio = f"{ours[key] / plain[key]:.2f}" if plain[key] else "-"
        print(f"{label:34} {fmt.format(ours[key]):>12} {fmt.format(plain[key]):>16} {ratio:>8}")


if __name__ == "__main__":
    main()
