#!/usr/bin/env python3
"""Benchmark: preparing a cached model for a pod through DRA (NodePrepareResources + NodeUnprepareResources over
the plugin's gRPC socket, the claim read from an API server) beside the CSI inline volume a user would otherwise
pick (NodePublishVolume + NodeUnpublishVolume over its socket: lease, record, read-only bind mount). Needs root
(the CSI side mounts).

    sudo .venv/bin/python scripts/bench_dra.py [--cycles 50] [--runs 3]

The API server is tests/fake_apiserver.py on 127.0.0.1 (a real cluster's GET adds its own network round trip).
Cycles alternate between the two paths; prints medians and p99 per step and the ratio DRA / CSI.

    .venv/bin/python scripts/bench_dra.py --binding [--runs 3] [--hidden 1024] [--layers 8]

(no root) times scale from zero on the 1.36 API: a node publishes a fetchable device `f-<model key>` for a sized
ModelCache, the scheduler's allocation of it is written to a claim, and the driver (ClaimBinder: watch, authorize,
fetch a file:// model through the fetch queue, lease) sets `weightcache.io/model-ready` on the claim's
status.devices; kubelet then prepares the claim over the plugin's socket. Prints each claim's status timeline
(allocated -> model-ready -> prepared) and the fetch rate.
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
from weightcache.access import Authority
from weightcache.csi import mounts
from weightcache.csi._pb import csi_pb2, csi_pb2_grpc
from weightcache.csi.server import serve_csi
from weightcache.dra import DRIVER_NAME
from weightcache.dra._pb import dra_v1_pb2, dra_v1_pb2_grpc
from weightcache.dra.binding import ClaimBinder
from weightcache.dra.devices import device_name
from weightcache.dra.fetchable import (
    MODEL_FAILED,
    MODEL_READY,
    SIZE_ANNOTATION,
    Fetchable,
    declared,
    fetchable_devices,
)
from weightcache.dra.fetchable import device_name as fetchable_name
from weightcache.dra.server import claim_reader, plugin_socket, serve_dra
from weightcache.dra.slices import SlicePublisher
from weightcache.fetch import Fetcher
from weightcache.fetch_queue import FetchQueue
from weightcache.store import Store
from weightcache.uri import model_key

NODE = "bench"
ALLOW = Authority()  # off-cluster: no ModelCache, undeclared models allowed


async def run(cycles: int, work: Path, api: FakeApiServer) -> dict[str, list[float]]:
    store = Store(work / "store")
    snapshot = bench_csi.cache_model(store, work / "model")
    kubelet = work / "k"
    dra = await serve_dra(store=store, pool=NODE, kubelet_dir=kubelet, cdi_dir=work / "cdi", authority=ALLOW,
                          claims=claim_reader(api.api_client()))
    fetcher = Fetcher(store)
    csi = await serve_csi(f"unix://{work}/csi.sock", store=store, fetches=FetchQueue(fetcher),
                          node_id=NODE, authority=ALLOW, kubelet_dir=kubelet)
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


def _verdict(api: FakeApiServer, name: str) -> dict[str, str] | None:
    for entry in (api.get("resourceclaims", name, "ml").get("status") or {}).get("devices") or []:
        for c in entry.get("conditions") or []:
            if c["type"] in (MODEL_READY, MODEL_FAILED) and c["status"] == "True":
                return dict(c)
    return None


async def binding_run(work: Path, api: FakeApiServer, index: int) -> dict[str, float]:
    """One claim from allocation to prepared; seconds since the allocation was written."""
    source = work / "model"
    size = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    uri = f"file://{source}/"
    caches = [{"metadata": {"name": "llama", "annotations": {SIZE_ANNOTATION: str(size)}},
               "spec": {"source": uri, "allowedNamespaces": ["ml"]}}]
    store = Store(work / f"store-{index}", budget_bytes=4 * size + (64 << 20))
    fetcher = Fetcher(store)
    queue = FetchQueue(fetcher)
    authority = Authority(model_caches=lambda: caches, allow_undeclared=lambda: False)

    def resolve(key: str) -> Fetchable | None:
        return declared(caches).get(key)

    publisher = SlicePublisher(api.api_client(), f"{NODE}-{index}", lambda: fetchable_devices(
        declared(caches).values(), held={model_key(i.snapshot.uri) for i in store.list()}))
    pool = f"{NODE}-{index}"
    api.create("nodes", {"metadata": {"name": pool}})  # the slices' owner
    binder = ClaimBinder(api.api_client(), pool=pool, store=store, authority=authority, resolve=resolve,
                         fetch=lambda grant: queue.ensure(grant, keep=True))
    kubelet_dir = work / f"k{index}"
    plugin = await serve_dra(store=store, pool=pool, kubelet_dir=kubelet_dir, cdi_dir=work / "cdi",
                             authority=authority, claims=claim_reader(api.api_client()), fetchable=resolve,
                             binder=binder)
    try:
        await asyncio.to_thread(publisher.sync)
        name = f"c{index}-{uuid.uuid4().hex[:6]}"
        claim = api.create("resourceclaims", {"metadata": {"name": name}, "spec": {"devices": {"requests": [
            {"name": "model", "exactly": {"deviceClassName": DRIVER_NAME}}]}}}, "ml")
        claim["status"] = {"allocation": {"devices": {"results": [{
            "request": "model", "driver": DRIVER_NAME, "pool": pool, "device": fetchable_name(model_key(uri)),
            "bindingConditions": [MODEL_READY], "bindingFailureConditions": [MODEL_FAILED]}]}}}
        t0 = time.perf_counter()
        meta = api.update("resourceclaims", name, claim, namespace="ml", subresource="status")["metadata"]
        while (verdict := await asyncio.to_thread(_verdict, api, name)) is None:
            await asyncio.sleep(0.002)
        t_ready = time.perf_counter() - t0
        if verdict["type"] != MODEL_READY:
            raise RuntimeError(f"claim {name}: {verdict}")
        async with grpc.aio.insecure_channel(f"unix://{plugin_socket(kubelet_dir)}") as channel:
            answer = await dra_v1_pb2_grpc.DRAPluginStub(channel).NodePrepareResources(
                dra_v1_pb2.NodePrepareResourcesRequest(claims=[dra_v1_pb2.Claim(namespace="ml", uid=meta["uid"],
                                                                                name=name)]))
        t_prepared = time.perf_counter() - t0
        assert answer.claims[meta["uid"]].error == "", answer.claims[meta["uid"]].error
        [(_, bound)] = binder.timings.items()
        return {"bytes": float(size), "model-ready": t_ready, "binder": bound, "prepared": t_prepared}
    finally:
        await plugin.stop(0)
        queue.close()
        store.close()


def binding_report(runs: list[dict[str, float]]) -> None:
    size = runs[0]["bytes"]
    print(f"\nscale from zero (1.36 binding conditions), file:// model of {size / 1e6:.1f} MB, {len(runs)} runs")
    print(f"{'run':<5}{'allocated':>10}{'model-ready':>13}{'binder':>9}{'prepared':>10}{'MB/s':>8}"
          "   (seconds after the allocation was written)")
    for i, r in enumerate(runs):
        print(f"{i:<5}{0.0:>10.3f}{r['model-ready']:>13.3f}{r['binder']:>9.3f}{r['prepared']:>10.3f}"
              f"{size / 1e6 / r['binder']:>8.1f}")
    print(f"median: model-ready {statistics.median(r['model-ready'] for r in runs):.3f} s, prepared "
          f"{statistics.median(r['prepared'] for r in runs):.3f} s; load average {os.getloadavg()[0]:.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=50)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--binding", action="store_true", help="time allocation -> model-ready -> prepared (1.36)")
    parser.add_argument("--layers", type=int, default=8, help="--binding: the model's layers")
    parser.add_argument("--hidden", type=int, default=1024, help="--binding: the model's hidden size")
    args = parser.parse_args()
    if args.binding:
        logging.basicConfig(level=logging.WARNING)
        work = Path(tempfile.mkdtemp(prefix="wc-drab-", dir="/tmp"))  # Unix socket paths are short
        try:
            make_model(work / "model", layers=args.layers, hidden=args.hidden, vocab=1024)
            with FakeApiServer() as api:
                runs = [asyncio.run(binding_run(work, api, i)) for i in range(args.runs)]
        finally:
            shutil.rmtree(work, ignore_errors=True)
        binding_report(runs)
        return 0
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
