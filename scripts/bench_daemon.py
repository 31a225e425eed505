#!/usr/bin/env python3
"""Benchmark the node daemon: idle RSS and CPU, GET /v1/models with 1,000 cached models, startup with 500
ModelCaches. Each comparison runs ours and what a user would otherwise run side by side, interleaved, with the
same idle pause before each call; figures are medians over --runs runs.

    .venv/bin/python scripts/bench_daemon.py [--models 1000] [--modelcaches 500] [--runs 3] [--calls 30]

Targets: idle RSS < 150 MB and ~0 % CPU; GET /v1/models p50 < 20 ms at 1,000 models; first reconcile pass over
500 ModelCaches < 2 s.
  list    ours: DaemonClient.list() over the Unix socket        baseline: Store(root).list(), as the CLI does
                                                                without a daemon (open the index, then list)
  ls      ours: `weightcache ls -o json` (through the daemon)   baseline: `weightcache ls -o json --root R`
  startup ours: daemon start -> first reconcile pass done, 500 ModelCaches from an API server speaking the real
          protocol (tests/fake_apiserver.py); no baseline exists (it would be a hand-written script per model)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from weightcache.daemon.app import Daemon  # noqa: E402
from weightcache.daemon.client import DaemonClient  # noqa: E402
from weightcache.daemon.config import load_settings  # noqa: E402
from weightcache.kube.report import NodeReporter  # noqa: E402
from weightcache.store import FileEntry, Store  # noqa: E402
from weightcache.uri import parse_ref  # noqa: E402

IDLE_S = 0.01
PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")


def fill_store(root: Path, models: int) -> list[str]:
    """`models` small snapshots, published directly (the bench is about the daemon, not about fetching)."""
    store = Store(root)
    shared = os.urandom(64 << 10)
    uris = []
    for i in range(models):
        uri = f"s3://bench-models/m{i:04d}/"
        entries = []
        for name, data in (("model.safetensors", shared), ("config.json", json.dumps({"i": i}).encode())):
            sha = hashlib.sha256(data).hexdigest()
            if not store.has_blob(sha):
                tmp = store.layout.partial / f"bench-{sha}"
                tmp.write_bytes(data)
                store.add_blob(tmp, sha)
            entries.append(FileEntry(name, len(data), sha))
        store.publish(parse_ref(uri), entries)
        uris.append(uri)
    store.close()
    return uris


def spawn_daemon(work: Path, root: Path, config: Path | None = None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "WEIGHTCACHE_"))}
    env.update(HOME=str(work), KUBECONFIG=str(work / "none"), PYTHONPATH=str(REPO))
    args = [sys.executable, "-m", "weightcache", "daemon", "--root", str(root), "--socket", str(work / "d.sock"),
            "--log-format", "json"] + (["--config", str(config)] if config else [])
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:  # ready when it says so, not after a sleep
        if "weightcache daemon serving on" in line:
            return proc
    raise SystemExit(f"the daemon exited with {proc.wait()} before serving")


def stop_daemon(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    if proc.stderr is not None:
        proc.stderr.close()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE / 1e6


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def idle(work: Path, root: Path, seconds: float) -> tuple[float, float]:
    """(RSS MB, CPU %) of a daemon holding the store, after one list, over `seconds` of doing nothing."""
    proc = spawn_daemon(work, root)
    try:
        DaemonClient(work / "d.sock").list()
        time.sleep(2.0)  # let the first answer's work finish: we measure doing nothing
        start = cpu_s(proc.pid)
        time.sleep(seconds)  # the measurement window itself, not a readiness wait
        cpu = (cpu_s(proc.pid) - start) / seconds * 100
        return rss_mb(proc.pid), cpu
    finally:
        stop_daemon(proc)


def list_latency(work: Path, root: Path, calls: int) -> dict[str, list[float]]:
    proc = spawn_daemon(work, root)
    client = DaemonClient(work / "d.sock")
    times: dict[str, list[float]] = {"ours": [], "store": []}
    try:
        client.list()  # warm
        for _ in range(calls):
            time.sleep(IDLE_S)
            t0 = time.perf_counter()
            client.list()
            times["ours"].append(time.perf_counter() - t0)
            time.sleep(IDLE_S)
            t0 = time.perf_counter()
            store = Store(root, recover=False)
            store.list()
            store.close()
            times["store"].append(time.perf_counter() - t0)
    finally:
        stop_daemon(proc)
    return times


def cli_latency(work: Path, root: Path, calls: int) -> dict[str, list[float]]:
    proc = spawn_daemon(work, root)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTCACHE_")}
    env.update(WEIGHTCACHE_SOCKET=str(work / "d.sock"), PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "weightcache", "ls", "-o", "json"]
    times: dict[str, list[float]] = {"ours": [], "store": []}
    try:
        for _ in range(calls):
            for key, extra in (("ours", []), ("store", ["--root", str(root)])):
                time.sleep(IDLE_S)
                t0 = time.perf_counter()
                out = subprocess.run(cmd + extra, env=env, cwd=REPO, capture_output=True, check=True)
                times[key].append(time.perf_counter() - t0)
                assert out.stdout.count(b'"id"') >= 1
    finally:
        stop_daemon(proc)
    return times


async def startup(work: Path, root: Path, uris: list[str], count: int) -> tuple[float, float, int]:
    """(seconds from start to the first pass done, seconds of that pass, API requests) with `count` ModelCaches."""
    from tests.fake_apiserver import FakeApiServer

    with FakeApiServer() as api:
        api.create("nodes", {"metadata": {"name": "bench-node", "labels": {"pool": "gpu"}}})
        for i, uri in enumerate(uris[:count]):
            api.create("modelcaches", {"metadata": {"name": f"mc-{i:04d}"},
                                       "spec": {"source": uri, "nodeSelector": {"pool": "gpu"},
                                                "allowedNamespaces": ["*"]}})
        kubeconfig = work / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "b",
            "clusters": [{"name": "c", "cluster": {"server": api.url}}], "users": [{"name": "u", "user": {}}],
            "contexts": [{"name": "b", "context": {"cluster": "c", "user": "u"}}]}))
        os.environ["KUBECONFIG"] = str(kubeconfig)
        before = len(api.requests)
        settings = load_settings(None, env={}, flags={"root": str(root), "socket": str(work / "s.sock"),
                                                     "nodeName": "bench-node"})
        daemon = Daemon(settings, env={}, flags={})
        t0 = time.perf_counter()
        await daemon.start()
        try:
            while daemon.reconciler is None or daemon.reconciler.passes < 1:
                await asyncio.sleep(0.005)
            total = time.perf_counter() - t0
            assert len(daemon.reconciler.held) == count, "every ModelCache should be held"
            hist = daemon.node.metrics.registry.get_sample_value("weightcache_reconcile_duration_seconds_sum")
        finally:
            await daemon.stop()
            del os.environ["KUBECONFIG"]
        return total, float(hist or 0.0), len(api.requests) - before


def p(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--modelcaches", type=int, default=500)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--calls", type=int, default=30, help="API calls per run (CLI calls: a fifth of it)")
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="wcb-") as tmp:
        work, root = Path(tmp), Path(tmp) / "root"
        t0 = time.perf_counter()
        uris = fill_store(root, args.models)
        print(f"store: {args.models} cached models in {time.perf_counter() - t0:.1f}s; {args.runs} runs each\n")
        idles, lists, clis, starts, batched = [], [], [], [], []
        for _ in range(args.runs):
            idles.append(idle(work, root, args.idle_seconds))
            lists.append(list_latency(work, root, args.calls))
            clis.append(cli_latency(work, root, max(3, args.calls // 5)))
            starts.append(asyncio.run(startup(work, root, uris, args.modelcaches)))
            if not hasattr(NodeReporter, "report_many"):
                with proposed_report_many():
                    batched.append(asyncio.run(startup(work, root, uris, args.modelcaches)))
        report(args, idles, lists, clis, starts, batched)


@contextlib.contextmanager
def proposed_report_many() -> Iterator[None]:
    """NodeReporter.report_many as proposed to weightcache/kube/report.py (record all, then one flush)."""
    def report_many(self: NodeReporter, states: dict) -> None:
        with self._lock:
            self._pending.update(states)
        self.flush()
    NodeReporter.report_many = report_many  # type: ignore[attr-defined]
    try:
        yield
    finally:
        del NodeReporter.report_many  # type: ignore[attr-defined]


def report(args: argparse.Namespace, idles: list, lists: list, clis: list, starts: list, batched: list) -> None:
    med = statistics.median
    print(f"{'measure':<44}{'ours':>12}{'baseline':>12}{'ratio':>9}{'target':>12}")

    def row(name: str, ours: float, base: float | None, target: str) -> None:
        b = f"{base:>12.2f}" if base is not None else f"{'-':>12}"
        r = f"{ours / base:>8.2f}x" if base else f"{'-':>9}"
        print(f"{name:<44}{ours:>12.2f}{b}{r}{target:>12}")

    row("idle RSS (MB)", med(r for r, _ in idles), None, "< 150")
    row(f"idle CPU (%, over {args.idle_seconds:.0f}s)", med(c for _, c in idles), None, "~ 0")
    for label, runs in ((f"GET /v1/models, {args.models} models (ms)", lists),
                        (f"`weightcache ls -o json`, {args.models} (ms)", clis)):
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            ours = med(p(r["ours"], q) for r in runs) * 1000
            base = med(p(r["store"], q) for r in runs) * 1000
            row(f"{label} {name}", ours, base, "< 20" if q == 0.5 and runs is lists else "")
    row(f"startup -> first pass, {args.modelcaches} ModelCaches (s)", med(s[0] for s in starts), None, "< 2")
    row("  of which the reconcile pass itself (s)", med(s[1] for s in starts), None, "")
    row("  API requests during startup", med(s[2] for s in starts), None, "")
    if batched:
        row("  same, with the proposed report_many (s)", med(s[0] for s in batched), None, "< 2")
        row("  API requests with report_many", med(s[2] for s in batched), None, "")
    print("\nbaseline: the store opened and listed directly (what the CLI does without a daemon)")


if __name__ == "__main__":
    main()
