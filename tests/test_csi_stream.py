"""Streaming volumes end to end (docs/streaming-pods.md): NodePublishVolume with `stream: "true"` over real gRPC,
real bind mounts and the moto S3 server behind the fault proxy, which holds one shard's GET so that the test sees
the view while the model is still downloading. The pod's side is weightcache.loader reading the real mount."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file

from tests.faultproxy import Fault, FaultProxy
from tests.fixtures_csi import MODEL_URI, ROOT_MARKS, CsiHarness, policy_for, start_harness, status_of, stop_harness
from tests.fixtures_daemon import eventually
from weightcache.access import Authority
from weightcache.csi import mounts
from weightcache.csi._pb import csi_pb2
from weightcache.csi.reconcile import VolumeBook
from weightcache.errors import StreamFailedError
from weightcache.loader import iter_tensors_streaming
from weightcache.vocabulary import STREAM_COMPLETE, STREAM_FAILED, STREAM_FETCHING, STREAM_STATE

pytestmark = ROOT_MARKS

SHARD_1, SHARD_2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
STREAM = {"stream": "true"}


def state_of(target: Path) -> dict[str, object]:
    return json.loads((target / STREAM_STATE).read_text())


def hold_shard_2(csi: CsiHarness) -> Fault:
    return csi.proxy.add("hold", method="GET", path=SHARD_2)


def source_files(csi: CsiHarness) -> set[str]:
    return {f.path for f in csi.store.list()[0].snapshot.files}


async def test_a_streaming_pod_loads_the_first_shard_while_the_second_downloads(csi: CsiHarness) -> None:
    hold = hold_shard_2(csi)
    target = csi.target("vol-1")
    # shard 2 is held at the origin until the pod below has loaded shard 1: a publish that waited for the download
    # would never return (60 s bounds that hang; it is no speed bound)
    await asyncio.wait_for(csi.node.NodePublishVolume(csi.publish_request("vol-1", **STREAM)), 60)
    assert not hold.release.is_set()
    entry = mounts.mounted_at(target)
    assert entry is not None and {"ro", "nosuid", "nodev"} <= entry.options
    await asyncio.to_thread(hold.arrived.wait, 20)

    got: dict[str, torch.Tensor] = {}
    done = threading.Event()
    errors: list[BaseException] = []

    def pod() -> None:  # the pod's loader, on the real mount
        try:
            for name, tensor in iter_tensors_streaming(target, timeout=30):
                got[name] = tensor.clone()
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=pod, daemon=True).start()
    await eventually(lambda: (target / SHARD_1).is_file() and (target / "config.json").is_file(),
                     what="shard 1", timeout=20)
    state = state_of(target)
    assert state["state"] == STREAM_FETCHING and SHARD_2 in state["files"] and "config.json" in state["files"]
    assert not (target / SHARD_2).exists(), "a file enters the view only whole and verified"
    shard_1 = set(load_file(target / SHARD_1))
    await eventually(lambda: shard_1 <= set(got),
                     what="the pod to load shard 1's tensors before shard 2 exists", timeout=20)
    assert not done.is_set()
    with pytest.raises(OSError) as err:  # the pod's view is read-only
        (target / "new-file").write_bytes(b"x")
    assert err.value.errno == errno.EROFS
    assert csi.store.leases() == {}, "no snapshot yet: nothing to lease"
    stats = await csi.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(volume_id="vol-1",
                                                                                volume_path=str(target)))
    assert stats.usage[0].used == sum((target / n).stat().st_size for n in os.listdir(target) if n != ".weightcache")

    hold.release.set()
    await asyncio.to_thread(done.wait, 30)
    assert not errors, errors
    await eventually(lambda: state_of(target)["state"] == STREAM_COMPLETE, what="the view to be complete", timeout=20)
    snapshot = csi.store.list()[0].snapshot
    assert sorted(state_of(target)["files"]) == sorted(f.path for f in snapshot.files)
    for f in snapshot.files:
        assert (target / f.path).read_bytes() == (snapshot.path / f.path).read_bytes(), f.path
    want = {**load_file(snapshot.path / SHARD_1), **load_file(snapshot.path / SHARD_2)}
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    await eventually(lambda: csi.store.leases() == {"csi:vol-1": snapshot.id},
                     what="the lease to move to the snapshot", timeout=20)
    assert (await asyncio.to_thread(VolumeBook(csi.store.root).get, "vol-1")).snapshot_id == snapshot.id

    await csi.node.NodeUnpublishVolume(csi.unpublish_request("vol-1"))
    assert mounts.mounted_at(target) is None and not target.exists()
    assert csi.store.leases() == {}
    assert not (csi.store.layout.streams / "vol-1").exists()
    assert all((snapshot.path / f.path).is_file() for f in snapshot.files), "unpublish never touches the cache"


async def test_a_cached_model_is_mounted_as_a_plain_snapshot(csi: CsiHarness) -> None:
    await csi.node.NodePublishVolume(csi.publish_request("vol-0"))
    await csi.node.NodeUnpublishVolume(csi.unpublish_request("vol-0"))
    await csi.node.NodePublishVolume(csi.publish_request("vol-1", **STREAM))
    target = csi.target("vol-1")
    assert not (target / STREAM_STATE).exists() and (target / SHARD_2).is_file()
    assert csi.store.leases() == {"csi:vol-1": csi.store.list()[0].snapshot.id}
    assert list(csi.store.layout.streams.iterdir()) == []


async def test_a_refused_namespace_gets_no_view(csi: CsiHarness) -> None:
    code, details = await status_of(csi.node.NodePublishVolume(csi.publish_request("vol-1", namespace="other",
                                                                                   **STREAM)))
    assert code == grpc.StatusCode.PERMISSION_DENIED, details
    assert list(csi.store.layout.streams.iterdir()) == [] and not csi.target("vol-1").exists()
    assert csi.weight_gets() == [] and await asyncio.to_thread(VolumeBook(csi.store.root).all) == []


@pytest.mark.parametrize(("attrs", "field"), [({"stream": "yes"}, "stream"),
                                              ({**STREAM, "tier": "memory"}, "tier: memory"),
                                              ({**STREAM, "hfRepo": "org/name"}, "hfRepo"),
                                              ({**STREAM, "engineCache": "vllm-0.32.0-cpu"}, "engineCache")])
async def test_stream_with_what_needs_the_whole_model_is_invalid(csi: CsiHarness, attrs: dict[str, str],
                                                                  field: str) -> None:
    code, details = await status_of(csi.node.NodePublishVolume(csi.publish_request("vol-1", **attrs)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "volume_context.stream" in details and field in details
    assert list(csi.store.layout.streams.iterdir()) == []


async def test_globs_give_the_view_only_the_files_they_select(csi: CsiHarness) -> None:
    await csi.node.NodePublishVolume(csi.publish_request("vol-1", include=f"config.json,{SHARD_1}", **STREAM))
    target = csi.target("vol-1")
    await eventually(lambda: state_of(target)["state"] == STREAM_COMPLETE, what="the view to be complete", timeout=20)
    assert state_of(target)["files"] == ["config.json", SHARD_1]
    assert sorted(os.listdir(target)) == [".weightcache", "config.json", SHARD_1]


async def test_bad_bytes_fail_the_view_and_the_loader_says_why(csi: CsiHarness) -> None:
    csi.proxy.add("flip", method="GET", path=SHARD_2, count=-1)  # the origin keeps serving a damaged shard
    await csi.node.NodePublishVolume(csi.publish_request("vol-1", **STREAM))
    target = csi.target("vol-1")
    await eventually(lambda: state_of(target)["state"] == STREAM_FAILED, what="the view to fail", timeout=60)
    state = state_of(target)
    assert "delete the pod" in state["error"] and SHARD_2 in state["error"]
    assert not (target / SHARD_2).exists() and (target / SHARD_1).is_file(), "the view keeps what it has"
    with pytest.raises(StreamFailedError, match=SHARD_2):
        await asyncio.to_thread(lambda: list(iter_tensors_streaming(target, timeout=10)))
    assert csi.store.leases() == {}
    await csi.node.NodeUnpublishVolume(csi.unpublish_request("vol-1"))
    assert mounts.mounted_at(target) is None and list(csi.store.layout.streams.iterdir()) == []


async def test_a_symlink_planted_at_the_view_is_replaced_not_followed(csi: CsiHarness, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("mine")
    (csi.store.layout.streams / "vol-1").symlink_to(outside)
    await csi.node.NodePublishVolume(csi.publish_request("vol-1", **STREAM))
    target = csi.target("vol-1")
    await eventually(lambda: state_of(target)["state"] == STREAM_COMPLETE, what="the view to be complete", timeout=20)
    view = csi.store.layout.streams / "vol-1"
    assert view.is_dir() and not view.is_symlink()
    assert os.listdir(outside) == ["keep"] and (outside / "keep").read_text() == "mine"
    assert (target / "keep").exists() is False


async def test_pods_share_one_fetch_a_late_one_gets_what_came_and_one_leaving_stops_nothing(
        csi: CsiHarness) -> None:
    hold = hold_shard_2(csi)
    await csi.node.NodePublishVolume(csi.publish_request("vol-1", **STREAM))
    one, two = csi.target("vol-1"), csi.target("vol-2")
    await eventually(lambda: (one / SHARD_1).is_file(), what="shard 1 in the first view", timeout=20)
    await csi.node.NodePublishVolume(csi.publish_request("vol-2", **STREAM))  # joins late: replayed, not refetched
    await eventually(lambda: (two / SHARD_1).is_file() and (two / "config.json").is_file(),
                     what="the replay", timeout=20)
    assert state_of(two)["files"] == state_of(one)["files"]
    assert os.stat(two / SHARD_1).st_ino == os.stat(one / SHARD_1).st_ino, "both are links to the one blob"

    await csi.node.NodeUnpublishVolume(csi.unpublish_request("vol-1"))  # mid-stream
    assert mounts.mounted_at(one) is None and not (csi.store.layout.streams / "vol-1").exists()
    hold.release.set()
    await eventually(lambda: state_of(two)["state"] == STREAM_COMPLETE,
                     what="the second view to be complete", timeout=20)
    assert sorted(csi.weight_gets()) == sorted(f"/models/llama/{s}" for s in (SHARD_1, SHARD_2)), \
        "one download of each shard for both pods"
    assert (two / SHARD_2).read_bytes() == (csi.store.list()[0].snapshot.path / SHARD_2).read_bytes()
    assert set(csi.store.leases()) == {"csi:vol-2"}


async def stopped_mid_stream(root: Path, proxy: FaultProxy) -> Path:
    """A plugin stopped while its streaming volume vol-1 had shard 1 and waited for shard 2: vol-1's target."""
    first = await start_harness(root, proxy)
    hold = hold_shard_2(first)
    target = first.target("vol-1")
    try:
        await first.node.NodePublishVolume(first.publish_request("vol-1", **STREAM))
        await eventually(lambda: (target / SHARD_1).is_file(), what="shard 1", timeout=20)
    finally:
        await stop_harness(first)
    hold.release.set()
    return target


