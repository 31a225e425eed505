"""The DRAResourceHealth stream kubelet 1.34+ watches, played from kubelet's side over the plugin's real Unix
socket with stubs generated from dra/dra_health_v1alpha1.proto: a prepared claim's device is HEALTHY while its
snapshot is whole, and an update marks it UNHEALTHY when the snapshot is damaged (manifest or tree gone)."""

from __future__ import annotations

import asyncio
import shutil
import time

import grpc

from tests.fixtures_dra import NODE, DraHarness
from weightcache.dra._pb import dra_health_v1alpha1_pb2 as pb
from weightcache.dra._pb import dra_health_v1alpha1_pb2_grpc as pb_grpc
from weightcache.dra.claims import ClaimBook
from weightcache.dra.health import DeviceHealth


def _states(message: pb.NodeWatchResourcesResponse) -> dict[str, int]:
    assert {d.device.pool_name for d in message.devices} <= {NODE}
    assert all(d.last_updated_time > 0 for d in message.devices)
    return {d.device.device_name: d.health for d in message.devices}


async def test_kubelet_watches_health_over_the_plugin_socket(dra: DraHarness) -> None:
    await dra.kubelet.register()
    a, b = dra.snapshots
    claim = dra.allocate("ml", "c1", [dra.device(a), dra.device(b, 1)])
    assert (await dra.kubelet.prepare(claim)).claims[claim["metadata"]["uid"]].error == ""
    async with grpc.aio.insecure_channel(f"unix://{dra.kubelet.endpoint}") as channel:
        stream = pb_grpc.DRAResourceHealthStub(channel).NodeWatchResources(pb.NodeWatchResourcesRequest())
        start = time.perf_counter()
        first = await asyncio.wait_for(stream.read(), 10)
        print(f"first health list after {1000 * (time.perf_counter() - start):.1f} ms")
        assert _states(first) == {f"m-{a.id}-0": pb.HEALTHY, f"m-{b.id}-1": pb.HEALTHY}

        shutil.rmtree(dra.store.layout.snapshot(b.id), ignore_errors=True)  # a damaged tree
        if dra.store.layout.snapshot(b.id).exists():  # read-only directories: remove the manifest instead
            dra.store.layout.manifest(b.id).unlink()
        start = time.perf_counter()
        update = await asyncio.wait_for(stream.read(), 10)
        print(f"unhealthy update after {1000 * (time.perf_counter() - start):.1f} ms")
        assert _states(update) == {f"m-{a.id}-0": pb.HEALTHY, f"m-{b.id}-1": pb.UNHEALTHY}
        stream.cancel()

    assert (await dra.kubelet.unprepare(claim)).claims[claim["metadata"]["uid"]].error == ""


def test_published_devices_are_reported_and_evicted_ones_go_unhealthy(dra: DraHarness) -> None:
    a, b = dra.snapshots
    names = [f"m-{a.id}-0", f"m-{b.id}-0", "planted-not-ours"]
    health = DeviceHealth(dra.store, ClaimBook(dra.store.layout.tree), published=lambda: names)
    first = health.check()
    assert {n: h for n, (h, _) in first.items()} == {names[0]: pb.HEALTHY, names[1]: pb.HEALTHY}
    dra.store.evict(b.id)
    after = health.check()
    assert after[names[1]][0] == pb.UNHEALTHY and after[names[0]] == first[names[0]]  # unchanged: same timestamp
