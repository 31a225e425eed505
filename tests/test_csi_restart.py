"""The plugin killed (SIGKILL) with volumes mounted, the node drifting meanwhile, then restarted: leases are
reconciled against the kernel's mount table, and kubelet's calls keep working."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.faultproxy import FaultProxy
from tests.fixtures_csi import ROOT_MARKS, model_in_s3, publish_request, safe_tmp  # noqa: F401
from tests.fixtures_s3 import fault_proxy, s3, s3_server  # noqa: F401
from weightcache.csi import mounts
from weightcache.csi._pb import csi_pb2, csi_pb2_grpc
from weightcache.csi.reconcile import VolumeBook, kubelet_volume_id
from weightcache.store import Store

pytestmark = ROOT_MARKS
ROOT = Path(__file__).resolve().parent.parent


class Plugin:
    """`python -m weightcache.csi.server` as a separate process, as the DaemonSet runs it."""

    def __init__(self, tmp: Path, proxy: FaultProxy) -> None:
        self.socket = tmp / "csi.sock"
        env = {**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint_url, "NODE_NAME": "node-a",
               "PYTHONPATH": str(ROOT)}
        with open(tmp / "plugin.log", "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "weightcache.csi.server", "--root", str(tmp / "store"),
                 "--endpoint", f"unix://{self.socket}", "--kubelet-dir", str(tmp / "kubelet"), "--allow-undeclared"],
                env=env, stdout=subprocess.DEVNULL, stderr=log)

    async def connect(self) -> tuple[grpc.aio.Channel, csi_pb2_grpc.NodeStub]:
        channel = grpc.aio.insecure_channel(f"unix://{self.socket}")
        await asyncio.wait_for(channel.channel_ready(), 30)  # gRPC's own connect-and-retry, no sleeps
        ready = await csi_pb2_grpc.IdentityStub(channel).Probe(csi_pb2.ProbeRequest(), wait_for_ready=True)
        assert ready.ready.value
        return channel, csi_pb2_grpc.NodeStub(channel)

    def kill(self, sig: int) -> None:
        self.proc.send_signal(sig)
        self.proc.wait(timeout=30)


@pytest.fixture
def plugins(safe_tmp: Path, model_in_s3: str, fault_proxy: FaultProxy) -> Iterator[list[Plugin]]:
    started: list[Plugin] = []
    try:
        yield started
    finally:
        for p in started:
            if p.proc.poll() is None:
                p.kill(signal.SIGKILL)


def target_of(tmp: Path, pod_uid: str) -> Path:
    return tmp / "kubelet" / "pods" / pod_uid / "volumes" / "kubernetes.io~csi" / "llama" / "mount"


async def test_killed_plugin_restarts_and_reconciles_leases_with_mounts(
        safe_tmp: Path, fault_proxy: FaultProxy, plugins: list[Plugin]) -> None:
    pods = {uid: kubelet_volume_id(str(target_of(safe_tmp, uid))) for uid in ("pod-a", "pod-b", "pod-c")}
    plugins.append(Plugin(safe_tmp, fault_proxy))
    channel, node = await plugins[0].connect()
    for uid, vid in pods.items():
        await node.NodePublishVolume(publish_request(vid, target_of(safe_tmp, uid), pod_uid=uid))
    await channel.close()
    plugins[0].kill(signal.SIGKILL)

    # drift while the plugin is down: pod-b's mount vanished; pod-c's lease and record were lost; a stray lease
    store = Store(safe_tmp / "store", recover=False)
    mounts.unmount(target_of(safe_tmp, "pod-b"))
    store.release(f"csi:{pods['pod-c']}")
    VolumeBook(store.root).remove(pods["pod-c"])
    snapshot_id = store.list()[0].snapshot.id
    store.lease("csi:ghost", snapshot_id)

    plugins.append(Plugin(safe_tmp, fault_proxy))
    channel, node = await plugins[1].connect()
    assert store.leases() == {f"csi:{pods['pod-a']}": snapshot_id, f"csi:{pods['pod-c']}": snapshot_id}
    adopted = VolumeBook(store.root).get(pods["pod-c"])
    assert adopted is not None and adopted.pod_uid == "pod-c"

    # kubelet carries on: a publish retry for pod-a is OK, pod-b is published again, all unpublish cleanly
    await node.NodePublishVolume(publish_request(pods["pod-a"], target_of(safe_tmp, "pod-a"), pod_uid="pod-a"))
    await node.NodePublishVolume(publish_request(pods["pod-b"], target_of(safe_tmp, "pod-b"), pod_uid="pod-b"))
    await node.NodePublishVolume(publish_request(pods["pod-c"], target_of(safe_tmp, "pod-c"), pod_uid="pod-c"))
    relearned = VolumeBook(store.root).get(pods["pod-c"])
    assert relearned is not None and not relearned.adopted and relearned.pod_name == "pod-pod-c"
    for uid, vid in pods.items():
        assert (target_of(safe_tmp, uid) / "config.json").exists()
        await node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
            volume_id=vid, target_path=str(target_of(safe_tmp, uid))))
        assert mounts.mounted_at(target_of(safe_tmp, uid)) is None
    assert store.leases() == {} and VolumeBook(store.root).all() == []
    await channel.close()
    plugins[1].kill(signal.SIGTERM)
    assert plugins[1].proc.returncode == 0
    store.close()
