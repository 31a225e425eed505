"""The CSI plugin under slow origins and hostile requests: it keeps answering, mounts only where kubelet
publishes, unmounts only its own mounts, and a cancelled publish never leaves a stray mount, lease or record.

Real gRPC over a Unix socket, real bind mounts, real S3 (moto) behind the fault proxy, which holds downloads open.
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.faultproxy import FaultProxy
from tests.fixtures_csi import (
    ROOT_MARKS,
    CsiHarness,
    bind_readonly,
    mounts_seen_from,
    publish_request,
    start_harness,
    status_of,
    stop_harness,
)
from tests.fixtures_s3 import S3
from tests.sample import make_model
from weightcache.access import Authority
from weightcache.csi import mounts
from weightcache.csi._pb import csi_pb2

pytestmark = ROOT_MARKS
SLOW = 8  # downloads held open at once
HELD_ANSWER_S = 30.0  # seconds a call may take while they are held: far past any answer, far below the hold


allow_all = Authority()  # off-cluster: every undeclared model allowed


def upload_models(s3: S3, tmp: Path, count: int) -> list[str]:
    """`count` small models s3://models/slow-N/ (two weight shards each)."""
    make_model(tmp / "slow-src", layers=2, hidden=64, vocab=128)
    for i in range(count):
        s3.upload_dir(tmp / "slow-src", "models", f"slow-{i}/")
    return [f"s3://models/slow-{i}/" for i in range(count)]


@pytest.fixture
async def wide(safe_tmp: Path, model_in_s3: str, fault_proxy: FaultProxy) -> AsyncIterator[CsiHarness]:
    """A harness that runs SLOW downloads at once and lets any model through policy."""
    harness = await start_harness(safe_tmp, fault_proxy, parallel=SLOW, authority=allow_all)
    try:
        yield harness
    finally:
        await stop_harness(harness)


async def timed(call: Awaitable[object]) -> float:
    """The call's seconds; it must answer while the downloads stay held (a call queued behind them never would:
    the bound only turns that hang into a failure, it is no speed requirement)."""
    start = time.monotonic()
    await asyncio.wait_for(call, HELD_ANSWER_S)
    return time.monotonic() - start


async def test_probe_and_cached_publish_answer_while_eight_downloads_are_held(
        wide: CsiHarness, s3: S3, safe_tmp: Path) -> None:
    csi = wide
    await csi.node.NodePublishVolume(csi.publish_request("warm"))  # llama is now cached
    models = upload_models(s3, safe_tmp, SLOW)
    held = csi.proxy.add("hold", method="GET", path="/slow-", count=-1)  # released once every answer is in
    try:
        pods = [asyncio.ensure_future(csi.node.NodePublishVolume(csi.publish_request(f"cold-{i}", model=m)))
                for i, m in enumerate(models)]
        while len({r.path.split("/")[2] for r in csi.proxy.requests_for("GET", "/slow-")}) < SLOW:
            await asyncio.sleep(0.02)  # until every download has a request held open by the proxy
        assert csi.fetches.depth() == (SLOW, 0)

        probes = [await timed(csi.identity.Probe(csi_pb2.ProbeRequest())) for _ in range(5)]
        caps = await timed(csi.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest()))
        publishes, unpublishes = [], []
        for i in range(5):
            publishes.append(await timed(csi.node.NodePublishVolume(csi.publish_request(f"hot-{i}"))))
            unpublishes.append(await timed(csi.node.NodeUnpublishVolume(csi.unpublish_request(f"hot-{i}"))))
        stats = await timed(csi.node.NodeGetVolumeStats(
            csi_pb2.NodeGetVolumeStatsRequest(volume_id="warm", volume_path=str(csi.target("warm")))))
        assert not any(p.done() for p in pods), "the downloads were still held while everything answered"
        print(f"\nwith {SLOW} downloads held open: Probe max {max(probes) * 1000:.1f} ms, cached publish median "
              f"{statistics.median(publishes) * 1000:.1f} ms (max {max(publishes) * 1000:.1f}), unpublish median "
              f"{statistics.median(unpublishes) * 1000:.1f} ms, stats {stats * 1000:.1f} ms, capabilities "
              f"{caps * 1000:.1f} ms")
    finally:
        held.release.set()
    await asyncio.gather(*pods)  # each cold pod's publish answered OK in its one call, once its model arrived
    assert all(mounts.mounted_at(csi.target(f"cold-{i}")) is not None for i in range(SLOW))
    for volume in [f"cold-{i}" for i in range(SLOW)] + ["warm"]:
        await csi.node.NodeUnpublishVolume(csi.unpublish_request(volume))