async def test_a_restarted_plugin_goes_on_filling_the_view(safe_tmp: Path, model_in_s3: str,
                                                           fault_proxy: FaultProxy) -> None:
    target = await stopped_mid_stream(safe_tmp, fault_proxy)
    assert state_of(target)["state"] == STREAM_FETCHING, "a stopping daemon is no failure of the model"
    stale = safe_tmp / "store" / "streams" / "vol-gone"  # a crash between an unmount and the view's removal
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    second = await start_harness(safe_tmp, fault_proxy)
    try:
        assert not stale.exists(), "a view without a volume record is removed at start"
        await eventually(lambda: state_of(target)["state"] == STREAM_COMPLETE,
                         what="the resumed view to be complete", timeout=20)
        assert (target / SHARD_2).is_file()
        await eventually(lambda: second.store.leases() == {"csi:vol-1": second.store.list()[0].snapshot.id},
                         what="the volume's lease to move to the published snapshot", timeout=20)
        await second.node.NodeUnpublishVolume(second.unpublish_request("vol-1"))
        assert mounts.mounted_at(target) is None and list(second.store.layout.streams.iterdir()) == []
    finally:
        await stop_harness(second)


async def test_a_plugin_restarted_before_its_node_listed_the_modelcaches_waits_for_them_not_fails_the_pod(
        safe_tmp: Path, model_in_s3: str, fault_proxy: FaultProxy) -> None:
    """A restart's first seconds: the ModelCaches are not listed yet, so the grant is not in them. That is no
    refusal: a resumed view goes on filling once they are listed (it was failed with "no ModelCache declares"),
    and a publish meanwhile is told to retry (UNAVAILABLE), not refused (PERMISSION_DENIED)."""
    target = await stopped_mid_stream(safe_tmp, fault_proxy)
    listed, heard = threading.Event(), asyncio.Event()
    granted = policy_for(MODEL_URI).model_caches
    unlisted = Authority(model_caches=lambda: granted() if listed.is_set() else [],
                         allow_undeclared=lambda: False, synced=listed.is_set, until_synced=heard.wait)
    second = await start_harness(safe_tmp, fault_proxy, authority=unlisted)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await second.node.NodePublishVolume(second.publish_request("vol-2", **STREAM))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
        assert "not listed the cluster's ModelCaches yet" in (refused.value.details() or "")
        await asyncio.sleep(1.0)
        assert state_of(target)["state"] == STREAM_FETCHING, "the view was failed before the node could decide"
        listed.set()
        heard.set()
        await eventually(lambda: state_of(target)["state"] == STREAM_COMPLETE,
                         what="the resumed view to be complete once the ModelCaches are listed", timeout=20)
        await second.node.NodePublishVolume(second.publish_request("vol-2", **STREAM))  # kubelet's retry
    finally:
        await stop_harness(second)


