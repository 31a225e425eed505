"""CSI fixtures: a real grpc.aio CSI server on a Unix socket in a temp dir, over a real Store and Fetcher that
read a small model from the moto S3 server (through the fault proxy, so a test can slow or count downloads).

    async def test_x(csi):
        await csi.node.NodePublishVolume(csi.publish_request("vol-1"))
        assert (csi.target("vol-1") / "config.json").exists()

Teardown unmounts everything under the temp dir before pytest may delete it: deleting a directory that still
holds a bind mount would delete the cache through it.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.faultproxy import FaultProxy
from tests.fixtures_s3 import S3
from tests.sample import make_model
from weightcache import engine_cache
from weightcache.access import Authority
from weightcache.csi import mounts
from weightcache.csi._pb import csi_pb2, csi_pb2_grpc
from weightcache.csi.node import CSI_TIMEOUT_S
from weightcache.csi.server import serve_csi
from weightcache.fetch import Fetcher
from weightcache.fetch_queue import FetchQueue
from weightcache.memory import MemoryTier
from weightcache.store import Store

ROOT_MARKS = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root (run the suite as root)")]


def needs_root(test: Any) -> Any:
    """Mark a test `root` and skip it, with the reason, when not running as root."""
    for mark in ROOT_MARKS:
        test = mark(test)
    return test

MODEL_URI = "s3://models/llama/"
ALLOWED_NS = "ml"
OTHER_NS = "team-b"  # a second namespace granted the model (engine caches: never served across namespaces)
SINGLE_NODE_WRITER = csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER


async def status_of(call: Awaitable[Any]) -> tuple[grpc.StatusCode, str]:
    """The status code and details a CSI call answers (OK, "" on success)."""
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def mounts_seen_from(root: Path) -> list[mounts.MountEntry]:
    """The mount table less other xdist workers' test mounts: each worker mounts under its own popen-gw<N> temp
    dir, and a test asserting "nothing was mounted anywhere" must not see a neighbour's tmpfs come and go."""
    worker = next((p for p in (root.resolve(), *root.resolve().parents) if p.name.startswith("popen-gw")), None)
    if worker is None:
        return mounts.mount_table()
    # workers' base temp dirs need not share a parent (pytest-343/popen-gw0 beside pytest-344/popen-gw1)
    mine = str(worker) + "/"
    return [e for e in mounts.mount_table() if "/popen-gw" not in e.mount_point or e.mount_point.startswith(mine)]


def unmount_under(root: Path) -> None:
    """Unmount every mount point below `root`, deepest first; fail loudly if one stays."""
    prefix = str(root.resolve()) + "/"
    for entry in sorted(mounts.mount_table(), key=lambda e: -len(e.mount_point)):
        if entry.mount_point.startswith(prefix):
            mounts.unmount(entry.mount_point)
    left = [e.mount_point for e in mounts.mount_table() if e.mount_point.startswith(prefix)]
    assert not left, f"mounts left under {root}: {left}"


@pytest.fixture
def safe_tmp(tmp_path: Path) -> Iterator[Path]:
    """tmp_path, but with every mount under it removed at teardown."""
    try:
        yield tmp_path
    finally:
        unmount_under(tmp_path)


@pytest.fixture
def model_in_s3(s3: S3, tmp_path: Path) -> str:
    make_model(tmp_path / "src", layers=2, hidden=64, vocab=128)
    s3.upload_dir(tmp_path / "src", "models", "llama/")
    return MODEL_URI


def policy_for(uri: str) -> Authority:
    """In cluster: one ModelCache grants `uri` to ALLOWED_NS, nothing undeclared."""
    caches = [{"metadata": {"name": "llama"}, "spec": {"source": uri, "allowedNamespaces": [ALLOWED_NS]}}]
    return Authority(model_caches=lambda: caches, allow_undeclared=lambda: False)


def bind_readonly(source: str | os.PathLike[str], target: str | os.PathLike[str], **how: Any) -> mounts.MountEntry:
    """`mounts.bind_readonly_at` for a plain path: `target` and its parents are made when missing."""
    path = os.path.abspath(target)
    os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
    parent = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return mounts.bind_readonly_at(source, parent, os.path.basename(path), path, **how)
    finally:
        os.close(parent)


