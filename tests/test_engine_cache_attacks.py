"""Engine caches a pod cannot aim at the node (issue 34), replayed through the CSI plugin over gRPC with real tmpfs,
overlay and bind mounts (docs/engine-caches.md): a hit copies nothing into memory the daemon pays for; what a pod
hands over is counted by what it took on its own filesystem, a sparse file is refused; engine caches have budgets
of their own and never evict a model; read-backs never hold a thread that publish, unpublish and stats need."""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import time
from pathlib import Path

import pytest

from tests.faultproxy import FaultProxy
from tests.fixtures_csi import ALLOWED_NS, OTHER_NS, ROOT_MARKS, CsiHarness, stop_harness, two_namespaces
from tests.test_engine_cache_csi import FILES, VLLM, artifacts, engine_volume, model_of, write_cache
from weightcache import engine_cache
from weightcache.csi import mounts
from weightcache.csi._pb import csi_pb2
from weightcache.csi.engine_volumes import READBACKS
from weightcache.engine_name import EngineName
from weightcache.store import FileEntry, Snapshot, Store
from weightcache.uri import parse_ref

pytestmark = ROOT_MARKS

BIG = os.urandom(1 << 20)  # 1 MiB that no filesystem can store in less


async def hand_over(h: CsiHarness, vid: str, files: dict[str, bytes], **attrs: str) -> None:
    """A pod that starts on a miss, compiles `files`, says its engine served, and ends."""
    await h.node.NodePublishVolume(engine_volume(h, vid, **attrs))
    assert os.listdir(h.target(vid)) == [], f"{vid} should start empty"
    write_cache(h.target(vid), files)
    await h.node.NodeUnpublishVolume(h.unpublish_request(vid))


async def scratch_used(h: CsiHarness, vid: str) -> int:
    stats = await h.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(volume_id=vid,
                                                                               volume_path=str(h.target(vid))))
    return next(u.used for u in stats.usage if u.unit == csi_pb2.VolumeUsage.BYTES)


def blocks_under(root: Path) -> int:
    """Bytes the files under `root` take on disk (st_blocks), links counted once."""
    seen, total = set(), 0
    for top, _, names in os.walk(root):
        for name in names:
            st = os.lstat(os.path.join(top, name))
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_blocks * 512
    return total


async def test_a_hit_is_an_overlay_of_the_artifact_and_copies_nothing(ec: CsiHarness) -> None:
    """The attack: one hand-over, then every pod that mounts the key made the plugin copy the artifact into a
    fresh tmpfs, charged to the daemon's memory cgroup (+1 GiB per pod for a 1 GiB cache). Now the volume is an
    overlay: the artifact below, read-only; the pod's tmpfs above, empty until the pod writes."""
    await hand_over(ec, "first", {**FILES, "big.bin": BIG})
    [artifact] = artifacts(ec)
    for vid in ("hit-1", "hit-2", "hit-3"):
        await ec.node.NodePublishVolume(engine_volume(ec, vid))
        target = ec.target(vid)
        entry = mounts.mounted_at(target)
        assert entry is not None and entry.fstype == "overlay" and mounts.is_scratch(entry)
        assert {"rw", "nosuid", "nodev"} <= entry.options
        assert await scratch_used(ec, vid) < 256 << 10, "the artifact's MiB was copied into the volume's memory"
        assert (target / "big.bin").read_bytes() == BIG
        assert all((target / rel).read_bytes() == data for rel, data in FILES.items())
        # any uid may write, as before: directories 0777, files 0666 (their inodes copied up, not their data)
        assert (target / "inductor").stat().st_mode & 0o777 == 0o777
        assert (target / "big.bin").stat().st_mode & 0o777 == 0o666
        assert await scratch_used(ec, vid) < 256 << 10
    assert ec.store.leases() == {f"csi:hit-{i}": artifact.id for i in (1, 2, 3)}
    # what a pod writes is copied up into its own scratch; the artifact and the other pods never see it
    (ec.target("hit-1") / "big.bin").write_bytes(b"rewritten by hit-1")
    (ec.target("hit-1") / "inductor" / "new").write_bytes(b"new")
    assert await scratch_used(ec, "hit-1") > 0
    assert (artifact.path / "big.bin").read_bytes() == BIG and (ec.target("hit-2") / "big.bin").read_bytes() == BIG
    assert (artifact.path / "big.bin").stat().st_mode & 0o777 == 0o444
    assert not (artifact.path / "inductor" / "new").exists()
    for vid in ("hit-1", "hit-2", "hit-3"):
        await ec.node.NodeUnpublishVolume(ec.unpublish_request(vid))
        assert mounts.mounted_at(ec.target(vid)) is None and not ec.target(vid).exists()
    assert [a.id for a in artifacts(ec)] == [artifact.id] and ec.store.leases() == {}


