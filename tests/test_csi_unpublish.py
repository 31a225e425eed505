"""NodeUnpublishVolume finds and removes a mount by what the target directory is (its mount id, reached through the
walked parent's fd), never by comparing path strings or re-walking the path: a kubelet directory reached through a
symlink, a target path spelled with '//' or a trailing '/', and a target swapped between calls all behave."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tests.faultproxy import FaultProxy
from tests.fixtures_csi import ROOT_MARKS, CsiHarness, bind_readonly, start_harness, status_of, stop_harness
from weightcache.csi import mounts
from weightcache.csi._pb import csi_pb2

pytestmark = ROOT_MARKS


@pytest.fixture
async def linked_csi(safe_tmp: Path, model_in_s3: str, fault_proxy: FaultProxy) -> AsyncIterator[CsiHarness]:
    """A plugin whose kubeletDir is a symlink (some distributions move /var/lib/kubelet): mountinfo then shows the
    real path while kubelet sends the configured one."""
    (safe_tmp / "real-kubelet").mkdir()
    (safe_tmp / "kubelet").symlink_to(safe_tmp / "real-kubelet")
    harness = await start_harness(safe_tmp, fault_proxy)
    try:
        yield harness
    finally:
        await stop_harness(harness)


async def test_publish_repeat_and_unpublish_through_a_symlinked_kubelet_dir(linked_csi: CsiHarness) -> None:
    csi = linked_csi
    await csi.node.NodePublishVolume(csi.publish_request("vol"))
    real = csi.root / "real-kubelet" / csi.target("vol").relative_to(csi.kubelet_dir)
    assert mounts.mounted_at(real) is not None
    await csi.node.NodePublishVolume(csi.publish_request("vol"))  # kubelet's retry: OK, and no second mount
    assert [e.mount_point for e in mounts.mount_table()].count(str(real)) == 1
    code, details = await status_of(csi.node.NodeUnpublishVolume(csi.unpublish_request("vol")))
    assert code == grpc.StatusCode.OK, details
    assert mounts.mounted_at(real) is None
    assert not (real.parent / "mount").exists()
    assert csi.store.leases() == {}


async def test_unpublish_leaves_a_foreign_mount_stacked_on_ours(csi: CsiHarness, safe_tmp: Path) -> None:
    """Something mounted over our snapshot (not ours) stays, and so do ours under it and its lease (else the
    snapshot would be evictable under a mount): an error naming the foreign mount, kubelet retries."""
    await csi.node.NodePublishVolume(csi.publish_request("vol"))
    foreign = safe_tmp / "foreign"
    foreign.mkdir()
    (foreign / "data").write_text("theirs")
    bind_readonly(foreign, csi.target("vol"))
    code, details = await status_of(csi.node.NodeUnpublishVolume(csi.unpublish_request("vol")))
    assert code == grpc.StatusCode.INTERNAL and "not a weightcache snapshot" in details and "unmount it" in details
    assert (csi.target("vol") / "data").read_text() == "theirs"
    assert "csi:vol" in csi.store.leases()
    mounts.unmount_top(csi.target("vol"))
    assert (csi.target("vol") / "config.json").exists()  # ours is still under it
    assert (await status_of(csi.node.NodeUnpublishVolume(csi.unpublish_request("vol"))))[0] == grpc.StatusCode.OK
    assert mounts.mounted_at(csi.target("vol")) is None and csi.store.leases() == {}


@pytest.mark.parametrize("spelling", ["trailing slash", "double slash"])
async def test_unpublish_of_an_odd_spelling_of_the_target(csi: CsiHarness, spelling: str) -> None:
    """kubelet never sends these; answered INVALID_ARGUMENT (the rule) with the mount, lease and record kept."""
    await csi.node.NodePublishVolume(csi.publish_request("vol"))
    target = str(csi.target("vol"))
    odd = target + "/" if spelling == "trailing slash" else target.replace("/pods/", "//pods/")
    code, details = await status_of(csi.node.NodeUnpublishVolume(
        csi_pb2.NodeUnpublishVolumeRequest(volume_id="vol", target_path=odd)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "kubernetes.io~csi" in details
    assert mounts.mounted_at(target) is not None and "csi:vol" in csi.store.leases()
    await csi.node.NodeUnpublishVolume(csi.unpublish_request("vol"))
    assert mounts.mounted_at(target) is None


async def test_a_parent_swapped_for_a_symlink_after_publish(csi: CsiHarness, safe_tmp: Path) -> None:
    """The pod directory moved away and replaced by a link to another pod's: unpublish refuses the link and
    unmounts nothing of the other pod."""
    await csi.node.NodePublishVolume(csi.publish_request("a"))
    await csi.node.NodePublishVolume(csi.publish_request("b"))
    pod_a = csi.kubelet_dir / "pods" / "a"
    moved = safe_tmp / "moved-a"
    os.rename(pod_a, moved)
    pod_a.symlink_to(csi.kubelet_dir / "pods" / "b")
    code, details = await status_of(csi.node.NodeUnpublishVolume(csi.unpublish_request("a")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "symlink" in details
    assert mounts.mounted_at(csi.target("b")) is not None and (csi.target("b") / "config.json").exists()
    assert {"csi:a", "csi:b"} <= set(csi.store.leases())
    pod_a.unlink()
    os.rename(moved, pod_a)
    for volume in ("a", "b"):
        assert (await status_of(csi.node.NodeUnpublishVolume(csi.unpublish_request(volume))))[0] == \
            grpc.StatusCode.OK
    assert csi.store.leases() == {}
    shutil.rmtree(csi.kubelet_dir / "pods")
