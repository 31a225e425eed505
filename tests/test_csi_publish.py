"""NodePublishVolume / NodeUnpublishVolume end to end: real gRPC on a Unix socket, real bind mounts, real S3."""

from __future__ import annotations

import asyncio
import errno
import os

import grpc
import pytest

from tests.fixtures_csi import ALLOWED_NS, MODEL_URI, ROOT_MARKS, CsiHarness, start_harness, stop_harness
from weightcache.csi import mounts
from weightcache.errors import InsufficientSpaceError, InUseError
from weightcache.memory import MemoryTier
from weightcache.store.holders import describe_holder

pytestmark = ROOT_MARKS


async def code_of(call) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_publish_mounts_snapshot_read_only_and_unpublish_cleans_up(csi: CsiHarness) -> None:
    await csi.node.NodePublishVolume(csi.publish_request("vol-1"))
    target = csi.target("vol-1")
    entry = mounts.mounted_at(target)
    assert entry is not None and {"ro", "nosuid", "nodev"} <= entry.options
    assert b"LlamaForCausalLM" in (target / "config.json").read_bytes()
    with pytest.raises(OSError) as err:
        (target / "new-file").write_bytes(b"x")
    assert err.value.errno == errno.EROFS
    assert csi.store.leases() == {"csi:vol-1": csi.store.list()[0].snapshot.id}

    await csi.node.NodeUnpublishVolume(csi.unpublish_request("vol-1"))
    assert mounts.mounted_at(target) is None
    assert not target.exists()
    assert csi.store.leases() == {}
    snapshot = csi.store.list()[0].snapshot
    assert (snapshot.path / "config.json").exists(), "unpublish must never touch the cache"


async def test_publish_is_idempotent_and_conflicting_reuse_is_already_exists(csi: CsiHarness) -> None:
    request = csi.publish_request("vol-1")
    await csi.node.NodePublishVolume(request)
    await csi.node.NodePublishVolume(request)  # kubelet retry after a lost response
    stacked = [e for e in mounts.mount_table() if e.mount_point == str(csi.target("vol-1"))]
    assert len(stacked) == 1

    other = csi.publish_request("vol-1", revision="0123456789abcdef")
    assert await code_of(csi.node.NodePublishVolume(other)) == grpc.StatusCode.ALREADY_EXISTS
    other = csi.publish_request("vol-1", tier="memory")
    assert await code_of(csi.node.NodePublishVolume(other)) == grpc.StatusCode.ALREADY_EXISTS
    await csi.node.NodeUnpublishVolume(csi.unpublish_request("vol-1"))
    await csi.node.NodeUnpublishVolume(csi.unpublish_request("vol-1"))  # idempotent
    await csi.node.NodeUnpublishVolume(csi.unpublish_request("never-published"))


