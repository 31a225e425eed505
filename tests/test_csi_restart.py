"""The plugin killed (SIGKILL) with volumes mounted, the node drifting meanwhile, then restarted: leases are
reconciled against the kernel's mount table, and kubelet's calls keep working."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.faultproxy import FaultProxy
from tests.fixtures_csi import ROOT_MARKS, publish_request, status_of
from weightcache.csi import mounts
from weightcache.csi._pb import csi_pb2, csi_pb2_grpc
from weightcache.csi.reconcile import VolumeBook, VolumeKind, VolumeRecord, kubelet_volume_id
from weightcache.store import Store
from weightcache.store.holders import volume_record_name

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


async def _publish_all(tmp: Path, proxy: FaultProxy, plugins: list[Plugin], pods: dict[str, str | None]) -> None:
    """Start a plugin and publish each pod's volume (pod uid -> volume id) through it."""
    plugins.append(Plugin(tmp, proxy))
    channel, node = await plugins[-1].connect()
    for uid, vid in pods.items():
        await node.NodePublishVolume(publish_request(vid, target_of(tmp, uid), pod_uid=uid))
    await channel.close()


@pytest.mark.e2e
async def test_killed_plugin_restarts_and_reconciles_leases_with_mounts(
        safe_tmp: Path, fault_proxy: FaultProxy, plugins: list[Plugin]) -> None:
    pods = {uid: kubelet_volume_id(str(target_of(safe_tmp, uid))) for uid in ("pod-a", "pod-b", "pod-c")}
    await _publish_all(safe_tmp, fault_proxy, plugins, pods)
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


@pytest.mark.e2e
async def test_records_of_a_newer_release_survive_a_rollback_with_their_leases(
        safe_tmp: Path, fault_proxy: FaultProxy, plugins: list[Plugin]) -> None:
    """Hardening IV: a volume record written by a newer release (a field this one does not know) was quarantined
    by the older plugin at start, and the lease of a volume still mounted by its pod released (the model then
    evictable under it). Now: a newer minor's record is read, its unknown field kept and written back; a newer
    major's record is left alone, its lease held, and kubelet's calls for it get a clear refusal."""
    pods = {uid: kubelet_volume_id(str(target_of(safe_tmp, uid))) for uid in ("pod-a", "pod-b")}
    await _publish_all(safe_tmp, fault_proxy, plugins, pods)
    plugins[0].kill(signal.SIGTERM)

    store = Store(safe_tmp / "store", recover=False)
    book = VolumeBook(store.root)
    files = {uid: book.dir / (volume_record_name(vid) + ".json") for uid, vid in pods.items()}
    future = {"cache_group": {"tier": "nvme", "weights": [1, 2]}}  # what a later release might add
    for uid, version in (("pod-a", "1.7"), ("pod-b", "2.0")):  # a newer minor, a newer major
        files[uid].write_text(json.dumps({**json.loads(files[uid].read_text()), **future, "version": version}))
    newer_major = files["pod-b"].read_bytes()
    leases = store.leases()

    plugins.append(Plugin(safe_tmp, fault_proxy))  # the rolled-back plugin starts and reconciles
    channel, node = await plugins[1].connect()
    assert store.leases() == leases, "a lease of a volume still mounted was released"
    assert not (store.root / "quarantine").exists() or not any((store.root / "quarantine").iterdir())
    assert files["pod-b"].read_bytes() == newer_major  # never parsed, quarantined nor rewritten
    # kubelet goes on: pod-a's publish retry rewrites its record, keeping the field this release does not know
    await node.NodePublishVolume(publish_request(pods["pod-a"], target_of(safe_tmp, "pod-a"), pod_uid="pod-a"))
    kept = json.loads(files["pod-a"].read_text())
    assert kept["cache_group"] == future["cache_group"] and kept["version"] == "1.7"
    code, message = await status_of(node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
        volume_id=pods["pod-b"], target_path=str(target_of(safe_tmp, "pod-b")))))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "written by a newer weightcache" in message
    assert "record version 2.0" in message and "roll forward" in message
    assert mounts.mounted_at(target_of(safe_tmp, "pod-b")) is not None and store.leases() == leases
    await node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
        volume_id=pods["pod-a"], target_path=str(target_of(safe_tmp, "pod-a"))))
    assert f"csi:{pods['pod-a']}" not in store.leases() and not files["pod-a"].exists()
    await channel.close()
    plugins[1].kill(signal.SIGTERM)
    mounts.unmount(target_of(safe_tmp, "pod-b"))
    store.close()


# -- the record book: written through the store's no-follow tree ------------------------------------------------
def _record(volume_id: str = "vol-1") -> VolumeRecord:
    return VolumeRecord(volume_id, f"/var/lib/kubelet/pods/u1/volumes/kubernetes.io~csi/{volume_id}/mount",
                        "s3://models/llama/", "a" * 40, pod_namespace="ml", pod_name="vllm-0")