async def test_a_restarted_plugin_keeps_a_hits_overlay_and_unmounts_it_whole(safe_tmp: Path, model_in_s3: str,
                                                                               fault_proxy: FaultProxy) -> None:
    """Reconcile keeps the overlay (its record, its lease on the artifact); the unpublish then takes off both the
    overlay and the tmpfs under it, reading nothing back."""
    first = await two_namespaces(safe_tmp, fault_proxy)
    try:
        await hand_over(first, "first", {"big.bin": BIG})
        await first.node.NodePublishVolume(engine_volume(first, "hit"))
        (first.target("hit") / "big.bin").write_bytes(b"the pod's own")
    finally:
        await stop_harness(first)
    again = await two_namespaces(safe_tmp, fault_proxy)
    try:
        [artifact] = artifacts(again)
        entry = mounts.mounted_at(again.target("hit"))
        assert entry is not None and entry.fstype == "overlay" and again.store.leases() == {"csi:hit": artifact.id}
        await again.node.NodeUnpublishVolume(again.unpublish_request("hit"))
        assert mounts.mounted_at(again.target("hit")) is None and not again.target("hit").exists()
        assert [a.id for a in artifacts(again)] == [artifact.id] and again.store.leases() == {}
        assert (artifact.path / "big.bin").read_bytes() == BIG
    finally:
        await stop_harness(again)


async def test_the_overlay_scratch_still_bounds_what_a_pod_writes(safe_tmp: Path, model_in_s3: str,
                                                                  fault_proxy: FaultProxy) -> None:
    h = await two_namespaces(safe_tmp, fault_proxy, engine_cache.EngineCacheLimits(max_bytes=2 << 20))
    try:
        await hand_over(h, "first", {"big.bin": BIG})
        await h.node.NodePublishVolume(engine_volume(h, "hit"))
        with pytest.raises(OSError) as err:
            (h.target("hit") / "more.bin").write_bytes(bytes(3 << 20))
        assert err.value.errno == 28  # ENOSPC: the pod's own scratch is full, nobody else's
        await h.node.NodeUnpublishVolume(h.unpublish_request("hit"))
        assert h.store.leases() == {}
    finally:
        await stop_harness(h)


async def test_a_sparse_file_is_refused_and_nothing_is_written(ec: CsiHarness) -> None:
    """The attack: a pod pays 4 KiB of tmpfs for a 256 MiB sparse file; the read-back wrote all of it (zeros) into
    the store. Counted by what the pod's filesystem holds (st_blocks), a sparse file is refused."""
    await ec.node.NodePublishVolume(engine_volume(ec, "sparse"))
    target = ec.target("sparse")
    write_cache(target, FILES)
    with open(target / "inductor" / "huge", "wb") as f:
        f.truncate(256 << 20)
    before = blocks_under(ec.store.root)
    await ec.node.NodeUnpublishVolume(ec.unpublish_request("sparse"))  # OK all the same: the pod is not stuck
    assert artifacts(ec) == [] and ec.store.leases() == {}
    assert os.listdir(ec.store.layout.partial) == []
    assert blocks_under(ec.store.root) - before < 1 << 20, "the store wrote the sparse file's holes"


async def test_a_hand_over_never_evicts_a_model(ec: CsiHarness) -> None:
    """The attack: the read-back made room with the store's LRU eviction (256 MiB ahead of the first file), so a
    pod's cache pushed another tenant's cached model off the node. Now engine caches evict only engine caches:
    under a disk budget with room for 256 MiB more, a 300 MiB cache is refused and the model stays."""
    await ec.node.NodePublishVolume(engine_volume(ec, "pod"))
    mine = model_of(ec)
    cached_model(ec.store, "theirs", os.urandom(8 << 20))  # another tenant's, cached here and unused
    models = {i.snapshot.id for i in ec.store.list()}
    write_cache(ec.target("pod"), {"a.txt": b"a", "z.bin": bytes(300 << 20)})
    ec.store.set_limits(budget_bytes=mine.size + (256 << 20) + 1, min_free_bytes=ec.store.min_free_bytes,
                        min_free_percent=ec.store.min_free_percent, set_by="the test")  # the model and 256 MiB
    await ec.node.NodeUnpublishVolume(ec.unpublish_request("pod"))
    assert artifacts(ec) == []
    assert {i.snapshot.id for i in ec.store.list()} == models, "a model was evicted for an engine cache"
    assert os.listdir(ec.store.layout.partial) == [] and ec.store.leases() == {}