async def test_readonly_false_is_refused_with_what_to_write(csi: CsiHarness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await csi.node.NodePublishVolume(csi.publish_request("vol-rw", readonly=False))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "readOnly: true" in err.value.details()
    assert not csi.target("vol-rw").exists() and csi.weight_gets() == []


@pytest.mark.parametrize("model", ["", "s3://models/../../etc/", "https://user:secret@host/models/", "gopher://x/y/",
                                   "s3://models/llama/\x00", "s3://models/llama/@../../x", "models/llama/"])
async def test_hostile_model_attribute_is_invalid_argument_naming_the_field(csi: CsiHarness, model: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await csi.node.NodePublishVolume(csi.publish_request("vol-h", model=model))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "volume_context.model" in err.value.details()
    assert "secret" not in err.value.details(), "credentials never reach events or logs"
    assert csi.store.leases() == {} and not csi.target("vol-h").exists()


async def test_namespace_not_allowed_is_permission_denied_before_any_download(csi: CsiHarness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await csi.node.NodePublishVolume(csi.publish_request("vol-ns", namespace="intruder"))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "allowedNamespaces" in err.value.details()
    # a model no ModelCache declares (a local path on the node) is refused the same way
    local = csi.publish_request("vol-etc", model="file:///etc/")
    assert await code_of(csi.node.NodePublishVolume(local)) == grpc.StatusCode.PERMISSION_DENIED
    assert csi.weight_gets() == [] and csi.store.list() == [] and csi.store.leases() == {}


async def test_volume_stats_report_snapshot_bytes(csi: CsiHarness) -> None:
    from weightcache.csi._pb import csi_pb2

    await csi.node.NodePublishVolume(csi.publish_request("vol-s"))
    stats = await csi.node.NodeGetVolumeStats(
        csi_pb2.NodeGetVolumeStatsRequest(volume_id="vol-s", volume_path=str(csi.target("vol-s"))))
    size = csi.store.list()[0].snapshot.size
    by_unit = {u.unit: u for u in stats.usage}
    assert by_unit[csi_pb2.VolumeUsage.BYTES].total == size == by_unit[csi_pb2.VolumeUsage.BYTES].used
    assert size == sum(p.stat().st_size for p in csi.target("vol-s").rglob("*") if p.is_file())
    await csi.node.NodeUnpublishVolume(csi.unpublish_request("vol-s"))


async def test_twenty_pods_share_one_download_and_one_snapshot(csi: CsiHarness) -> None:
    ids = [f"pod-{i}" for i in range(20)]
    await asyncio.gather(*(csi.node.NodePublishVolume(csi.publish_request(v)) for v in ids))
    snapshots = csi.store.list()
    assert len(snapshots) == 1
    assert sorted(csi.store.leases()) == sorted(f"csi:{v}" for v in ids)
    gets = csi.weight_gets()
    assert len(set(gets)) == len(gets) == 2, "each shard is downloaded once"
    first = (csi.target(ids[0]) / "model-00001-of-00002.safetensors").read_bytes()
    assert all((csi.target(v) / "model-00001-of-00002.safetensors").read_bytes() == first for v in ids)
    await asyncio.gather(*(csi.node.NodeUnpublishVolume(csi.unpublish_request(v)) for v in ids))
    assert csi.store.leases() == {} and not any(csi.target(v).exists() for v in ids)


async def test_hundred_concurrent_publishes_of_uncached_model_download_it_once(csi: CsiHarness) -> None:
    csi.proxy.add("delay", method="GET", path=".safetensors", seconds=0.5, count=-1)  # all 100 overlap the fetch
    ids = [f"c-{i}" for i in range(100)]
    await asyncio.gather(*(csi.node.NodePublishVolume(csi.publish_request(v)) for v in ids))
    gets = csi.weight_gets()
    assert len(set(gets)) == len(gets) == 2
    assert len(csi.store.leases()) == 100
    await asyncio.gather(*(csi.node.NodeUnpublishVolume(csi.unpublish_request(v)) for v in ids))


async def test_publish_while_downloading_answers_unavailable_with_progress_then_succeeds(csi: CsiHarness) -> None:
    csi.proxy.add("delay", method="GET", path=".safetensors", seconds=2.0, count=-1)
    request = csi.publish_request("vol-d", timeout="0.2s")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await csi.node.NodePublishVolume(request)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert err.value.details().startswith(f"fetching {MODEL_URI}")
    # without a volume timeout, the answer still comes before the caller's deadline, with the progress in it
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await csi.node.NodePublishVolume(csi.publish_request("vol-d"), timeout=1.5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "fetching" in err.value.details()
    assert csi.store.leases() == {} and mounts.mounted_at(csi.target("vol-d")) is None
    for _ in range(100):  # kubelet's retries (its backoff, much shortened)
        if await code_of(csi.node.NodePublishVolume(request)) == grpc.StatusCode.OK:
            break
        await asyncio.sleep(0.1)
    assert mounts.mounted_at(csi.target("vol-d")) is not None
    assert len(csi.weight_gets()) == 2, "retries joined the one download"
    await csi.node.NodeUnpublishVolume(csi.unpublish_request("vol-d"))


async def test_concurrent_call_on_same_volume_is_aborted(csi: CsiHarness) -> None:
    csi.proxy.add("delay", method="GET", path=".safetensors", seconds=0.5, count=-1)
    request = csi.publish_request("vol-a")
    codes = await asyncio.gather(code_of(csi.node.NodePublishVolume(request)),
                                 code_of(csi.node.NodePublishVolume(request)))
    assert sorted(codes, key=str) == sorted([grpc.StatusCode.OK, grpc.StatusCode.ABORTED], key=str)
    await csi.node.NodeUnpublishVolume(csi.unpublish_request("vol-a"))


@pytest.mark.parametrize("cached", [True, False])
async def test_unpublish_racing_publish_leaves_a_consistent_state(csi: CsiHarness, cached: bool) -> None:
    if cached:
        await csi.node.NodePublishVolume(csi.publish_request("warm"))
    for i in range(5):
        vid = f"race-{i}"
        codes = await asyncio.gather(code_of(csi.node.NodePublishVolume(csi.publish_request(vid))),
                                     code_of(csi.node.NodeUnpublishVolume(csi.unpublish_request(vid))))
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.ABORTED}
        mounted = mounts.mounted_at(csi.target(vid)) is not None
        assert mounted == (f"csi:{vid}" in csi.store.leases()), "a mount always has a lease, a lease a mount"
        await csi.node.NodeUnpublishVolume(csi.unpublish_request(vid))
        assert mounts.mounted_at(csi.target(vid)) is None and f"csi:{vid}" not in csi.store.leases()
    await csi.node.NodeUnpublishVolume(csi.unpublish_request("warm"))


async def test_evicting_a_mounted_model_is_refused_and_names_the_pod(csi: CsiHarness) -> None:
    await csi.node.NodePublishVolume(csi.publish_request("vol-e"))
    snapshot = csi.store.list()[0].snapshot
    with pytest.raises(InUseError) as err:
        csi.store.evict(snapshot.id)
    assert "csi:vol-e" in str(err.value)
    assert describe_holder(csi.store.root, "csi:vol-e").startswith(f"pod {ALLOWED_NS}/pod-vol-e")
    with pytest.raises(InsufficientSpaceError):  # LRU eviction skips it too
        csi.store.evict_to(0)
    assert (csi.target("vol-e") / "config.json").read_bytes() == (snapshot.path / "config.json").read_bytes()
    await csi.node.NodeUnpublishVolume(csi.unpublish_request("vol-e"))
    csi.store.evict(snapshot.id)  # free once unmounted
    assert not os.path.exists(snapshot.path)


async def test_memory_tier_volume_is_made_resident_and_served_from_disk_when_it_cannot_be(
        safe_tmp, fault_proxy, model_in_s3) -> None:
    tier = MemoryTier(64 << 20, mode="mlock")
    csi = await start_harness(safe_tmp, fault_proxy, tier=tier)
    try:
        await csi.node.NodePublishVolume(csi.publish_request("vol-m", tier="memory"))
        snapshot = csi.store.list()[0].snapshot
        assert [r.id for r in tier.resident()] == [snapshot.id]
        tier.demote(snapshot.id)
        tier.budget_bytes = 1  # full: the pod still starts, from disk
        await csi.node.NodePublishVolume(csi.publish_request("vol-m2", tier="memory"))
        assert tier.resident() == [] and (csi.target("vol-m2") / "config.json").exists()
        for vid in ("vol-m", "vol-m2"):
            await csi.node.NodeUnpublishVolume(csi.unpublish_request(vid))
    finally:
        await stop_harness(csi)
        tier.close()
