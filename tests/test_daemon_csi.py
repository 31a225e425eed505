"""The daemon hosts the CSI plugin on its own socket, sharing store, single flight, leases, policy and metrics."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.faultproxy import FaultProxy
from tests.fixtures_csi import publish_request, unmount_under
from tests.fixtures_daemon import start_daemon
from tests.fixtures_s3 import S3
from weightcache.csi._pb import csi_pb2, csi_pb2_grpc
from weightcache.uri import parse_ref


async def test_csi_identity_and_node_info_then_the_socket_goes_on_stop(short_dir: Path, model_copy: Path) -> None:
    csi_sock = short_dir / "csi" / "csi.sock"
    d = await start_daemon(short_dir, model_copy, config={"csiEndpoint": f"unix://{csi_sock}"},
                           env={"NODE_NAME": "gpu-7"})
    try:
        async with grpc.aio.insecure_channel(f"unix://{csi_sock}") as channel:
            info = await csi_pb2_grpc.IdentityStub(channel).GetPluginInfo(csi_pb2.GetPluginInfoRequest())
            node = await csi_pb2_grpc.NodeStub(channel).NodeGetInfo(csi_pb2.NodeGetInfoRequest())
        assert info.name == "csi.weightcache.io" and node.node_id == "gpu-7"
    finally:
        await d.daemon.stop()
    assert not csi_sock.exists() and not d.socket.exists()


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")
async def test_a_csi_publish_shows_up_as_a_lease_in_the_daemon_api(short_dir: Path, model_copy: Path) -> None:
    csi_sock, kubelet = short_dir / "csi.sock", short_dir / "kubelet"
    d = await start_daemon(short_dir, model_copy, config={"csiEndpoint": f"unix://{csi_sock}",
                                                          "kubeletDir": str(kubelet),
                                                          # pods get a file:// model only where it is declared
                                                          "models": [{"source": f"file://{model_copy}/",
                                                                      "pin": False}]},
                           env={"NODE_NAME": "n"})
    target = kubelet / "pods" / "uid-1" / "volumes" / "kubernetes.io~csi" / "llama" / "mount"
    try:
        async with grpc.aio.insecure_channel(f"unix://{csi_sock}") as channel:
            stub = csi_pb2_grpc.NodeStub(channel)
            await stub.NodePublishVolume(publish_request("vol-1", target, model=d.model_uri, namespace="ml",
                                                         pod_uid="uid-1"))
            assert (target / "config.json").read_bytes() == (model_copy / "config.json").read_bytes()
            ((holder, snapshot_id),) = (await asyncio.to_thread(d.client.leases)).items()
            async with d.http() as http, http.delete(f"/v1/models/{snapshot_id}") as r:
                assert r.status == 409 and (await r.json())["holders"] == [holder]
            async with d.http() as http, http.delete(f"/v1/leases/{holder}") as r:  # the pod's floor stays
                body = await r.json()
                assert r.status == 409 and "pod ml/pod-uid-1" in body["message"], body
            assert holder in await asyncio.to_thread(d.client.leases)
            with pytest.raises(grpc.aio.AioRpcError) as err:  # an error, counted by its code
                await stub.NodePublishVolume(publish_request("vol-2", short_dir / "etc", model=d.model_uri,
                                                             namespace="ml"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            metrics = await asyncio.to_thread(d.client.metrics)
            assert 'weightcache_cache_misses_total{scheme="file"} 1.0' in metrics  # CSI's fetch, daemon's metrics
            assert 'weightcache_csi_request_duration_seconds_count{method="NodePublishVolume"} 2.0' in metrics
            assert ('weightcache_csi_errors_total{code="INVALID_ARGUMENT",method="NodePublishVolume"} 1.0'
                    in metrics)
            assert "weightcache_fetches_queued 0.0" in metrics
            assert re.search(r'weightcache_build_info\{python="[0-9.]+",version="[^"]+"\} 1\.0', metrics)
            await stub.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id="vol-1",
                                                                              target_path=str(target)))
        assert await asyncio.to_thread(d.client.leases) == {}
    finally:
        await d.daemon.stop()
        unmount_under(short_dir)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")
async def test_reconcile_the_api_and_csi_share_one_download(short_dir: Path, model_copy: Path, s3: S3,
                                                            fault_proxy: FaultProxy) -> None:
    s3.upload_dir(model_copy, "models", "shared/")
    uri = "s3://models/shared/"
    fault_proxy.add("delay", seconds=1.0, method="GET", path=".safetensors", count=-1)
    csi_sock, kubelet = short_dir / "csi.sock", short_dir / "kubelet"
    d = await start_daemon(short_dir, model_copy, env={"NODE_NAME": "n"}, config={
        "csiEndpoint": f"unix://{csi_sock}", "kubeletDir": str(kubelet), "models": [{"source": uri}],
        "endpoints": {"s3": {"endpointUrl": fault_proxy.endpoint_url}}})
    target = kubelet / "pods" / "uid-1" / "volumes" / "kubernetes.io~csi" / "llama" / "mount"
    try:
        while not fault_proxy.requests_for("GET", ".safetensors"):  # reconcile (keep-warm) started the fetch
            await asyncio.sleep(0.02)
        async with grpc.aio.insecure_channel(f"unix://{csi_sock}") as channel:
            publish = csi_pb2_grpc.NodeStub(channel).NodePublishVolume(
                publish_request("vol-1", target, model=uri, namespace="ml", pod_uid="uid-1"), timeout=60)
            api = asyncio.to_thread(d.client.ensure, uri)
            _, snapshot = await asyncio.gather(publish, api)
            assert (target / "config.json").read_bytes() == (model_copy / "config.json").read_bytes()
            weights = [r.path for r in fault_proxy.requests_for("GET", ".safetensors")]
            assert weights and len(weights) == len(set(weights)), "one download for the three callers"
            assert snapshot["id"] in (await asyncio.to_thread(d.client.leases)).values()
            await csi_pb2_grpc.NodeStub(channel).NodeUnpublishVolume(
                csi_pb2.NodeUnpublishVolumeRequest(volume_id="vol-1", target_path=str(target)))
    finally:
        await d.daemon.stop()
        unmount_under(short_dir)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")
async def test_csi_answers_while_the_api_queues_eight_slow_downloads(short_dir: Path, model_copy: Path, s3: S3,
                                                                     fault_proxy: FaultProxy) -> None:
    for prefix in ["warm/"] + [f"slow-{i}/" for i in range(8)]:
        s3.upload_dir(model_copy, "models", prefix)
    csi_sock, kubelet = short_dir / "csi.sock", short_dir / "kubelet"
    d = await start_daemon(short_dir, model_copy, env={"NODE_NAME": "n"}, config={
        "csiEndpoint": f"unix://{csi_sock}", "kubeletDir": str(kubelet), "parallelModels": 2,
        "endpoints": {"s3": {"endpointUrl": fault_proxy.endpoint_url}}})
    target = kubelet / "pods" / "uid-1" / "volumes" / "kubernetes.io~csi" / "llama" / "mount"
    try:
        await asyncio.to_thread(d.client.ensure, "s3://models/warm/")
        held = fault_proxy.add("hold", method="GET", path="/slow-", count=-1)  # released once CSI has answered
        async with d.http() as http:
            for i in range(8):
                async with http.put("/v1/models", json={"uri": f"s3://models/slow-{i}/"}) as r:
                    assert r.status == 202
        while len({r.path.split("/")[2] for r in fault_proxy.requests_for("GET", "/slow-")}) < 2:
            await asyncio.sleep(0.02)
        metrics = await asyncio.to_thread(d.client.metrics)
        assert "weightcache_fetches_queued 6.0" in metrics, "parallelModels=2 run, the other 6 wait their turn"
        async with grpc.aio.insecure_channel(f"unix://{csi_sock}") as channel:
            identity, node = csi_pb2_grpc.IdentityStub(channel), csi_pb2_grpc.NodeStub(channel)
            # each answers while every download is held (one queued behind them never would: the bound turns
            # that hang into a failure, it is no speed requirement)
            start = time.monotonic()
            for _ in range(3):
                await asyncio.wait_for(identity.Probe(csi_pb2.ProbeRequest()), 30)
            probe = (time.monotonic() - start) / 3
            start = time.monotonic()
            await asyncio.wait_for(node.NodePublishVolume(publish_request(
                "vol-w", target, model="s3://models/warm/", namespace="ml", pod_uid="uid-1")), 30)
            publish = time.monotonic() - start
            print(f"\nAPI queue 2 running + 6 queued: Probe {probe * 1000:.1f} ms, cached publish "
                  f"{publish * 1000:.1f} ms")
            assert "weightcache_fetches_queued 6.0" in await asyncio.to_thread(d.client.metrics), "still held"
            held.release.set()
            await node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id="vol-w",
                                                                              target_path=str(target)))
    finally:
        for fault in fault_proxy.faults:  # a failure above: nothing stays held
            fault.release.set()
        await d.daemon.stop()
        unmount_under(short_dir)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")
async def test_cold_start_stages_of_a_cold_and_a_cached_publish_reach_metrics_and_the_log(
        short_dir: Path, model_copy: Path, s3: S3, fault_proxy: FaultProxy, caplog: pytest.LogCaptureFixture) -> None:
    """A cold model's wait counts from kubelet's first publish across its retries; the hit's is milliseconds."""
    s3.upload_dir(model_copy, "models", "stages/")
    uri = "s3://models/stages/"
    fault_proxy.add("delay", seconds=1.0, method="GET", path=".safetensors", count=-1)
    csi_sock, kubelet = short_dir / "csi.sock", short_dir / "kubelet"
    d = await start_daemon(short_dir, model_copy, env={"NODE_NAME": "n"}, config={
        "csiEndpoint": f"unix://{csi_sock}", "kubeletDir": str(kubelet),
        "endpoints": {"s3": {"endpointUrl": fault_proxy.endpoint_url}}})
    targets = {uid: kubelet / "pods" / uid / "volumes" / "kubernetes.io~csi" / "llama" / "mount"
               for uid in ("uid-1", "uid-2")}
    try:
        async with grpc.aio.insecure_channel(f"unix://{csi_sock}") as channel:
            stub = csi_pb2_grpc.NodeStub(channel)
            with caplog.at_level(logging.INFO, logger="weightcache.csi.node"):
                cold = publish_request("vol-1", targets["uid-1"], model=uri, namespace="ml", pod_uid="uid-1",
                                       timeout="0.3s")  # each attempt waits 0.3 s, as kubelet's would its 2 min
                attempts = 0
                while True:
                    attempts += 1
                    try:
                        await stub.NodePublishVolume(cold)
                        break
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code() == grpc.StatusCode.UNAVAILABLE and attempts < 40, exc
                await stub.NodePublishVolume(publish_request("vol-2", targets["uid-2"], model=uri, namespace="ml",
                                                             pod_uid="uid-2"))
            metrics = await asyncio.to_thread(d.client.metrics)
            for volume_id, uid in (("vol-1", "uid-1"), ("vol-2", "uid-2")):
                await stub.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
                    volume_id=volume_id, target_path=str(targets[uid])))
        assert attempts > 1, "the cold publish was retried (kubelet's UNAVAILABLE loop)"
        (family,) = [f for f in text_string_to_metric_families(metrics)
                     if f.name == "weightcache_coldstart_stage_seconds"]
        seen = {(s.name.rsplit("_", 1)[1], s.labels["stage"], s.labels["cache"]): s.value for s in family.samples
                if not s.name.endswith("_bucket")}
        for cache in ("miss", "hit"):
            assert seen[("count", "model_on_node", cache)] == seen[("count", "volume_published", cache)] == 1.0
            assert seen[("sum", "volume_published", cache)] >= seen[("sum", "model_on_node", cache)]
        # the miss spans all its attempts (one 1 s delayed GET at least), not the last 0.3 s one
        assert seen[("sum", "model_on_node", "miss")] >= 1.0
        assert seen[("sum", "model_on_node", "hit")] < 0.5 * seen[("sum", "model_on_node", "miss")]
        assert "pod-uid" not in metrics  # pods are never labels
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("published pod=")]
        key = parse_ref(uri).key
        for uid, cache in (("uid-1", "miss"), ("uid-2", "hit")):
            (line,) = [line for line in lines if f"pod=ml/pod-{uid} " in line]
            assert f"key={key} " in line and f"cache={cache} " in line, line
            assert re.search(r" model_on_node=\d+\.\d{3}s volume_published=\d+\.\d{3}s ", line), line
    finally:
        await d.daemon.stop()
        unmount_under(short_dir)