async def test_a_queued_download_says_what_it_waits_behind(safe_tmp: Path, fault_proxy: FaultProxy, s3: S3,
                                                           model_in_s3: str) -> None:
    csi = await start_harness(safe_tmp, fault_proxy, parallel=1, authority=allow_all)
    try:
        first, second = upload_models(s3, safe_tmp, 2)
        csi.proxy.add("delay", method="GET", path="/slow-0/", seconds=2.0, count=-1)
        running = asyncio.ensure_future(csi.node.NodePublishVolume(csi.publish_request("a", model=first)))
        while not csi.proxy.requests_for("GET", "/slow-0/"):
            await asyncio.sleep(0.02)
        code, details = await status_of(csi.node.NodePublishVolume(
            csi.publish_request("b", model=second, timeout="0.3s")))
        assert code == grpc.StatusCode.UNAVAILABLE
        assert details.startswith(f"fetching {second}: queued behind 1 download"), details
        await running
        await csi.node.NodePublishVolume(csi.publish_request("b", model=second))  # its turn came: one call
        for volume in ("a", "b"):
            await csi.node.NodeUnpublishVolume(csi.unpublish_request(volume))
    finally:
        await stop_harness(csi)


async def test_publish_of_an_uncached_model_waits_for_it_in_one_call(csi: CsiHarness) -> None:
    csi.proxy.add("delay", method="GET", path=".safetensors", seconds=2.0, count=-1)
    start = time.monotonic()
    await csi.node.NodePublishVolume(csi.publish_request("cold"), timeout=60)  # kubelet's call, a long deadline
    assert time.monotonic() - start >= 2.0, "it did wait for the download"
    assert mounts.mounted_at(csi.target("cold")) is not None and "csi:cold" in csi.store.leases()
    await csi.node.NodeUnpublishVolume(csi.unpublish_request("cold"))


