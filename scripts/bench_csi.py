#!/usr/bin/env python3
"""Benchmark: NodePublishVolume + NodeUnpublishVolume of a cached model over the real gRPC socket, against what a
user would otherwise script (`mount --bind -o ro SNAPSHOT TARGET` + `umount TARGET`). Needs root.

    sudo .venv/bin/python scripts/bench_csi.py [--cycles 100]

Cycles alternate between the two tools, with the same idle pause before each; prints median and p99 of the
publish step and of the whole cycle, and their ratio (ours / plain mount). Target: publish median < 50 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from tests.sample import make_model  # noqa: E402
from weightcache.csi import mounts  # noqa: E402
from weightcache.csi._pb import csi_pb2, csi_pb2_grpc  # noqa: E402
from weightcache.csi.server import serve_csi  # noqa: E402
from weightcache.fetch import Fetcher  # noqa: E402
from weightcache.policy import Decision  # noqa: E402
from weightcache.store import FileEntry, Snapshot, Store  # noqa: E402
from weightcache.uri import parse_ref  # noqa: E402

URI = "s3://models/bench/"
IDLE_S = 0.005


def cache_model(store: Store, source: Path) -> Snapshot:
    """Put a sample model into the store directly (no object store needed: the bench is about publishing)."""
    entries = []
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        data = path.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        tmp = store.root / "partial" / f"bench-{sha}"
        tmp.write_bytes(data)
        store.add_blob(tmp, sha)
        entries.append(FileEntry(path.relative_to(source).as_posix(), len(data), sha))
    return store.publish(parse_ref(URI), entries)


def request(volume_id: str, target: Path) -> csi_pb2.NodePublishVolumeRequest:
    mode = csi_pb2.VolumeCapability.AccessMode(mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER)
    return csi_pb2.NodePublishVolumeRequest(
        volume_id=volume_id, target_path=str(target), readonly=True,
        volume_capability=csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(), access_mode=mode),
        volume_context={"model": URI, "csi.storage.k8s.io/pod.namespace": "bench",
                        "csi.storage.k8s.io/pod.name": "bench", "csi.storage.k8s.io/pod.uid": volume_id})


async def run(cycles: int, work: Path) -> dict[str, list[float]]:
    store = Store(work / "store")
    snapshot = cache_model(store, work / "model")
    fetcher = Fetcher(store)
    server = await serve_csi(f"unix://{work}/csi.sock", store=store, fetcher=fetcher, node_id="bench",
                             policy=lambda uri, ns: Decision(True, "bench"), kubelet_dir=work / "kubelet")
    times: dict[str, list[float]] = {k: [] for k in ("ours publish", "ours cycle", "mount publish", "mount cycle")}
    async with grpc.aio.insecure_channel(f"unix://{work}/csi.sock") as channel:
        node = csi_pb2_grpc.NodeStub(channel)
        await node.NodeGetInfo(csi_pb2.NodeGetInfoRequest())  # connect before timing
        for i in range(cycles):
            target = work / "kubelet" / "pods" / f"p{i}" / "mount"
            await asyncio.sleep(IDLE_S)
            t0 = time.perf_counter()
            await node.NodePublishVolume(request(f"v{i}", target))
            t1 = time.perf_counter()
            await node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id=f"v{i}",
                                                                              target_path=str(target)))
            t2 = time.perf_counter()
            times["ours publish"].append(t1 - t0)
            times["ours cycle"].append(t2 - t0)

            plain = work / "plain" / f"p{i}"
            await asyncio.sleep(IDLE_S)
            t0 = time.perf_counter()
            plain.mkdir(parents=True)
            subprocess.run(["mount", "--bind", "-o", "ro", str(snapshot.path), str(plain)], check=True)
            t1 = time.perf_counter()
            subprocess.run(["umount", str(plain)], check=True)
            plain.rmdir()
            t2 = time.perf_counter()
            times["mount publish"].append(t1 - t0)
            times["mount cycle"].append(t2 - t0)
    await server.stop(grace=None)
    store.close()
    return times


def p99(values: list[float]) -> float:
    return sorted(values)[max(0, int(round(0.99 * len(values))) - 1)]


def report(all_runs: list[dict[str, list[float]]]) -> None:
    def med(key: str) -> float:
        return statistics.median(statistics.median(r[key]) for r in all_runs) * 1000

    def tail(key: str) -> float:
        return statistics.median(p99(r[key]) for r in all_runs) * 1000

    print(f"\n{len(all_runs)} runs x {len(all_runs[0]['ours cycle'])} cycles; medians over runs (ms)")
    print(f"{'step':<10}{'tool':<30}{'median':>10}{'p99':>10}{'ratio':>10}")
    for step in ("publish", "cycle"):
        base = med(f"mount {step}")
        for tool, key in (("weightcache CSI (gRPC)", f"ours {step}"), ("mount --bind -o ro / umount", f"mount {step}")):
            print(f"{step:<10}{tool:<30}{med(key):>10.2f}{tail(key):>10.2f}{med(key) / base:>9.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_csi.py needs root (bind mounts)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    results = []
    for _ in range(args.runs):
        work = Path(tempfile.mkdtemp(prefix="wc-bench-"))
        try:
            make_model(work / "model", layers=2, hidden=64, vocab=128)
            results.append(asyncio.run(run(args.cycles, work)))
        finally:
            for entry in sorted(mounts.mount_table(), key=lambda e: -len(e.mount_point)):
                if entry.mount_point.startswith(str(work) + "/"):
                    mounts.unmount(entry.mount_point)
            if not any(e.mount_point.startswith(str(work) + "/") for e in mounts.mount_table()):
                shutil.rmtree(work, ignore_errors=True)  # never through a live bind mount
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