async def test_a_resumed_view_waits_for_the_listing_woken_by_it_not_a_poll(
        safe_tmp: Path, model_in_s3: str, fault_proxy: FaultProxy, caplog: pytest.LogCaptureFixture) -> None:
    """The views waiting for the ModelCaches' list (a restart's first seconds) resume as it comes, woken by the
    Authority's `until_synced` (the daemon's watch), not at a later look (they looked every 0.5 s)."""
    target = await stopped_mid_stream(safe_tmp, fault_proxy)
    listed, heard = threading.Event(), asyncio.Event()
    granted = policy_for(MODEL_URI).model_caches
    unlisted = Authority(model_caches=lambda: granted() if listed.is_set() else [], allow_undeclared=lambda: False,
                         synced=listed.is_set, until_synced=heard.wait)
    caplog.set_level(logging.INFO, logger="weightcache.csi.stream")
    second = await start_harness(safe_tmp, fault_proxy, authority=unlisted)
    try:
        await asyncio.sleep(0.1)
        assert state_of(target)["state"] == STREAM_FETCHING
        listed.set()
        heard.set()
        came = time.time()

        def resumed() -> list[logging.LogRecord]:
            return [r for r in caplog.records if r.getMessage().startswith("resumed filling streaming volume vol-1")]

        await eventually(lambda: bool(resumed()), what="the view to resume", timeout=10)
        took = resumed()[0].created - came
        print(f"resumed {took:.3f} s after the list came")
        assert took < 0.125, "the wait looked again later instead of being woken"
    finally:
        await stop_harness(second)


async def test_a_source_cannot_plant_a_state_of_its_own(csi: CsiHarness, s3) -> None:
    s3.put("models", "llama/.weightcache/state", json.dumps({"state": STREAM_COMPLETE, "files": []}).encode())
    await csi.node.NodePublishVolume(csi.publish_request("vol-1", **STREAM))
    target = csi.target("vol-1")
    await eventually(lambda: state_of(target)["state"] == STREAM_COMPLETE and (target / SHARD_2).is_file(),
                     what="the view to be complete", timeout=20)
    files = state_of(target)["files"]
    assert SHARD_2 in files and not any(f.startswith(".weightcache") for f in files)
