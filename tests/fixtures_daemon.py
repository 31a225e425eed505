"""Daemon fixtures: a real daemon in the test's event loop, on a real Unix socket, with a real store and model.

    async def test_x(daemon):
        async with daemon.http() as http:                     # aiohttp over the daemon's Unix socket
            async with http.put("/v1/models?wait=1", json={"uri": daemon.model_uri}) as r: ...
        await asyncio.to_thread(daemon.client.list)           # the CLI's sync client

Sockets live in a short /tmp directory: AF_UNIX paths are limited to 107 bytes and pytest's tmp_path is long.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.sample import make_model
from weightcache.daemon.app import Daemon
from weightcache.daemon.client import DaemonClient
from weightcache.daemon.config import load_settings


@dataclass
class RunningDaemon:
    daemon: Daemon
    socket: Path
    root: Path
    model_uri: str  # a file:// model nobody fetched yet
    model_dir: Path
    client: DaemonClient

    @asynccontextmanager
    async def http(self) -> AsyncIterator[aiohttp.ClientSession]:
        connector = aiohttp.UnixConnector(path=str(self.socket))
        async with aiohttp.ClientSession("http://daemon", connector=connector) as session:
            yield session


@pytest.fixture(autouse=True)
def off_cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No Kubernetes config is found unless a test writes one (a developer's ~/.kube/config must not leak in)."""
    for name in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "KUBECONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real safetensors model (two shards, index, config, tokenizer), made once."""
    path = tmp_path_factory.mktemp("model") / "tiny"
    make_model(path, layers=2, hidden=64, vocab=128)
    return path


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="wcd-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def model_copy(tiny_model: Path, short_dir: Path) -> Path:
    """A private copy of the tiny model: its URI is new to every test."""
    dest = short_dir / "src" / "tiny"
    shutil.copytree(tiny_model, dest)
    return dest


async def start_daemon(base: Path, model_dir: Path, *, config: dict[str, Any] | None = None,
                       env: dict[str, str] | None = None, socket: Path | None = None) -> RunningDaemon:
    """Start a daemon rooted under `base`; `config` (camelCase) is written to base/config.yaml when given."""
    flags = {"root": str(base / "root"), "socket": str(socket or base / "d.sock")}
    path = None
    if config is not None:
        path = base / "config.yaml"
        path.write_text(yaml.safe_dump(config))
    settings = load_settings(path, env=env or {}, flags=flags)
    daemon = Daemon(settings, env=env or {}, flags=flags)
    await daemon.start()
    return RunningDaemon(daemon, settings.api.socket, settings.store.root, f"file://{model_dir}/", model_dir,
                         DaemonClient(settings.api.socket))


@pytest.fixture
async def daemon(short_dir: Path, model_copy: Path) -> AsyncIterator[RunningDaemon]:
    running = await start_daemon(short_dir, model_copy)
    try:
        yield running
    finally:
        await running.daemon.stop()


_CHECKS = ThreadPoolExecutor(4, thread_name_prefix="eventually")


def wait_until(check: Callable[[], Any], *, timeout: float = 20.0, what: str = "condition", every: float = 0.05) -> Any:
    """`eventually` for a test without an event loop: poll `check` here, every `every` seconds, until it returns
    something truthy (returned); fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)
    return result


async def eventually(check: Callable[[], Any], *, timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll a (blocking) check in a thread until it returns something truthy; fail after `timeout`. The checks run
    on a pool of their own: in the loop's default pool they would queue behind the daemon under test's own blocking
    work (6 threads on 2 cores), and a test could wait on that rather than on what it checks."""
    deadline = time.monotonic() + timeout
    loop = asyncio.get_running_loop()
    while True:
        result = await loop.run_in_executor(_CHECKS, check)
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)