@pytest.fixture
def book_store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store")


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory and a file outside the store that a planted symlink points to; both must stay untouched."""
    out = tmp_path / "outside"
    out.mkdir()
    (out / "victim").write_text("precious\n")
    return out


def _untouched(outside: Path) -> None:
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]
    assert (outside / "victim").read_text() == "precious\n"


@pytest.mark.parametrize("planted", ["csi", "csi/volumes"])
def test_a_symlink_planted_at_the_records_directory_is_not_followed(book_store: Store, outside: Path,
                                                                     planted: str) -> None:
    """The records directory swapped for a symlink to elsewhere (before the plugin starts, or while it runs): the
    link is quarantined and a real directory made; no record lands outside the root."""
    root = book_store.root
    (root / planted).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside, root / planted)
    book = VolumeBook(book_store.tree)
    book.put(_record())
    _untouched(outside)
    assert not (root / planted).is_symlink() and book.get("vol-1") == _record()
    shutil.rmtree(root / "csi")
    os.symlink(outside, root / "csi")  # swapped while running
    assert book.get("vol-1") is None and book.all() == []
    book.put(_record("vol-2"))
    _untouched(outside)
    assert [r.volume_id for r in book.all()] == ["vol-2"]
    assert any(n.startswith("csi") for n in os.listdir(root / "quarantine"))


def test_a_symlink_at_a_records_temp_name_or_name_is_not_followed(book_store: Store, outside: Path) -> None:
    """The old writer's temp name was predictable (`.<name>.<pid>.tmp`, written following links): a symlink
    planted there made the plugin overwrite any file on the host. A symlink planted at the record itself is
    quarantined, never read through."""
    book = VolumeBook(book_store.root)  # a store root path, as the daemon API passes it
    for pid in range(os.getpid() - 2, os.getpid() + 3):
        os.symlink(outside / "victim", book.dir / f".vol-1.json.{pid}.tmp")
    book.put(_record())
    _untouched(outside)
    assert book.get("vol-1") == _record()
    os.symlink(outside / "victim", book.dir / "vol-2.json")
    assert book.get("vol-2") is None and [r.volume_id for r in book.all()] == ["vol-1"]
    _untouched(outside)
    assert not (book.dir / "vol-2.json").exists()


@pytest.mark.parametrize("body", ['{"volume_id": "vol-1", "unexpected": 1', "[]", '{"volume_id": 1}',
                                  '{"volume_id": "vol-1", "target_path": "/t", "model": "m", "snapshot_id": "s",'
                                  ' "adopted": "yes"}', "[" * 100_000])
def test_a_damaged_record_is_quarantined_not_a_crash(book_store: Store, body: str) -> None:
    book = VolumeBook(book_store.tree)
    book.put(_record("vol-2"))
    (book.dir / "vol-1.json").write_text(body)
    assert book.get("vol-1") is None
    assert [r.volume_id for r in book.all()] == ["vol-2"]  # the others still read
    assert not (book.dir / "vol-1.json").exists()
    [kept] = [n for n in os.listdir(book_store.root / "quarantine") if "vol-1.json" in n]
    assert (book_store.root / "quarantine" / kept).read_text() == body  # kept for a human
    book.put(_record())
    assert book.get("vol-1") == _record()


def test_volume_ids_that_spell_hidden_or_temp_names_get_records(book_store: Store) -> None:
    book = VolumeBook(book_store.tree)
    for volume_id in (".tmp-x", ".", "..", "a/../../b"):
        book.put(_record(volume_id))
        assert book.get(volume_id) == _record(volume_id)
    assert sorted(r.volume_id for r in book.all()) == sorted([".tmp-x", ".", "..", "a/../../b"])
    assert all(not p.is_symlink() and p.parent == book.dir for p in book.dir.iterdir())


def test_a_volume_kind_is_written_as_the_release_before_reads_it(book_store: Store) -> None:
    """VolumeRecord.kind is no field on disk: a streaming view is `"stream": true` and an engine cache volume its
    engine's name, as release 1.0 of the record wrote and reads them (rolled back, a release must still tell a
    view from a model volume, or its reconcile prunes a mounted view); read back, each has its kind again."""
    book = VolumeBook(book_store.tree)
    model = _record("vol-m")
    stream = dataclasses.replace(_record("vol-s"), snapshot_id="", kind=VolumeKind.STREAM)
    engine = dataclasses.replace(_record("vol-e"), kind=VolumeKind.ENGINE_CACHE, engine_cache="vllm-0.32.0-cpu",
                                 handover=True)
    for record in (model, stream, engine):
        book.put(record)
    wire = {v: json.loads((book.dir / f"{v}.json").read_text()) for v in ("vol-m", "vol-s", "vol-e")}
    assert not any("kind" in obj for obj in wire.values())
    assert [wire[v]["stream"] for v in ("vol-m", "vol-s", "vol-e")] == [False, True, False]
    assert wire["vol-e"]["engine_cache"] == "vllm-0.32.0-cpu" and wire["vol-e"]["handover"] is True
    assert [book.get(v) for v in ("vol-m", "vol-s", "vol-e")] == [model, stream, engine]
