#!/usr/bin/env python3
"""Benchmark: NodePublishVolume + NodeUnpublishVolume of a cached model over the real gRPC socket, against what a
user would otherwise script (`mount --bind -o ro SNAPSHOT TARGET` + `umount TARGET`), on an idle node and on a
busy one (--busy N slow downloads held open by a fault proxy in front of a local moto S3, as pods on a cold node
would start them). Needs root.

    sudo .venv/bin/python scripts/bench_csi.py [--cycles 100] [--busy 8]

Cycles alternate between the two tools, with the same idle pause before each, and a CSI Probe (the liveness
probe's call) before each; prints medians and p99 of Probe, of the publish step and of the whole cycle, idle and
busy, and the ratio busy / plain mount. Targets: publish median < 50 ms; busy: Probe < 1 s, publish < 100 ms.
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

import grpc

from tests.sample import make_model
from weightcache.csi import mounts
from weightcache.csi._pb import csi_pb2, csi_pb2_grpc
from weightcache.csi.server import serve_csi
from weightcache.fetch import Fetcher
from weightcache.fetch_queue import FetchQueue
from weightcache.policy import Decision
from weightcache.store import FileEntry, Snapshot, Store
from weightcache.uri import parse_ref

URI = "s3://models/bench/"
IDLE_S = 0.005
HOLD_S = 8.0  # each slow download's requests are held this long (under the source's 10 s read timeout)


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


def target_of(work: Path, pod: str) -> Path:
    return work / "kubelet" / "pods" / pod / "volumes" / "kubernetes.io~csi" / "model" / "mount"


def request(volume_id: str, target: Path, uri: str = URI) -> csi_pb2.NodePublishVolumeRequest:
    mode = csi_pb2.VolumeCapability.AccessMode(mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER)
    return csi_pb2.NodePublishVolumeRequest(
        volume_id=volume_id, target_path=str(target), readonly=True,
        volume_capability=csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(), access_mode=mode),
        volume_context={"model": uri, "csi.storage.k8s.io/pod.namespace": "bench",
                        "csi.storage.k8s.io/pod.name": "bench", "csi.storage.k8s.io/pod.uid": volume_id})


class SlowOrigin:
    """moto S3 on 127.0.0.1 behind a fault proxy that holds every weight request HOLD_S seconds."""

    def __init__(self, model: Path, count: int) -> None:
        import boto3
        from moto.server import ThreadedMotoServer

        from tests.faultproxy import FaultProxy

        for name, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                            "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull,
                            "AWS_SHARED_CREDENTIALS_FILE": os.devnull}.items():
            os.environ[name] = value
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        client = boto3.client("s3", endpoint_url=f"http://{host}:{port}")
        client.create_bucket(Bucket="models")
        for i in range(count):
            for path in sorted(p for p in model.rglob("*") if p.is_file()):
                client.put_object(Bucket="models", Key=f"slow-{i}/{path.relative_to(model).as_posix()}",
                                  Body=path.read_bytes())
        self.uris = [f"s3://models/slow-{i}/" for i in range(count)]
        self.proxy = FaultProxy(f"http://{host}:{port}")
        self.proxy.add("delay", method="GET", path=".safetensors", seconds=HOLD_S, count=-1)

    def held(self) -> int:
        """How many of the models have a weight request held open now."""
        return len({r.path.split("/")[2] for r in self.proxy.requests_for("GET", ".safetensors")})

    def close(self) -> None:
        self.proxy.close()
        self.server.stop()


async def run(cycles: int, work: Path, busy: int) -> dict[str, list[float]]:
    store = Store(work / "store")
    snapshot = cache_model(store, work / "model")
    origin = SlowOrigin(work / "model", busy) if busy else None
    fetcher = Fetcher(store, endpoint_url=origin.proxy.endpoint_url if origin else None)
    fetches = FetchQueue(fetcher, parallel=max(2, busy))
    server = await serve_csi(f"unix://{work}/csi.sock", store=store, fetches=fetches, node_id="bench",
                             policy=lambda ref, ns: Decision(True, "bench"), kubelet_dir=work / "kubelet")
    keys = ("ours probe", "ours publish", "ours cycle", "mount publish", "mount cycle")
    times: dict[str, list[float]] = {k: [] for k in keys}
    async with grpc.aio.insecure_channel(f"unix://{work}/csi.sock") as channel:
        node, identity = csi_pb2_grpc.NodeStub(channel), csi_pb2_grpc.IdentityStub(channel)
        await node.NodeGetInfo(csi_pb2.NodeGetInfoRequest())  # connect before timing
        cold = [asyncio.ensure_future(node.NodePublishVolume(request(f"cold{i}", target_of(work, f"cold{i}"), uri)))
                for i, uri in enumerate(origin.uris if origin else [])]
        while origin is not None and origin.held() < busy:  # every download has a request held open
            await asyncio.sleep(0.01)
        started = time.perf_counter()
        for i in range(cycles):
            target = target_of(work, f"p{i}")
            await asyncio.sleep(IDLE_S)
            t0 = time.perf_counter()
            await identity.Probe(csi_pb2.ProbeRequest())
            times["ours probe"].append(time.perf_counter() - t0)
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
        if origin is not None and time.perf_counter() - started > HOLD_S:
            print(f"warning: the cycles outlasted the held downloads ({HOLD_S:.0f} s); use fewer --cycles",
                  file=sys.stderr)
        await asyncio.gather(*cold, return_exceptions=True)
    await server.stop(grace=None)
    fetches.close()
    if origin is not None:
        origin.close()
    store.close()
    return times


def p99(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.99 * len(values)) - 1)]


def report(runs: dict[str, list[dict[str, list[float]]]], busy: int) -> None:
    def med(node: str, key: str) -> float:
        return statistics.median(statistics.median(r[key]) for r in runs[node]) * 1000

    def tail(node: str, key: str) -> float:
        return statistics.median(p99(r[key]) for r in runs[node]) * 1000

    first = runs["idle"][0]
    print(f"\n{len(runs['idle'])} runs x {len(first['ours cycle'])} cycles per node state; medians over runs (ms); "
          f"busy = {busy} downloads held open")
    print(f"{'step':<9}{'tool':<30}{'node':<6}{'median':>9}{'p99':>9}{'ratio to mount':>16}")
    for step in ("probe", "publish", "cycle"):
        base = med("idle", f"mount {step}") if step != "probe" else None
        rows = [(t, n, f"ours {step}") for n in runs for t in ("weightcache CSI (gRPC)",)]
        if base is not None:
            rows.append(("mount --bind -o ro / umount", "idle", f"mount {step}"))
        for tool, node, key in rows:
            ratio = f"{med(node, key) / base:.2f}x" if base else "-"
            print(f"{step:<9}{tool:<30}{node:<6}{med(node, key):>9.2f}{tail(node, key):>9.2f}{ratio:>16}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--busy", type=int, default=8, help="slow downloads held open in the busy runs (0: none)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_csi.py needs root (bind mounts)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    results: dict[str, list[dict[str, list[float]]]] = {"idle": [], "busy": []} if args.busy else {"idle": []}
    for _, state in ((r, s) for r in range(args.runs) for s in results):
        work = Path(tempfile.mkdtemp(prefix="wc-bench-"))
        try:
            make_model(work / "model", layers=2, hidden=64, vocab=128)
            results[state].append(asyncio.run(run(args.cycles, work, args.busy if state == "busy" else 0)))
        finally:
            for entry in sorted(mounts.mount_table(), key=lambda e: -len(e.mount_point)):
                if entry.mount_point.startswith(str(work) + "/"):
                    mounts.unmount(entry.mount_point)
            if not any(e.mount_point.startswith(str(work) + "/") for e in mounts.mount_table()):
                shutil.rmtree(work, ignore_errors=True)  # never through a live bind mount
    report(results, args.busy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
