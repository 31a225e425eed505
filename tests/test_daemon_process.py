"""`weightcache daemon` as a real process: JSON logs, SIGTERM -> exit 0 with sockets removed, downloads parked."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.command import start_weightcache
from tests.sample import make_model
from weightcache.daemon.client import DaemonClient
from weightcache.errors import FetchCancelledError

REPO = Path(__file__).resolve().parents[1]


class DaemonProcess:
    def __init__(self, base: Path, *args: str) -> None:
        self.socket = base / "d.sock"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "WEIGHTCACHE_"))}
        env.update(HOME=str(base), KUBECONFIG=str(base / "no-kubeconfig"), PYTHONPATH=str(REPO))
        self.proc = start_weightcache("daemon", "--root", str(base / "root"), "--socket", str(self.socket),
                                      "--log-format", "json", *args, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE)
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        with self.proc.stderr:
            for line in self.proc.stderr:
                self.lines.put(line)
        self.lines.put("")

    def wait_for_log(self, text: str, timeout: float = 30.0) -> dict:
        """Readiness from the daemon's own log line, not from sleeping."""
        while True:
            line = self.lines.get(timeout=timeout)
            if not line:
                raise AssertionError(f"daemon exited before logging {text!r}:\n" + "".join(self.log))
            self.log.append(line)
            record = json.loads(line)
            if text in record["message"]:
                return record

    def stop(self, timeout: float = 30.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout)
        while (line := self.lines.get(timeout=timeout)):
            self.log.append(line)
        return rc


@pytest.fixture
def spawn(short_dir: Path) -> Iterator[type[DaemonProcess]]:
    started: list[DaemonProcess] = []

    def make(*args: str) -> DaemonProcess:
        started.append(DaemonProcess(short_dir, *args))
        return started[-1]
    yield make  # type: ignore[misc]
    for d in started:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


@pytest.mark.e2e
def test_sigterm_exits_0_removes_the_socket_and_every_log_line_is_json(spawn, short_dir: Path) -> None:
    d = spawn()
    d.wait_for_log("weightcache daemon serving on")
    assert d.socket.is_socket()
    assert DaemonClient(d.socket).list() == []
    assert d.stop() == 0
    assert not d.socket.exists()
    records = [json.loads(line) for line in d.log]
    assert records[-1]["message"] == "weightcache daemon stopped"
    assert {"time", "level", "logger", "message"} <= set(records[0])


@pytest.mark.e2e
def test_sigterm_parks_a_download_and_the_next_daemon_resumes_it(spawn, short_dir: Path, s3, fault_proxy) -> None:
    model = short_dir / "big"
    make_model(model, layers=4, hidden=256, vocab=1024)  # ~9.5 MB: ~150 chunks of 64 KiB
    s3.upload_dir(model, "models", "big/")
    config = short_dir / "config.yaml"
    config.write_text(yaml.safe_dump({"endpoints": {"s3": {"endpointUrl": fault_proxy.endpoint_url}},
                                      "concurrency": 1, "chunkSize": "64Ki"}))
    fault_proxy.add("delay", seconds=0.1, method="GET", ranged_only=True, count=-1)
    d = spawn("--config", str(config))
    d.wait_for_log("weightcache daemon serving on")

    started = threading.Event()
    outcome: list[BaseException | dict] = []

    def fetch() -> None:
        def on_progress(p: dict) -> None:
            if p["bytes_done"] > 0:
                started.set()
        try:
            outcome.append(DaemonClient(d.socket).ensure("s3://models/big/", on_progress=on_progress))
        except Exception as exc:
            outcome.append(exc)
        started.set()
    worker = threading.Thread(target=fetch)
    worker.start()
    assert started.wait(60)
    assert d.stop() == 0
    worker.join(30)
    assert isinstance(outcome[0], FetchCancelledError) and "daemon is stopping" in str(outcome[0])
    assert "resumes where it stopped" in str(outcome[0])
    assert not d.socket.exists()
    parts = list((short_dir / "root" / "partial").glob("*.part"))
    assert parts and sum(p.stat().st_size for p in parts) > 0

    fault_proxy.clear()
    d2 = spawn("--config", str(config))
    d2.wait_for_log("weightcache daemon serving on")
    snap = DaemonClient(d2.socket).ensure("s3://models/big/")
    total = sum(p.stat().st_size for p in model.iterdir())
    assert snap["size"] == total
    origin = [line for line in DaemonClient(d2.socket).metrics().splitlines()
              if line.startswith('weightcache_origin_bytes_total{scheme="s3"}')]
    assert 0 < float(origin[0].split()[-1]) < total  # only what the first daemon had not fetched
    assert d2.stop() == 0