async def test_engine_caches_have_budgets_of_their_own(safe_tmp: Path, model_in_s3: str,
                                                       fault_proxy: FaultProxy) -> None:
    """Per namespace and per node, counted by allocation: a namespace past its budget evicts its own least
    recently used caches (never another namespace's, never one in use, never a model); else it is refused."""
    limits = engine_cache.EngineCacheLimits(namespace_bytes=1536 << 10, node_bytes=2560 << 10)
    h = await two_namespaces(safe_tmp, fault_proxy, limits)
    try:
        def names() -> list[str]:
            keys = [engine_cache.key_of(a) for a in artifacts(h)]
            return sorted(f"{k.domain}/{k.name}" for k in keys if k is not None)
        await hand_over(h, "a1", {"big.bin": os.urandom(1 << 20)})
        await hand_over(h, "a2", {"big.bin": os.urandom(1 << 20)}, name="vllm-0.32.1-cpu")
        assert names() == [f"{ALLOWED_NS}/vllm-0.32.1-cpu"], "its own older cache made room, within its budget"
        await hand_over(h, "b1", {"big.bin": os.urandom(1 << 20)}, namespace=OTHER_NS)
        assert names() == [f"{ALLOWED_NS}/vllm-0.32.1-cpu", f"{OTHER_NS}/{VLLM}"]
        # the node's budget: a third MiB does not fit beside two; the other namespace's cache is in use by a pod
        await h.node.NodePublishVolume(engine_volume(h, "b-uses", namespace=OTHER_NS))
        await h.node.NodePublishVolume(engine_volume(h, "a-uses", name="vllm-0.32.1-cpu"))
        models = {model_of(h).id}
        await hand_over(h, "a3", {"big.bin": os.urandom(1 << 20)}, name="vllm-0.32.2-cpu")
        assert names() == [f"{ALLOWED_NS}/vllm-0.32.1-cpu", f"{OTHER_NS}/{VLLM}"], "refused: nothing evictable"
        assert models <= {i.snapshot.id for i in h.store.list()}
        for vid in ("b-uses", "a-uses"):
            await h.node.NodeUnpublishVolume(h.unpublish_request(vid))
        await hand_over(h, "a4", {"big.bin": os.urandom(1 << 20)}, name="vllm-0.32.2-cpu")
        assert f"{ALLOWED_NS}/vllm-0.32.2-cpu" in names(), "room made by evicting engine caches no pod uses"
        assert sum(a.size for a in artifacts(h)) <= limits.node_bytes and models <= {i.snapshot.id
                                                                                      for i in h.store.list()}
        assert [n for n in names() if n.startswith(ALLOWED_NS)] == [f"{ALLOWED_NS}/vllm-0.32.2-cpu"]
        assert os.listdir(h.store.layout.partial) == [] and h.store.leases() == {}
    finally:
        await stop_harness(h)


def cached_model(store: Store, name: str, data: bytes) -> Snapshot:
    """A model in the store as a fetch leaves it: its blob, its snapshot (one file), unleased."""
    part = store.partial_path(f"model-{name}")
    part.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    store.add_blob(part, sha)
    return store.publish(parse_ref(f"s3://models/{name}/"), [FileEntry("model.safetensors", len(data), sha)])


def waiters_on(inode: int) -> int:
    """Processes' threads blocked in flock on the file with `inode` (/proc/locks: `N: -> FLOCK ...`)."""
    count = 0
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields and any(f.count(":") == 2 and f.rsplit(":", 1)[1] == str(inode) for f in fields):
            count += 1
    return count


async def test_read_backs_never_hold_up_publish_unpublish_or_stats(ec: CsiHarness) -> None:
    """The attack: read-backs ran on the plugin's 4-thread pool, so 4 pods ending with big caches held every
    thread that another tenant's publish needed (10 s instead of 0.00 s). Here the read-backs are held at a gate
    (the key's lock, held by the test) while other volumes are published, asked about and unpublished."""
    readers = 5
    for i in range(readers):
        await ec.node.NodePublishVolume(engine_volume(ec, f"rb-{i}"))
        write_cache(ec.target(f"rb-{i}"), FILES)
    key = engine_cache.EngineCacheKey(model_of(ec).id, EngineName.parse(VLLM), ALLOWED_NS)
    gate = ec.store.open_lock(key.ref.key)
    fcntl.flock(gate, fcntl.LOCK_EX)  # every read-back of that key waits here, holding its thread
    try:
        ending = [asyncio.ensure_future(ec.node.NodeUnpublishVolume(ec.unpublish_request(f"rb-{i}")))
                  for i in range(readers)]
        inode, since = os.fstat(gate).st_ino, time.monotonic()
        while waiters_on(inode) < min(readers, 4) and (waiters_on(inode) < READBACKS or time.monotonic() - since < 1):
            assert time.monotonic() - since < 30, "the read-backs never reached the gate"
            await asyncio.sleep(0.02)
        await asyncio.wait_for(ec.node.NodePublishVolume(ec.publish_request("other")), 20)
        assert (await asyncio.wait_for(scratch_used(ec, "other"), 20)) > 0  # a model volume: its snapshot
        await asyncio.wait_for(ec.node.NodeUnpublishVolume(ec.unpublish_request("other")), 20)
        await asyncio.wait_for(ec.node.NodePublishVolume(engine_volume(ec, "theirs", namespace=OTHER_NS)), 20)
        await asyncio.wait_for(ec.node.NodeUnpublishVolume(ec.unpublish_request("theirs")), 20)
        assert not any(task.done() for task in ending), "the gate is held: no read-back can have finished"
    finally:
        os.close(gate)
    await asyncio.gather(*ending)
    [artifact] = artifacts(ec)  # the first wins; the rest found it there
    assert sorted(f.path for f in artifact.files) == sorted(FILES) and ec.store.leases() == {}

