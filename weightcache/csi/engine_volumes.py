"""Engine cache volumes (VolumeKind.ENGINE_CACHE, docs/engine-caches.md): the pod's engine compile cache, published
as the artifact itself or a private scratch, and a scratch that started empty read back into the store when its
pod says its engine served (while the pod runs, or at unpublish). A read-back (as long as the pod wrote, up to
4 GiB) runs on a pool of its own, so publish, unpublish and stats answer while read-backs run.

A report volume (VolumeKind.REPORT, `report: "true"`) is the scratch alone, without a cache: a tmpfs of REPORT_BYTES
and REPORT_INODES where a pod that mounts only its model writes its engine's report (docs/telemetry.md), read
exactly as an engine-cache volume's is and never handed over."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from concurrent.futures import ThreadPoolExecutor

from weightcache import engine_cache
from weightcache.access import Grant
from weightcache.csi import mounts
from weightcache.csi._pb import csi_pb2
from weightcache.csi.reconcile import VolumeKind, VolumeRecord
from weightcache.csi.request import PublishArgs
from weightcache.csi.targets import TargetMissingError
from weightcache.csi.telemetry import Pod, PodTelemetry, worth_handing_over
from weightcache.csi.volumes import VolumeHost, VolumeLocks, finish_even_if_cancelled
from weightcache.engine_name import EngineName
from weightcache.errors import OperationPendingError, WeightcacheError
from weightcache.store import Snapshot

logger = logging.getLogger(__name__)

READBACKS = 2  # engine-cache read-backs at once; more wait their turn, on their own pool
# A report volume's bounds: the report (at most engine_report.MAX_BYTES), its temporary twin during a replace and
# the startup probe's ready file fit in a page each; the root, those three, and a spare (another writer's tmp)
REPORT_BYTES, REPORT_INODES = 64 << 10, 8
REPORTING = (VolumeKind.ENGINE_CACHE, VolumeKind.REPORT)  # the kinds whose volume holds a pod's report


class EngineCacheVolumes:
    def __init__(self, host: VolumeHost, locks: VolumeLocks, limits: engine_cache.EngineCacheLimits,
                 telemetry: PodTelemetry) -> None:
        self._host, self._locks, self._limits, self._telemetry = host, locks, limits, telemetry
        self._store, self._targets = host.store, host.targets
        self._handing: dict[str, asyncio.Future[bool]] = {}  # volume id -> its running hand-over
        self._readbacks = ThreadPoolExecutor(READBACKS, thread_name_prefix="wc-csi-readback")

    def publish(self, args: PublishArgs, grant: Grant, model: Snapshot) -> None:
        """The pod's engine cache volume (docs/engine-caches.md, "Handing one over"). The cache for exactly
        (model snapshot, engine name, the pod's namespace or the admin's) is looked up; then
        - readOnly: a hit is the artifact itself bound ro,nosuid,nodev (a read-only view); a miss an empty
          read-only tmpfs (nothing to hand over);
        - writable: a private tmpfs, bounded in bytes and inodes, empty on a miss; on a hit an overlay of the
          artifact (read-only, below) and that tmpfs (above): nothing is copied, what the pod writes (the engine
          writes into its cache root on a hit too) is copied up in the pod's own memory cgroup. Only a volume
          that started empty is read back (`_hand_over`). The lease keeps the artifact (hit) or the key's model
          snapshot (miss)."""
        assert args.engine_cache is not None
        found = engine_cache.lookup(self._store, model, args.engine_cache, grant.who)
        if args.readonly and found is not None:
            record = args.record(found.id)
            with self._host.recorded(record, found.id):
                self._host.bind(found.path, record.target_path)
        else:
            record = args.record((found or model).id, handover=found is None and not args.readonly)
            with self._host.recorded(record, record.snapshot_id):
                try:
                    self._scratch(record, found, readonly=args.readonly)
                except BaseException:
                    with contextlib.suppress(TargetMissingError), \
                            self._targets.open_parent(record.target_path, create=False) as parent:
                        self._host.unmount_ours(parent, record.target_path)
                    raise
        logger.info("published engine cache %s of %s for pod %s/%s at %s: %s", args.engine_cache, args.ref,
                    args.pod_namespace, args.pod_name, args.target_path,
                    f"snapshot {found.id[:12]}" if found else "none yet, started empty")

    def publish_report(self, args: PublishArgs) -> None:
        """The pod's report volume: a fresh, bounded, writable tmpfs; nothing leased (it holds no snapshot). The
        model it names was authorized for the pod's namespace before this (csi/node.py): the volume exists only for
        pods that may mount that model."""
        record = args.record("")
        with self._host.recorded(record, None), self._targets.open_parent(record.target_path, create=True) as parent:
            self._host.unmount_ours(parent, record.target_path)  # a stale mount of ours from a crashed attempt
            mounts.tmpfs_at(parent, "mount", record.target_path, size_bytes=REPORT_BYTES, inodes=REPORT_INODES)
        logger.info("published report volume for pod %s/%s at %s", args.pod_namespace, args.pod_name,
                    args.target_path)

    def _scratch(self, record: VolumeRecord, found: Snapshot | None, *, readonly: bool) -> None:
        size, inodes = engine_cache.scratch_bounds(self._limits, found)
        with self._targets.open_parent(record.target_path, create=True) as parent:
            self._host.unmount_ours(parent, record.target_path)  # a stale mount of ours from a crashed attempt
            if readonly:
                mounts.tmpfs_at(parent, "mount", record.target_path, size_bytes=1 << 20, inodes=16, readonly=True)
            elif found is None:
                mounts.tmpfs_at(parent, "mount", record.target_path, size_bytes=size, inodes=inodes)
            else:
                metacopy = mounts.overlay_at(parent, "mount", record.target_path, found.path,
                                             size_bytes=size, inodes=inodes)
                engine_cache.open_up(found, f"/proc/self/fd/{parent}/mount", files=metacopy)

    async def before_unpublish(self, volume_id: str, target: str) -> None:
        """Unpublish, with the volume's lock held: what the pod's engine said last, then (the pod has ended) its
        cache read back first if due."""
        record = await self._host.io(self._host.book.get, volume_id)
        if record is not None and record.kind in REPORTING:
            await self._host.io(self._engine_report, record)
        if await self._host.io(self._due, volume_id, target):
            await finish_even_if_cancelled(self._read_back(volume_id))

    async def running_hand_over(self, volume_id: str) -> None:
        """Unpublish, before taking the volume's lock: a running pod's read-back is let finish."""
        if (handing := self._handing.get(volume_id)) is not None:
            await asyncio.wait({handing})

    async def usage(self, record: VolumeRecord) -> csi_pb2.NodeGetVolumeStatsResponse | None:
        """Stats of a scratch (None for the artifact itself: a snapshot's stats). kubelet asks about a running
        pod's volumes every minute: its ready file counts now."""
        if await self._host.io(self._is_view, record):
            return None
        await self._host.io(self._engine_report, record)
        if record.handover:
            self._start_hand_over(record.volume_id)
        return csi_pb2.NodeGetVolumeStatsResponse(usage=await self._host.io(self._scratch_usage, record))

    async def _read_back(self, volume_id: str) -> bool:
        """`_hand_over_running` on the read-backs' own pool: a pod's cache of gigabytes never holds a thread that
        publish, unpublish and stats need."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._readbacks, self._hand_over_running, volume_id)

    def _hand_over(self, record: VolumeRecord, parent: int) -> None:
        """The pod has ended: publish what it wrote into its engine cache scratch under its namespace's trust
        domain and the key fixed at publish (the model snapshot its grant resolved to), if it says its engine
        served (engine_cache.hand_over). Its bytes are hostile: read without following links, within the bounds.
        A refusal costs only this pod's cache: it is logged and the unpublish goes on (a pod must not be stuck
        terminating because of what it wrote)."""
        entry = mounts.top_mount_at(parent, "mount", record.target_path)
        if entry is None or not mounts.is_scratch(entry) or entry.fstype != "tmpfs":  # not a hit's overlay
            return
        directory = f"/proc/self/fd/{parent}/mount"
        try:
            key = engine_cache.EngineCacheKey(record.snapshot_id, EngineName.parse(record.engine_cache),
                                              record.pod_namespace)
            if (why := worth_handing_over(key.name, directory)) is not None:
                logger.warning("engine cache of pod %s/%s not handed over: %s", record.pod_namespace,
                               record.pod_name, why)
                return
            snapshot = engine_cache.hand_over(self._store, key, directory, self._limits)
        except WeightcacheError as exc:
            logger.warning("engine cache of pod %s/%s not handed over: %s", record.pod_namespace, record.pod_name,
                           exc)
            return
        except OSError as exc:
            logger.warning("engine cache of pod %s/%s not handed over (%s); the next pod starts empty again",
                           record.pod_namespace, record.pod_name, exc)
            return
        if snapshot is not None:
            logger.info("pod %s/%s handed over engine cache %s as snapshot %s (%d files, %d bytes)",
                        record.pod_namespace, record.pod_name, key, snapshot.id[:12], len(snapshot.files),
                        snapshot.size)

    def _engine_report(self, record: VolumeRecord) -> None:
        """What the pod's engine reported in its engine-cache volume (csi/telemetry.py): stages, compile result."""
        try:
            with self._targets.open_parent(record.target_path, create=False) as parent:
                if mounts.top_mount_at(parent, "mount", record.target_path) is None:
                    return
                self._telemetry.engine_volume(Pod(record.pod_namespace, record.pod_name, record.pod_uid),
                                              record.engine_cache, f"/proc/self/fd/{parent}/mount",
                                              record.published_at)
        except TargetMissingError:
            return

    def _start_hand_over(self, volume_id: str) -> None:
        """Read a running pod's engine cache back in the background when it says its engine served, so the next
        pods get it without waiting for this one to end (`hand_over_running`); the answer never waits on it."""
        if volume_id in self._handing:
            return
        task = asyncio.ensure_future(self.hand_over_running(volume_id))
        self._handing[volume_id] = task
        task.add_done_callback(lambda _: self._handing.pop(volume_id, None))

    async def hand_over_running(self, volume_id: str) -> bool:
        """The engine cache volume `volume_id`, read back once while its pod runs, if it started empty and holds
        the ready file; its record then says so, and the unpublish reads nothing back. A refusal counts as the
        one try (a hostile tree is not walked again every minute). False when there was nothing to do yet, or
        another operation holds the volume (the next call tries again)."""
        try:
            with self._locks.hold(volume_id):
                if not await self._host.io(self._due, volume_id):  # told on the plugin's pool: a stat or two
                    return False
                return await finish_even_if_cancelled(self._read_back(volume_id))
        except OperationPendingError:
            return False

    def _due(self, volume_id: str, target: str | None = None) -> bool:
        """Whether the engine cache volume `volume_id` (at `target`, when given) is to be read back now: it started
        empty, was not read back yet, and its scratch holds the ready file."""
        return self._due_record(volume_id, target) is not None

    def _due_record(self, volume_id: str, target: str | None = None) -> VolumeRecord | None:
        record = self._host.book.get(volume_id)
        if record is None or not record.handover or record.kind is not VolumeKind.ENGINE_CACHE or \
                target not in (None, record.target_path):
            return None
        try:
            with self._targets.open_parent(record.target_path, create=False) as parent:
                entry = mounts.top_mount_at(parent, "mount", record.target_path)
                if entry is None or not mounts.is_scratch(entry) or \
                        not engine_cache.is_ready(f"/proc/self/fd/{parent}/mount"):
                    return None
        except TargetMissingError:
            return None
        return record

    def _hand_over_running(self, volume_id: str) -> bool:
        """The read-back itself (on the read-backs' pool): the checks of `_due` again, then `_hand_over`."""
        record = self._due_record(volume_id)
        if record is None:
            return False
        try:
            with self._targets.open_parent(record.target_path, create=False) as parent:
                self._hand_over(record, parent)
        except TargetMissingError:
            return False
        self._host.book.put(dataclasses.replace(record, handover=False))
        return True

    def _is_view(self, record: VolumeRecord) -> bool:
        """An engine cache volume that is the artifact itself (readOnly, a hit), not a scratch (tmpfs or overlay)."""
        with self._targets.open_parent(record.target_path, create=False) as parent:
            entry = mounts.top_mount_at(parent, "mount", record.target_path)
        return entry is None or not mounts.is_scratch(entry)

    def _scratch_usage(self, record: VolumeRecord) -> list[csi_pb2.VolumeUsage]:
        """What the pod wrote into its engine cache scratch, against the tmpfs bounds (read through the walked
        parent: the mount point itself is ours, whatever the pod put under it)."""
        with self._targets.open_parent(record.target_path, create=False) as parent:
            st = os.statvfs(f"/proc/self/fd/{parent}/mount")
        return [csi_pb2.VolumeUsage(total=st.f_blocks * st.f_frsize, used=(st.f_blocks - st.f_bfree) * st.f_frsize,
                                    available=st.f_bavail * st.f_frsize, unit=csi_pb2.VolumeUsage.BYTES),
                csi_pb2.VolumeUsage(total=st.f_files, used=st.f_files - st.f_ffree, available=st.f_favail,
                                    unit=csi_pb2.VolumeUsage.INODES)]
