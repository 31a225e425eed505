"""A pod's engine cache through the CSI plugin (docs/engine-caches.md, "Handing one over"): real gRPC on a Unix
socket, real tmpfs and bind mounts, the model from the S3 test server. A volume with `engineCache` starts empty
(a private, bounded tmpfs), is read back when the pod ends if it says its engine served, and later pods of the same
namespace start from it (an overlay of the artifact); other namespaces and other keys never see it; what a pod
writes is hostile."""

from __future__ import annotations

import asyncio
import errno
import json
import os
from pathlib import Path

import grpc
import pytest

from tests.faultproxy import FaultProxy
from tests.fixtures_csi import (
    ALLOWED_NS,
    MODEL_URI,
    OTHER_NS,
    ROOT_MARKS,
    CsiHarness,
    start_harness,
    status_of,
    stop_harness,
    two_namespaces,
)
from weightcache import engine_cache
from weightcache.access import Authority
from weightcache.csi import mounts
from weightcache.csi._pb import csi_pb2
from weightcache.csi.reconcile import VolumeBook
from weightcache.engine_name import EngineName
from weightcache.store import Snapshot
from weightcache.vocabulary import ENGINE_CACHE_ATTRIBUTE, ENGINE_CACHE_READY, ENGINE_REPORT

pytestmark = ROOT_MARKS

VLLM = "vllm-0.32.0-cpu"
FILES = {"torch_compile_cache/3f2a/rank_0_0/backbone/computation_graph.py": b"def f(x): return x\n",
         "inductor/fxgraph/ab/abcdef": b"\x00\x01" * 300,
         "modelinfos/llama.json": b"{}"}


def engine_volume(h: CsiHarness, vid: str, *, name: str = VLLM, readonly: bool = False, **attrs: str):
    return h.publish_request(vid, readonly=readonly, **{ENGINE_CACHE_ATTRIBUTE: name}, **attrs)


def write_cache(target: Path, files: dict[str, bytes], *, ready: bool = True) -> None:
    """What the pod's engine does: compile into its cache root, then (its startup probe) say it served."""
    for rel, data in files.items():
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        (target / rel).write_bytes(data)
    if ready:
        (target / ENGINE_CACHE_READY).write_bytes(b"")


def artifacts(h: CsiHarness) -> list[Snapshot]:
    return [i.snapshot for i in h.store.list() if engine_cache.is_engine_cache(i.snapshot)]


def model_of(h: CsiHarness) -> Snapshot:
    return next(i.snapshot for i in h.store.list() if not engine_cache.is_engine_cache(i.snapshot))


async def test_first_pod_hands_its_cache_over_and_the_next_starts_from_a_private_copy(ec: CsiHarness) -> None:
    await ec.node.NodePublishVolume(engine_volume(ec, "pod-1"))
    first = ec.target("pod-1")
    entry = mounts.mounted_at(first)
    assert entry is not None and mounts.is_scratch(entry) and {"rw", "nosuid", "nodev"} <= entry.options
    assert os.listdir(first) == [], "no cache for the key yet: the pod starts empty"
    model = model_of(ec)
    assert ec.store.leases() == {"csi:pod-1": model.id}, "the key's model snapshot is kept while the pod runs"
    write_cache(first, FILES)
    stats = await ec.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(volume_id="pod-1",
                                                                               volume_path=str(first)))
    by_unit = {u.unit: u for u in stats.usage}  # the scratch's own usage and bounds, not the model's size
    assert by_unit[csi_pb2.VolumeUsage.BYTES].total == engine_cache.scratch_bounds()[0]
    assert 0 < by_unit[csi_pb2.VolumeUsage.BYTES].used < 1 << 20
    assert by_unit[csi_pb2.VolumeUsage.INODES].used >= len(FILES) + 1
    await ec.node.NodeUnpublishVolume(ec.unpublish_request("pod-1"))
    assert mounts.mounted_at(first) is None and not first.exists() and ec.store.leases() == {}
    [artifact] = artifacts(ec)
    assert artifact.uri == f"weightcache-engine-cache://{model.id}/vllm/0.32.0/cpu/{ALLOWED_NS}/"
    assert sorted(f.path for f in artifact.files) == sorted(FILES), "the ready file is not part of the cache"

    await ec.node.NodePublishVolume(engine_volume(ec, "pod-2"))
    second = ec.target("pod-2")
    assert all((second / rel).read_bytes() == data for rel, data in FILES.items())
    assert ec.store.leases() == {"csi:pod-2": artifact.id}
    # the engine rewrites its cache root on a hit too: the copy is the pod's own, the artifact stays as it was
    (second / "modelinfos" / "llama.json").write_bytes(b"changed by pod-2")
    (second / "extra").write_bytes(b"new")
    write_cache(second, {}, ready=True)
    kept = artifact.path / "modelinfos" / "llama.json"
    assert kept.read_bytes() == b"{}" and kept.stat().st_mode & 0o777 == 0o444
    assert (second / "modelinfos" / "llama.json").stat().st_ino != kept.stat().st_ino, "a copy, never a link"
    await ec.node.NodeUnpublishVolume(ec.unpublish_request("pod-2"))
    assert [a.id for a in artifacts(ec)] == [artifact.id], "a volume that started from a hit is never read back"
    assert ec.store.leases() == {}


