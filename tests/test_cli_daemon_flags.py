"""Fetch flags the daemon's API does not take are refused with what to do, never dropped: with a daemon running,
`prefetch --endpoint-url` used to fetch from AWS (the flag silently gone) while `--no-daemon` worked. Through a
real daemon on its socket, the CLI as a subprocess."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from tests.command import weightcache
from tests.fixtures_daemon import RunningDaemon


def _wc(*args: str, sock: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WEIGHTCACHE_ROOT", "AWS_ENDPOINT_URL")}
    env.update({"KUBECONFIG": "/nonexistent", "WEIGHTCACHE_SOCKET": str(sock)})
    return weightcache(*args, env=env)


@pytest.mark.e2e
async def test_prefetch_through_the_daemon_refuses_flags_it_cannot_honour(daemon: RunningDaemon) -> None:
    flags = ["--endpoint-url", "http://127.0.0.1:9/", "--concurrency", "3", "--chunk-size", "1Mi",
             "--connect-timeout", "2", "--read-timeout", "3"]
    done = await asyncio.to_thread(_wc, "prefetch", daemon.model_uri, *flags, sock=daemon.socket)
    assert done.returncode == 2, done.stderr
    assert "the daemon at" in done.stderr and "--no-daemon" in done.stderr and "Traceback" not in done.stderr
    for flag in flags[::2]:
        assert flag in done.stderr
    for key in ("`endpoints`", "`concurrency`", "`chunkSize`", "`connectTimeout`", "`readTimeout`"):
        assert key in done.stderr
    assert await asyncio.to_thread(daemon.client.list) == [], "nothing fetched under other settings than asked"

    plain = await asyncio.to_thread(_wc, "prefetch", daemon.model_uri, "-q", sock=daemon.socket)
    assert plain.returncode == 0, plain.stderr  # without them: through the daemon as before
    assert plain.stdout.strip().startswith(str(daemon.root))


@pytest.mark.e2e
async def test_verify_repair_through_the_daemon_refuses_an_endpoint(daemon: RunningDaemon) -> None:
    await asyncio.to_thread(daemon.client.ensure, daemon.model_uri)
    done = await asyncio.to_thread(_wc, "verify", "--repair", "--endpoint-url", "http://127.0.0.1:9/",
                                   sock=daemon.socket)
    assert done.returncode == 2 and "--endpoint-url" in done.stderr, done.stderr
    ok = await asyncio.to_thread(_wc, "verify", "--endpoint-url", "http://127.0.0.1:9/", sock=daemon.socket)
    assert ok.returncode == 0, ok.stderr  # without --repair nothing is fetched: the flag has nothing to change
