#!/usr/bin/env python3
"""Benchmark: preparing a cached model for a pod through DRA (NodePrepareResources + NodeUnprepareResources over
the plugin's gRPC socket, the claim read from an API server) beside the CSI inline volume a user would otherwise
pick (NodePublishVolume + NodeUnpublishVolume over its socket: lease, record, read-only bind mount). Needs root
(the CSI side mounts).

    sudo .venv/bin/python scripts/bench_dra.py [--cycles 50] [--runs 3]

The API server is tests/fake_apiserver.py on 127.0.0.1 (a real cluster's GET adds its own network round trip).
Cycles alternate between the two paths; prints medians and p99 per step and the ratio DRA / CSI.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_csi
import grpc

from tests.fake_apiserver import FakeApiServer
from tests.sample import make_model
from weightcache.csi import mounts
from weightcache.csi._pb import csi_pb2, csi_pb2_grpc
from weightcache.csi.server import serve_csi
from weightcache.dra import DRIVER_NAME
from weightcache.dra._pb import dra_v1_pb2, dra_v1_pb2_grpc
from weightcache.dra.devices import device_name
from weightcache.dra.server import claim_reader, plugin_socket, serve_dra
from weightcache.fetch import Fetcher
from weightcache.fetch_queue import FetchQueue
from weightcache.policy import Decision
from weightcache.store import Store

NODE = "bench"


def allow(ref: object, namespace: str) -> Decision:
    return Decision(True, "bench")


async def run(cycles: int, work: Path, api: FakeApiServer) -> dict[str, list[float]]:
    store = Store(work / "store")
    snapshot = bench_csi.cache_model(store, work / "model")
    kubelet = work / "k"
    dra = await serve_dra(store=store, pool=NODE, kubelet_dir=kubelet, cdi_dir=work / "cdi", policy=allow,
                          claims=claim_reader(api.api_client()))
    fetcher = Fetcher(store)
    csi = await serve_csi(f"unix://{work}/csi.sock", store=store, fetches=FetchQueue(fetcher.ensure, store.lookup),
                          node_id=NODE, policy=allow, kubelet_dir=kubelet)
    claims = []
    run_id = uuid.uuid4().hex[:8]
    for i in range(cycles):
        name = f"c{i}-{run_id}"
        claim = api.create("resourceclaims", {"metadata": {"name": name}, "spec": {}}, "bench")
        claim["status"] = {"allocation": {"devices": {"results": [
            {"request": "model", "driver": DRIVER_NAME, "pool": NODE, "device": device_name(snapshot.id, 0)}]}}}
        meta = api.update("resourceclaims", name, claim, namespace="bench", subresource="status")["metadata"]
        claims.append(dra_v1_pb2.Claim(namespace="bench", uid=meta["uid"], name=name))
    times: dict[str, list[float]] = {k: [] for k in ("dra prepare", "dra cycle", "csi publish", "csi cycle")}
    async with grpc.aio.insecure_channel(f"unix://{plugin_socket(kubelet)}") as dra_channel, \
            grpc.aio.insecure_channel(f"unix://{work}/csi.sock") as csi_channel:
        plugin = dra_v1_pb2_grpc.DRAPluginStub(dra_channel)
        node = csi_pb2_grpc.NodeStub(csi_channel)
        await node.NodeGetInfo(csi_pb2.NodeGetInfoRequest())  # connect both before timing
        await plugin.NodeUnprepareResources(dra_v1_pb2.NodeUnprepareResourcesRequest())
        for i, claim in enumerate(claims):
            await asyncio.sleep(bench_csi.IDLE_S)
            t0 = time.perf_counter()
            answer = await plugin.NodePrepareResources(dra_v1_pb2.NodePrepareResourcesRequest(claims=[claim]))
            t1 = time.perf_counter()
            await plugin.NodeUnprepareResources(dra_v1_pb2.NodeUnprepareResourcesRequest(claims=[claim]))
            t2 = time.perf_counter()
            assert answer.claims[claim.uid].error == "", answer.claims[claim.uid].error
            times["dra prepare"].append(t1 - t0)
            times["dra cycle"].append(t2 - t0)

            target = kubelet / "pods" / f"p{i}" / "volumes" / "kubernetes.io~csi" / "m" / "mount"
            await asyncio.sleep(bench_csi.IDLE_S)
            t0 = time.perf_counter()
            await node.NodePublishVolume(bench_csi.request(f"v{i}", target))
            t1 = time.perf_counter()
            await node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id=f"v{i}",
                                                                              target_path=str(target)))
            t2 = time.perf_counter()
            times["csi publish"].append(t1 - t0)
            times["csi cycle"].append(t2 - t0)
    await dra.stop(0)
    await csi.stop(grace=None)
    store.close()
    return times


def report(all_runs: list[dict[str, list[float]]]) -> None:
    def med(key: str) -> float:
        return statistics.median(statistics.median(r[key]) for r in all_runs) * 1000

    def tail(key: str) -> float:
        return statistics.median(bench_csi.p99(r[key]) for r in all_runs) * 1000

    print(f"\n{len(all_runs)} runs x {len(all_runs[0]['dra cycle'])} cycles; medians over runs (ms)")
    print(f"{'step':<28}{'tool':<34}{'median':>9}{'p99':>9}{'ratio':>8}")
    for step, ours, theirs in (("prepare / publish", "dra prepare", "csi publish"),
                               ("whole cycle", "dra cycle", "csi cycle")):
        base = med(theirs)
        for tool, key in (("weightcache DRA (gRPC + claim GET)", ours), ("weightcache CSI (gRPC)", theirs)):
            print(f"{step:<28}{tool:<34}{med(key):>9.2f}{tail(key):>9.2f}{med(key) / base:>7.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=50)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_dra.py needs root (the CSI side bind-mounts)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    results = []
    with FakeApiServer() as api:
        for _ in range(args.runs):
            work = Path(tempfile.mkdtemp(prefix="wc-dra-"))
            try:
                make_model(work / "model", layers=2, hidden=64, vocab=128)
                results.append(asyncio.run(run(args.cycles, work, api)))
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