async def test_volume_timeout_zero_is_refused_and_a_tiny_one_never_delays_a_cached_model(csi: CsiHarness) -> None:
    code, details = await status_of(csi.node.NodePublishVolume(csi.publish_request("z", timeout="0")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "volume_context.timeout" in details and "more than 0 and at most 600s" in details
    await csi.node.NodePublishVolume(csi.publish_request("warm"))
    await csi.node.NodePublishVolume(csi.publish_request("tiny", timeout="1ms"))  # cached: no wait at all
    assert mounts.mounted_at(csi.target("tiny")) is not None
    for volume in ("warm", "tiny"):
        await csi.node.NodeUnpublishVolume(csi.unpublish_request(volume))


# ---- confinement ----

def hostile_targets(csi: CsiHarness, tmp: Path) -> dict[str, Path]:
    """name -> a target path kubelet would never send, set up on disk."""
    outside = tmp / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    linked_mount = csi.kubelet_dir / "pods" / "u1" / "volumes" / "kubernetes.io~csi" / "llama"
    linked_mount.mkdir(parents=True)
    (linked_mount / "mount").symlink_to(outside)
    (csi.kubelet_dir / "pods" / "u2").symlink_to(outside)  # a symlinked parent
    (outside / "volumes" / "kubernetes.io~csi" / "llama" / "mount").mkdir(parents=True)
    return {
        "etc": Path("/etc"),
        "symlinked target": linked_mount / "mount",
        "symlinked parent": csi.kubelet_dir / "pods" / "u2" / "volumes" / "kubernetes.io~csi" / "llama" / "mount",
        "dot-dot": Path(f"{csi.kubelet_dir}/pods/u3/volumes/kubernetes.io~csi/../../../../../{outside.name}/mount"),
        "wrong shape": csi.kubelet_dir / "plugins" / "x" / "mount",
    }


async def test_publish_outside_kubelets_volume_paths_is_invalid_argument_naming_the_rule(
        csi: CsiHarness, safe_tmp: Path) -> None:
    before = mounts_seen_from(csi.root)
    for name, target in hostile_targets(csi, safe_tmp).items():
        request = publish_request(f"vol-{name.replace(' ', '-')}", target, pod_uid="u")
        code, details = await status_of(csi.node.NodePublishVolume(request))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)
        assert "kubernetes.io~csi/<volume name>/mount" in details, (name, details)
    assert mounts_seen_from(csi.root) == before, "nothing was mounted anywhere"
    assert csi.store.leases() == {} and list(csi.store.root.glob("csi/volumes/*.json")) == []
    assert (safe_tmp / "outside" / "precious").read_text() == "keep me"


async def test_unpublish_touches_only_what_the_plugin_mounted(csi: CsiHarness, safe_tmp: Path) -> None:
    # a regular file where a volume was never published survives
    never = csi.target("never")
    never.parent.mkdir(parents=True)
    never.write_text("not ours")
    assert (await status_of(csi.node.NodeUnpublishVolume(csi.unpublish_request("never"))))[0] == grpc.StatusCode.OK
    assert never.read_text() == "not ours"
    # a foreign mount point (not a snapshot of our store) is neither unmounted nor removed
    foreign_src = safe_tmp / "foreign"
    foreign_src.mkdir()
    (foreign_src / "data").write_text("theirs")
    foreign = csi.target("foreign")
    bind_readonly(foreign_src, foreign)
    assert (await status_of(csi.node.NodeUnpublishVolume(csi.unpublish_request("foreign"))))[0] == \
        grpc.StatusCode.OK
    assert mounts.mounted_at(foreign) is not None and (foreign / "data").read_text() == "theirs"
    mounts.unmount(foreign)
    # a symlinked target is refused, and what it points at is untouched
    code, details = await status_of(csi.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
        volume_id="x", target_path=str(hostile_targets(csi, safe_tmp)["symlinked target"]))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "symlink" in details
    assert (safe_tmp / "outside" / "precious").exists()
    # what we did publish is fully undone
    await csi.node.NodePublishVolume(csi.publish_request("ours"))
    await csi.node.NodeUnpublishVolume(csi.unpublish_request("ours"))
    assert not csi.target("ours").exists() and csi.store.leases() == {}


# ---- cancellation ----

async def test_a_publish_whose_caller_gave_up_never_leaves_a_stray_mount_lease_or_record(
        csi: CsiHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    await csi.node.NodePublishVolume(csi.publish_request("warm"))  # cached: the deadline lands in the mount step
    real_bind = mounts.bind_readonly_at

    def slow_bind(*args: Any, **kwargs: Any) -> Any:  # a mount step long enough for deadlines to land inside it
        time.sleep(0.03)
        return real_bind(*args, **kwargs)

    monkeypatch.setattr(mounts, "bind_readonly_at", slow_bind)
    outcomes = []
    for i, deadline in enumerate([0.002 * k for k in range(1, 30)]):  # 2-58 ms around a ~35 ms publish
        volume = f"short-{i}"
        outcomes.append((await status_of(csi.node.NodePublishVolume(csi.publish_request(volume),
                                                                  timeout=deadline)))[0])
        while (code := (await status_of(csi.node.NodeUnpublishVolume(csi.unpublish_request(volume))))[0]) \
                == grpc.StatusCode.ABORTED:  # the cancelled publish is still finishing: kubelet retries
            await asyncio.sleep(0.01)
        assert code == grpc.StatusCode.OK
        # OK, not ABORTED: no operation on the volume is left running that could mount after this point
        assert (await status_of(csi.node.NodeUnpublishVolume(csi.unpublish_request(volume))))[0] == \
            grpc.StatusCode.OK
        assert mounts.mounted_at(csi.target(volume)) is None
        assert f"csi:{volume}" not in csi.store.leases()
        assert not (csi.store.root / "csi" / "volumes" / f"{volume}.json").exists()
    print(f"\npublish outcomes by deadline: {[c.name for c in outcomes]}")
    assert grpc.StatusCode.DEADLINE_EXCEEDED in outcomes, "some deadline landed inside the publish"
    await csi.node.NodeUnpublishVolume(csi.unpublish_request("warm"))
    assert [e for e in mounts.mount_table() if str(csi.kubelet_dir) in e.mount_point] == []
    assert os.listdir(csi.store.root / "csi" / "volumes") == []


async def test_debug_request_log_and_errors_never_show_credentials_in_volume_context(
        csi: CsiHarness, caplog: pytest.LogCaptureFixture) -> None:
    secret = "wJalrXUtnFEMI/K7MDENG@bPxRfi%2FCYEXAMPLEKEY"
    model = f"s3://AKIAIOSFODNN7EXAMPLE:{secret}@models/llama/"
    with caplog.at_level(logging.DEBUG, logger="weightcache.csi"):
        code, details = await status_of(csi.node.NodePublishVolume(csi.publish_request("leak", model=model)))
    assert code != grpc.StatusCode.OK
    request_lines = [r.getMessage() for r in caplog.records if "NodePublishVolume request" in r.getMessage()]
    assert request_lines and "volume_context" in request_lines[0], "the debug log shows the request"
    for text in [details, caplog.text]:
        for piece in ("wJalrXUtnFEMI", "K7MDENG", "bPxRfi", "CYEXAMPLEKEY", "AKIAIOSFODNN7EXAMPLE"):
            assert piece not in text, (piece, text)