@dataclass
class CsiHarness:
    root: Path  # temp dir holding store, kubelet dir and socket
    store: Store
    fetcher: Fetcher
    fetches: FetchQueue
    server: grpc.aio.Server
    channel: grpc.aio.Channel
    identity: csi_pb2_grpc.IdentityStub
    node: csi_pb2_grpc.NodeStub
    proxy: FaultProxy

    @property
    def kubelet_dir(self) -> Path:
        return self.root / "kubelet"

    def target(self, volume_id: str) -> Path:
        """Where kubelet would publish an inline volume (pod uid = volume id, for the test)."""
        return self.kubelet_dir / "pods" / volume_id / "volumes" / "kubernetes.io~csi" / "llama" / "mount"

    def publish_request(self, volume_id: str, *, model: str = MODEL_URI, namespace: str = ALLOWED_NS,
                        readonly: bool = True, **attrs: str) -> csi_pb2.NodePublishVolumeRequest:
        return publish_request(volume_id, self.target(volume_id), model=model, namespace=namespace,
                               readonly=readonly, pod_uid=volume_id, **attrs)

    def unpublish_request(self, volume_id: str) -> csi_pb2.NodeUnpublishVolumeRequest:
        return csi_pb2.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=str(self.target(volume_id)))

    def weight_gets(self) -> list[str]:
        """Paths of the GET requests for weight files that reached S3 (one download: one per small shard)."""
        return [r.path for r in self.proxy.requests_for("GET") if r.path.endswith(".safetensors")]


def publish_request(volume_id: str, target: Path, *, model: str = MODEL_URI, namespace: str = ALLOWED_NS,
                    readonly: bool = True, pod_uid: str = "uid", **attrs: str) -> csi_pb2.NodePublishVolumeRequest:
    """A NodePublishVolume exactly as kubelet sends it for an inline volume with podInfoOnMount."""
    context = {"model": model, **attrs, "csi.storage.k8s.io/pod.namespace": namespace,
               "csi.storage.k8s.io/pod.name": f"pod-{pod_uid}", "csi.storage.k8s.io/pod.uid": pod_uid,
               "csi.storage.k8s.io/serviceAccount.name": "default", "csi.storage.k8s.io/ephemeral": "true"}
    capability = csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(),
                                          access_mode=csi_pb2.VolumeCapability.AccessMode(mode=SINGLE_NODE_WRITER))
    return csi_pb2.NodePublishVolumeRequest(volume_id=volume_id, target_path=str(target), volume_capability=capability,
                                            readonly=readonly, volume_context=context)


async def start_harness(root: Path, proxy: FaultProxy, *, publish_timeout: float = CSI_TIMEOUT_S,
                        tier: MemoryTier | None = None, parallel: int = 2,
                        authority: Authority | None = None,
                        engine_limits: engine_cache.EngineCacheLimits | None = None) -> CsiHarness:
    store = Store(root / "store")
    fetcher = Fetcher(store, endpoint_url=proxy.endpoint_url)
    fetches = FetchQueue(fetcher, parallel=parallel)
    socket = root / "csi.sock"
    server = await serve_csi(f"unix://{socket}", store=store, fetches=fetches, node_id="node-a",
                             authority=authority or policy_for(MODEL_URI), publish_timeout=publish_timeout,
                             kubelet_dir=root / "kubelet", tier=tier, engine_limits=engine_limits)
    channel = grpc.aio.insecure_channel(f"unix://{socket}")
    return CsiHarness(root, store, fetcher, fetches, server, channel, csi_pb2_grpc.IdentityStub(channel),
                      csi_pb2_grpc.NodeStub(channel), proxy)


async def stop_harness(h: CsiHarness) -> None:
    await h.channel.close()
    await h.server.stop(grace=None)
    h.fetches.close()
    h.fetcher.close()
    h.store.close()


async def two_namespaces(root: Path, proxy: FaultProxy,
                         engine_limits: engine_cache.EngineCacheLimits | None = None) -> CsiHarness:
    """The CSI harness with the model granted to ALLOWED_NS and OTHER_NS through a ModelCache."""
    caches = [{"metadata": {"name": "llama"}, "spec": {"source": MODEL_URI, "allowedNamespaces": [ALLOWED_NS,
                                                                                                   OTHER_NS]}}]
    return await start_harness(root, proxy, engine_limits=engine_limits,
                               authority=Authority(model_caches=lambda: caches, allow_undeclared=lambda: False))


@pytest.fixture
async def ec(safe_tmp: Path, model_in_s3: str, fault_proxy: FaultProxy) -> AsyncIterator[CsiHarness]:
    """`two_namespaces`, for the engine-cache tests."""
    harness = await two_namespaces(safe_tmp, fault_proxy)
    try:
        yield harness
    finally:
        await stop_harness(harness)


@pytest.fixture
async def csi(safe_tmp: Path, model_in_s3: str, fault_proxy: FaultProxy) -> AsyncIterator[CsiHarness]:
    harness = await start_harness(safe_tmp, fault_proxy)
    try:
        yield harness
    finally:
        await stop_harness(harness)