async def test_other_namespaces_and_other_keys_never_get_it(ec: CsiHarness) -> None:
    await ec.node.NodePublishVolume(engine_volume(ec, "pod-1"))
    write_cache(ec.target("pod-1"), FILES)
    await ec.node.NodeUnpublishVolume(ec.unpublish_request("pod-1"))
    assert len(artifacts(ec)) == 1
    for vid, request in (("b-1", engine_volume(ec, "b-1", namespace=OTHER_NS)),  # compile caches are code it runs
                         ("v-1", engine_volume(ec, "v-1", name="vllm-0.32.1-cpu")),
                         ("d-1", engine_volume(ec, "d-1", name="vllm-0.32.0-h100")),
                         ("g-1", engine_volume(ec, "g-1", include='["*.json"]'))):  # another model snapshot
        await ec.node.NodePublishVolume(request)
        assert os.listdir(ec.target(vid)) == [], vid
        await ec.node.NodeUnpublishVolume(ec.unpublish_request(vid))  # no ready file: nothing handed over
    assert len(artifacts(ec)) == 1
    # a namespace that may not have the model gets no engine cache volume either: the same one decision
    code, details = await status_of(ec.node.NodePublishVolume(engine_volume(ec, "x-1", namespace="intruder")))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "allowedNamespaces" in details
    assert not ec.target("x-1").exists()


async def test_a_read_only_volume_is_a_view_of_the_artifact_itself(ec: CsiHarness) -> None:
    await ec.node.NodePublishVolume(engine_volume(ec, "pod-1"))
    write_cache(ec.target("pod-1"), FILES)
    await ec.node.NodeUnpublishVolume(ec.unpublish_request("pod-1"))
    [artifact] = artifacts(ec)
    await ec.node.NodePublishVolume(engine_volume(ec, "ro-1", readonly=True))
    view = ec.target("ro-1")
    entry = mounts.mounted_at(view)
    assert entry is not None and {"ro", "nosuid", "nodev"} <= entry.options and not mounts.is_scratch(entry)
    assert (view / "modelinfos" / "llama.json").read_bytes() == b"{}"
    with pytest.raises(OSError) as err:
        (view / "new").write_bytes(b"x")
    assert err.value.errno == errno.EROFS
    # a read-only miss: an empty read-only directory, nothing to hand over
    await ec.node.NodePublishVolume(engine_volume(ec, "ro-2", readonly=True, namespace=OTHER_NS))
    assert os.listdir(ec.target("ro-2")) == []
    with pytest.raises(OSError) as err:
        (ec.target("ro-2") / ENGINE_CACHE_READY).write_bytes(b"")
    assert err.value.errno == errno.EROFS
    for vid in ("ro-1", "ro-2"):
        await ec.node.NodeUnpublishVolume(ec.unpublish_request(vid))
    assert [a.id for a in artifacts(ec)] == [artifact.id] and ec.store.leases() == {}
    assert (artifact.path / "modelinfos" / "llama.json").exists(), "unpublish never touches the artifact"


