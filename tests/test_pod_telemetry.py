"""A pod's cold-start stages and its engine's compile-cache result, as Events on the pod and in the daemon's
/metrics (docs/telemetry.md): a real daemon serving CSI on real mounts, the stand-in API server enforcing the
shipped RBAC and node policies for the daemon's node-bound token, and the report file a pod's engine writes (the
format weightcache_vllm.telemetry writes; tests_engines/test_vllm_compile_cache.py has a real vLLM write it)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kubernetes.client.exceptions import ApiException

from tests.fake_apiserver import FakeApiServer
from tests.fake_rules import daemon_user
from tests.fixtures_csi import publish_request, unmount_under
from tests.fixtures_daemon import eventually, start_daemon
from weightcache import engine_report
from weightcache.csi._pb import csi_pb2, csi_pb2_grpc
from weightcache.csi.engine_volumes import REPORT_BYTES
from weightcache.csi.telemetry import Pod, PodTelemetry
from weightcache.kube.client import CoreV1Api
from weightcache.vocabulary import ENGINE_CACHE_ATTRIBUTE, ENGINE_CACHE_READY, ENGINE_REPORT, REPORT_ATTRIBUTE

NODE, NS = "gpu-1", "ml"
VLLM = "vllm-0.32.0-cpu"


def report(stages: dict[str, float], **compile: Any) -> bytes:
    return json.dumps({"version": 1, "stages": stages, "compile": compile or None}).encode()


def pod_events(api: FakeApiServer) -> dict[str, dict[str, Any]]:
    return {e["reason"]: e for e in api.list("events", NS) if e["involvedObject"]["kind"] == "Pod"}


@contextlib.asynccontextmanager
async def node_of(api: FakeApiServer, short_dir: Path, model_copy: Path,
                  monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[FakeApiServer, Any, Any]]:
    """(the API server, the daemon, its CSI Node stub): a real daemon on node NODE serving CSI, its ModelCache
    granting NS the model, the stand-in API server (shipped_access: the shipped RBAC and policies) for its token."""
    csi_sock, kubelet = short_dir / "csi.sock", short_dir / "kubelet"
    api.create("nodes", {"metadata": {"name": NODE}})
    api.create("modelcaches", {"metadata": {"name": "llama"}, "spec": {"source": f"file://{model_copy}/",
                                                                      "allowedNamespaces": [NS]}})
    api.use_as_kubeconfig(short_dir, monkeypatch, api.token_for(daemon_user(NODE)))
    d = await start_daemon(short_dir, model_copy, env={"NODE_NAME": NODE}, config={
        "csiEndpoint": f"unix://{csi_sock}", "kubeletDir": str(kubelet)})
    try:
        async with grpc.aio.insecure_channel(f"unix://{csi_sock}") as channel:
            await eventually(lambda: d.daemon.node is not None and d.daemon.node.cluster.synced(),
                             what="the ModelCache watch", timeout=30)
            yield api, d, csi_pb2_grpc.NodeStub(channel)
    finally:
        await d.daemon.stop()
        unmount_under(short_dir)


def volume_target(short_dir: Path, name: str) -> Path:
    return short_dir / "kubelet" / "pods" / "uid-1" / "volumes" / "kubernetes.io~csi" / name / "mount"


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")
@pytest.mark.shipped_access
async def test_a_pods_stages_reach_its_events_and_the_metrics(
        apiserver: FakeApiServer, short_dir: Path, model_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_target, cache_target = volume_target(short_dir, "llama"), volume_target(short_dir, "wc-engine-cache")
    async with node_of(apiserver, short_dir, model_copy, monkeypatch) as (api, d, stub):
        started = time.time()
        await stub.NodePublishVolume(publish_request("vol-m", model_target, model=d.model_uri,
                                                     namespace=NS, pod_uid="uid-1"))
        await stub.NodePublishVolume(publish_request("vol-c", cache_target, model=d.model_uri, namespace=NS,
                                                     pod_uid="uid-1", readonly=False,
                                                     **{ENGINE_CACHE_ATTRIBUTE: VLLM}))
        # the pod's engine: loads, compiles into its empty cache, serves (the plugin's report)
        await asyncio.sleep(0.3)
        now = time.time()
        (cache_target / ENGINE_REPORT).write_bytes(report(
            {"weights_loaded": now - 0.2, "engine_ready": now - 0.1, "first_token": now},
            result="miss", key="ab12", dir="3f2a9c1b0d", handed=[], written=7))
        stats = csi_pb2.NodeGetVolumeStatsRequest(volume_id="vol-c", volume_path=str(cache_target))
        await stub.NodeGetVolumeStats(stats)
        want = {"ModelOnNode", "VolumePublished", "WeightsLoaded", "EngineReady", "FirstToken",
                "EngineCacheMiss"}
        events = await eventually(lambda: (e := pod_events(api)).keys() >= want and e,
                                  what="the pod's Events", timeout=30)
        await stub.NodeGetVolumeStats(stats)  # a minute later, kubelet asks again: nothing new to say
        metrics = await asyncio.to_thread(d.client.metrics)
        for reason in want:
            e = events[reason]
            assert e["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "name": "pod-uid-1",
                                           "namespace": NS, "uid": "uid-1"}
            assert e["source"]["host"] == e["reportingInstance"] == NODE and e["count"] == 1
        assert "fetched" in events["ModelOnNode"]["message"]
        assert "compiled (7 files written)" in events["EngineCacheMiss"]["message"]
        assert events["EngineCacheMiss"]["type"] == "Normal"  # nothing was handed over: a first pod
        seconds = float(events["FirstToken"]["message"].split(", ")[1].split("s after")[0])
        assert 0 < seconds <= time.time() - started
        for stage in ("model_on_node", "volume_published", "weights_loaded", "engine_ready", "first_token"):
            assert f'weightcache_coldstart_stage_seconds_count{{cache="miss",stage="{stage}"}} 1.0' in metrics
        assert f'weightcache_engine_cache_results_total{{engine="{VLLM}",result="miss"}} 1.0' in metrics
        assert api.forbidden == []  # every Event the daemon wrote passed RBAC and the events policy
        for vid, target in (("vol-c", cache_target), ("vol-m", model_target)):
            await stub.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id=vid,
                                                                              target_path=str(target)))


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")
@pytest.mark.shipped_access
async def test_a_pod_without_an_engine_cache_reports_through_its_report_volume(
        apiserver: FakeApiServer, short_dir: Path, model_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """weightcache.io/telemetry: the webhook's report volume (report: "true", writable), a bounded tmpfs: the
    engine's stages reach the pod's Events and /metrics as from an engine-cache volume, a compile result in it is
    not told (there is no cache to be hit), and the pod cannot write more than the report needs."""
    model_target, report_target = volume_target(short_dir, "llama"), volume_target(short_dir, "wc-report")
    async with node_of(apiserver, short_dir, model_copy, monkeypatch) as (api, d, stub):
        for denied in ("not-allowed", NS):  # the model it names is authorized for the pod's namespace, as a mount is
            request = publish_request("vol-r", report_target, model=d.model_uri, namespace=denied, pod_uid="uid-1",
                                      readonly=False, **{REPORT_ATTRIBUTE: "true"})
            if denied != NS:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.NodePublishVolume(request)
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
                continue
            await stub.NodePublishVolume(request)
        await stub.NodePublishVolume(publish_request("vol-m", model_target, model=d.model_uri, namespace=NS,
                                                     pod_uid="uid-1"))
        with pytest.raises(OSError) as full:  # the tmpfs's bounds: the pod gets ENOSPC, nobody else does
            (report_target / "filler").write_bytes(b"x" * (2 * REPORT_BYTES))
        assert full.value.errno == errno.ENOSPC
        (report_target / "filler").unlink()
        await asyncio.sleep(0.3)
        now = time.time()
        (report_target / ENGINE_REPORT).write_bytes(report(
            {"weights_loaded": now - 0.2, "engine_ready": now - 0.1, "first_token": now}, result="hit"))
        await stub.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(volume_id="vol-r",
                                                                        volume_path=str(report_target)))
        want = {"ModelOnNode", "VolumePublished", "WeightsLoaded", "EngineReady", "FirstToken"}
        events = await eventually(lambda: (e := pod_events(api)).keys() >= want and e,
                                  what="the pod's Events", timeout=30)
        assert "EngineCacheHit" not in events and "the pod's report" in events["FirstToken"]["message"]
        metrics = await asyncio.to_thread(d.client.metrics)
        for stage in ("weights_loaded", "engine_ready", "first_token"):
            assert f'weightcache_coldstart_stage_seconds_count{{cache="miss",stage="{stage}"}} 1.0' in metrics
        assert "weightcache_engine_cache_results_total{" not in metrics
        assert api.forbidden == []
        for vid, target in (("vol-r", report_target), ("vol-m", model_target)):
            await stub.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id=vid,
                                                                              target_path=str(target)))
        assert not report_target.exists() and not os.path.ismount(report_target.parent)
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # only a report or engine-cache volume is writable
            await stub.NodePublishVolume(publish_request("vol-w", model_target, model=d.model_uri, namespace=NS,
                                                         pod_uid="uid-1", readonly=False))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def event(source: str, kind: str = "Pod", name: str = "p") -> dict[str, Any]:
    return {"metadata": {"name": f"{name}.x{abs(hash((source, kind))) % 1000}"},
            "involvedObject": {"apiVersion": "v1", "kind": kind, "name": name,
                               **({"namespace": NS} if kind != "Node" else {})},
            "reason": "WeightsLoaded", "message": "m", "type": "Normal",
            "source": {"component": "weightcache", "host": source}, "reportingInstance": source}


@pytest.mark.shipped_access
def test_the_events_policy_confines_a_daemon_token_to_its_own_node(apiserver: FakeApiServer) -> None:
    core = CoreV1Api(apiserver.api_client(apiserver.token_for(daemon_user(NODE))))
    core.create_namespaced_event(NS, event(NODE))  # about a pod, from its own node: allowed anywhere
    core.create_namespaced_event("default", event(NODE, "Node", NODE))
    for ns, body in ((NS, event("gpu-2")),  # signed with another node's name
                     ("default", event(NODE, "Node", "gpu-2")),  # about another Node
                     (NS, {**event(NODE), "reportingInstance": "gpu-2"}),
                     (NS, event(NODE, "Secret"))):
        with pytest.raises(ApiException) as denied:
            core.create_namespaced_event(ns, body)
        assert denied.value.status == 403, body
    name = event(NODE)["metadata"]["name"]
    with pytest.raises(ApiException) as denied:  # nor re-signed by a patch
        core.patch_namespaced_event(name, NS, {"source": {"host": "gpu-2"}})
    assert denied.value.status == 403
    assert len(apiserver.forbidden) == 5


def test_a_hostile_report_costs_only_itself(tmp_path: Path) -> None:
    """The pod writes the report: a link, a FIFO, a huge or malformed file, times outside its start are not used;
    a malformed field drops only itself."""
    told: list[tuple[str, str]] = []
    seen: list[tuple[str, float, str]] = []
    clock = [1000.0]
    t = PodTelemetry(observe_stage=lambda s, sec, c: seen.append((s, sec, c)),
                     pod_event=lambda pod, reason, message, kind: told.append((reason, kind)), clock=lambda: clock[0])
    pod = Pod(NS, "p", "u")
    t.first_attempt(pod)
    secret = tmp_path / "secret"
    secret.write_bytes(report({"weights_loaded": 1001.0}))
    (tmp_path / ENGINE_REPORT).symlink_to(secret)
    clock[0] = 1010.0
    t.engine_volume(pod, VLLM, str(tmp_path), 0.0)
    assert told == []  # the link is not followed
    (tmp_path / ENGINE_REPORT).unlink()
    os.mkfifo(tmp_path / ENGINE_REPORT)
    t.engine_volume(pod, VLLM, str(tmp_path), 0.0)  # returns: a FIFO is opened without blocking, then refused
    (tmp_path / ENGINE_REPORT).unlink()
    (tmp_path / ENGINE_REPORT).write_bytes(b" " * 5000 + b"{}")
    t.engine_volume(pod, VLLM, str(tmp_path), 0.0)
    assert told == [] and seen == []
    (tmp_path / ENGINE_REPORT).write_bytes(report({"weights_loaded": 999.0, "engine_ready": "soon",
                                                   "first_token": 1004.0}, result="hit", key="../x", handed="no"))
    t.engine_volume(pod, VLLM, str(tmp_path), 0.0)
    # weights_loaded before the pod's first publish: dropped; engine_ready not a time: dropped
    assert seen == [("first_token", 4.0, "unknown")]
    assert told == [("FirstToken", "Normal"), ("EngineCacheHit", "Normal")]
    (tmp_path / ENGINE_CACHE_READY).write_bytes(b"")
    os.utime(tmp_path / ENGINE_CACHE_READY, (1003.0, 1003.0))
    t.engine_volume(pod, VLLM, str(tmp_path), 0.0)  # the startup probe's ready file says when it served
    assert seen[-1] == ("engine_ready", 3.0, "unknown") and len(told) == 3
    assert engine_report.parse(report({}, result="hit", key="../x")).compile == engine_report.CompileOutcome("hit")
    with pytest.raises(ValueError, match="not JSON"):
        engine_report.parse(b"[" * 3000)


def test_an_incompatible_cache_is_a_warning_even_when_vllm_names_no_cache_dir(tmp_path: Path) -> None:
    """vLLM's CPU build keeps its compile cache in inductor's directory alone, so the report's `handed` (vLLM's own
    torch_compile_cache dirs) is empty although a cache was handed over: incompatible is still a Warning
    (tests_engines/test_vllm_compile_cache.py found it a Normal Event from a real vLLM start)."""
    told: list[tuple[str, str]] = []
    t = PodTelemetry(pod_event=lambda pod, reason, message, kind: told.append((reason, kind)), clock=lambda: 1010.0)
    (tmp_path / ENGINE_REPORT).write_bytes(report({}, result="incompatible", key="0123456789abcdef", handed=[],
                                                  written=3))
    t.engine_volume(Pod(NS, "p", "u"), VLLM, str(tmp_path), 1000.0)
    assert told == [("EngineCacheIncompatible", "Warning")]