def _symlink(target: Path) -> None:
    (target / "inductor").mkdir(exist_ok=True)
    (target / "inductor" / "evil").symlink_to("/etc/shadow")


def _fifo(target: Path) -> None:
    os.mkfifo(target / "pipe")


def _ready_is_a_link(target: Path) -> None:
    (target / "real").write_bytes(b"")
    os.unlink(target / ENGINE_CACHE_READY)
    (target / ENGINE_CACHE_READY).symlink_to("real")


def _not_ready(target: Path) -> None:
    os.unlink(target / ENGINE_CACHE_READY)


async def test_what_a_pod_wrote_is_hostile_and_a_refusal_costs_only_its_cache(ec: CsiHarness) -> None:
    for harm in (_symlink, _fifo, _ready_is_a_link, _not_ready):
        vid = harm.__name__.strip("_").replace("_", "-")
        await ec.node.NodePublishVolume(engine_volume(ec, vid))
        write_cache(ec.target(vid), FILES)
        harm(ec.target(vid))
        await ec.node.NodeUnpublishVolume(ec.unpublish_request(vid))  # OK all the same: the pod is not stuck
        assert mounts.mounted_at(ec.target(vid)) is None and not ec.target(vid).exists(), vid
        assert artifacts(ec) == [] and ec.store.leases() == {}, vid
        assert os.listdir(ec.store.layout.partial) == [], vid


async def test_the_scratch_is_bounded_by_its_own_filesystem(safe_tmp: Path, model_in_s3: str,
                                                            fault_proxy: FaultProxy) -> None:
    h = await two_namespaces(safe_tmp, fault_proxy, engine_cache.EngineCacheLimits(max_bytes=64 << 10, max_entries=6))
    try:
        await h.node.NodePublishVolume(engine_volume(h, "big"))
        target = h.target("big")
        with pytest.raises(OSError) as err:
            (target / "huge").write_bytes(b"x" * (1 << 20))
        assert err.value.errno == errno.ENOSPC
        with pytest.raises(OSError) as err:
            for i in range(10):
                (target / f"f{i}").write_bytes(b"")
        assert err.value.errno == errno.ENOSPC
        await h.node.NodeUnpublishVolume(h.unpublish_request("big"))
        assert artifacts(h) == []
    finally:
        await stop_harness(h)


async def test_engine_cache_attributes_are_checked(ec: CsiHarness) -> None:
    for value, extra, field in (("vllm-0.32.0", {}, f"volume_context.{ENGINE_CACHE_ATTRIBUTE}"),
                                ("vllm-../x-cpu", {}, f"volume_context.{ENGINE_CACHE_ATTRIBUTE}"),
                                ("", {}, "readonly"),  # no engine cache: a model volume, which is read-only
                                (VLLM, {"hfRepo": "org/name"}, "volume_context.hfRepo")):
        request = engine_volume(ec, "bad", name=value, **extra)
        code, details = await status_of(ec.node.NodePublishVolume(request))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field), details
    assert not ec.target("bad").exists() and ec.store.leases() == {} and ec.weight_gets() == []


async def test_a_plugin_restart_keeps_the_volume_and_its_hand_over(safe_tmp: Path, model_in_s3: str,
                                                                    fault_proxy: FaultProxy) -> None:
    """The record says the volume started empty: a restarted plugin (reconcile keeps it: its tmpfs is mounted)
    still reads it back when the pod ends."""
    caches = [{"metadata": {"name": "llama"}, "spec": {"source": MODEL_URI, "allowedNamespaces": [ALLOWED_NS]}}]
    authority = Authority(model_caches=lambda: caches, allow_undeclared=lambda: False)
    first = await start_harness(safe_tmp, fault_proxy, authority=authority)
    try:
        await first.node.NodePublishVolume(engine_volume(first, "pod-r"))
        write_cache(first.target("pod-r"), FILES)
    finally:
        await stop_harness(first)
    again = await start_harness(safe_tmp, fault_proxy, authority=authority)
    try:
        assert mounts.is_scratch(mounts.mounted_at(again.target("pod-r")))  # type: ignore[arg-type]
        assert "csi:pod-r" in again.store.leases()
        await again.node.NodeUnpublishVolume(again.unpublish_request("pod-r"))
        [artifact] = artifacts(again)
        assert sorted(f.path for f in artifact.files) == sorted(FILES) and again.store.leases() == {}
    finally:
        await stop_harness(again)


async def test_a_running_pods_cache_reaches_the_next_pod_once_it_says_its_engine_served(ec: CsiHarness) -> None:
    """kubelet asks NodeGetVolumeStats of a running pod's volumes every minute: the one that holds the ready file is
    read back then (in the background), so a second pod starts from it while the first still runs."""
    await ec.node.NodePublishVolume(engine_volume(ec, "pod-1"))
    write_cache(ec.target("pod-1"), FILES)
    stats = csi_pb2.NodeGetVolumeStatsRequest(volume_id="pod-1", volume_path=str(ec.target("pod-1")))
    await ec.node.NodeGetVolumeStats(stats)
    book = VolumeBook(ec.store.root)
    for _ in range(250):  # the hand-over runs beside the answer; wait until its record says done, at most 5 s
        record = book.get("pod-1")
        if record is not None and not record.handover:
            break
        await asyncio.sleep(0.02)
    [artifact] = artifacts(ec)
    assert sorted(f.path for f in artifact.files) == sorted(FILES)
    assert mounts.is_scratch(mounts.mounted_at(ec.target("pod-1")))  # type: ignore[arg-type]  # still running
    await ec.node.NodePublishVolume(engine_volume(ec, "pod-2"))
    assert (ec.target("pod-2") / "modelinfos" / "llama.json").read_bytes() == b"{}"
    (ec.target("pod-1") / "later").write_bytes(b"written after the hand-over")
    await ec.node.NodeGetVolumeStats(stats)  # read back once: not again
    for vid in ("pod-1", "pod-2"):
        await ec.node.NodeUnpublishVolume(ec.unpublish_request(vid))
    assert [a.id for a in artifacts(ec)] == [artifact.id] and ec.store.leases() == {}


def engine_report_of(target: Path, *, key: str, written: int) -> None:
    """What the weightcache vLLM plugin writes at the volume's root (weightcache/engine_report.py)."""
    compiled = {"result": "miss", "key": key, "dir": "", "handed": [], "written": written}
    (target / ENGINE_REPORT).write_text(json.dumps({"version": 1, "stages": {}, "compile": compiled}))


async def test_a_compile_key_in_the_name_keys_the_cache_and_a_mismatch_is_never_handed_over(ec: CsiHarness) -> None:
    """`vllm-0.32.0-cpu-<compile key>`: a pod whose engine compiled under another key hands nothing over (its
    cache would be served to pods of the declared settings, which would miss it); one whose engine compiled under
    the declared key hands it over under that name only; an engine that wrote nothing hands nothing back."""
    keyed, other = f"{VLLM}-{'a' * 16}", "b" * 16
    for vid, key, written in (("wrong", other, 12), ("idle", "a" * 16, 0), ("right", "a" * 16, 12)):
        await ec.node.NodePublishVolume(engine_volume(ec, vid, name=keyed))
        write_cache(ec.target(vid), FILES)
        engine_report_of(ec.target(vid), key=key, written=written)
        await ec.node.NodeUnpublishVolume(ec.unpublish_request(vid))
        if vid != "right":
            assert artifacts(ec) == [], vid
    [artifact] = artifacts(ec)
    assert artifact.uri.endswith(f"/vllm/0.32.0/cpu/{ALLOWED_NS}/{'a' * 16}/")
    assert ENGINE_REPORT not in {f.path for f in artifact.files}, "the report is the pod's word, not the cache"
    assert engine_cache.key_of(artifact).name == EngineName.parse(keyed)
    await ec.node.NodePublishVolume(engine_volume(ec, "plain"))  # the name without a key is another key
    assert os.listdir(ec.target("plain")) == []
    await ec.node.NodePublishVolume(engine_volume(ec, "same", name=keyed))
    assert (ec.target("same") / "modelinfos" / "llama.json").read_bytes() == b"{}"
    for vid in ("plain", "same"):
        await ec.node.NodeUnpublishVolume(ec.unpublish_request(vid))
