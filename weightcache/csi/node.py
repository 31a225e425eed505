"""CSI Node service: publish a cached model as a read-only ephemeral inline volume, unpublish it.

NodePublishVolume, as kubelet calls it for an inline volume:
  1. validate the request (INVALID_ARGUMENT naming the field) and read the pod's volumeAttributes;
  2. one operation per volume id at a time (ABORTED otherwise); a repeat of a finished publish is OK,
     the same id with other arguments is ALREADY_EXISTS;
  3. policy: may the pod's namespace read this model (PERMISSION_DENIED);
  4. a cached model is mounted at once; otherwise its one fetch (the daemon's fetch queue) is joined and the call
     held as long as kubelet waits (the request's deadline less a margin, else kubelet's 2-minute csiTimeout);
     past it answer UNAVAILABLE with the download's progress, leaving it running so kubelet's retry joins it;
  5. with `tier: memory`, make the snapshot resident in the memory tier (its pages locked in place, so the pod's
     reads through the mount hit RAM); where the tier is off or full, the pod is served from disk and a warning
     is logged: a slower start beats a pod that never starts;
  6. lease `csi:<volume_id>`, write the volume record, bind-mount the snapshot ro,nosuid,nodev. Once begun this
     step finishes even if the caller goes away (its deadline passed), and the volume stays locked until it has:
     a following unpublish finds a mount with its lease and record, never a mount that appears later.
Targets are confined to kubelet's inline-volume paths (targets.py). Blocking work (records, mounts, stats) runs on
the plugin's own small pool, so Probe, unpublish and a cached publish answer while downloads run.

Each kind of volume (reconcile.VolumeKind) has its own part: model volumes here, engine cache volumes in
engine_volumes.py, streaming views in stream.py; the request is parsed in request.py, and what they share
(records, mounts, locks, the pool) is volumes.py.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from weightcache import engine_cache
from weightcache.access import Authority, Grant, Requester
from weightcache.csi import adapters, mounts
from weightcache.csi._pb import csi_pb2, csi_pb2_grpc
from weightcache.csi.adapters import AdapterVolumes
from weightcache.csi.engine_volumes import REPORTING, EngineCacheVolumes
from weightcache.csi.errors import Observe, quiet_rpc, rpc
from weightcache.csi.reconcile import VolumeBook, VolumeKind
from weightcache.csi.request import PublishArgs, parse_publish, require_id, require_path
from weightcache.csi.stream import StreamVolumes
from weightcache.csi.targets import KubeletTargets, TargetMissingError
from weightcache.csi.telemetry import ObserveCompile, PodEvent, PodTelemetry
from weightcache.csi.volumes import VolumeHost, VolumeLocks, finish_even_if_cancelled
from weightcache.errors import (
    FetchPendingError,
    InvalidRequestError,
    MemoryTierError,
    MountError,
    VolumeConflictError,
    VolumeNotFoundError,
)
from weightcache.fetch_queue import FetchQueue
from weightcache.hf_layout import hub_cache
from weightcache.memory import MemoryTier
from weightcache.store import Snapshot, Store
from weightcache.store.holders import csi_holder as holder_for
from weightcache.vocabulary import STAGE_MODEL_ON_NODE, STAGE_VOLUME_PUBLISHED

logger = logging.getLogger(__name__)

CSI_TIMEOUT_S = 120.0  # kubelet's csiTimeout (pkg/volume/csi/csi_plugin.go): how long it waits for one call
DEADLINE_MARGIN_S = 1.0  # answer this long before the caller's deadline, so it reads our progress, not a timeout
MAX_ATTEMPTS = 4096  # volumes whose first publish attempt is remembered (a pod deleted mid-retry is never unpublished)


class NodeServicer(csi_pb2_grpc.NodeServicer):
    """`pool` runs the plugin's blocking work (records, mounts, stats); `observe(method, seconds, code)` is told
    about every call and `observe_stage(stage, seconds, cache)` about each pod's cold-start stages (the daemon's
    metrics), `pod_event` writes them as Events on the pod and `observe_compile` hears what each pod's engine did
    with the compile cache it was handed (csi/telemetry.py)."""

    def __init__(self, store: Store, fetches: FetchQueue, *, node_id: str, authority: Authority,
                 kubelet_dir: str | Path, publish_timeout: float = CSI_TIMEOUT_S, book: VolumeBook | None = None,
                 tier: MemoryTier | None = None, pool: ThreadPoolExecutor | None = None,
                 observe: Observe | None = None,
                 observe_stage: Callable[[str, float, str], None] | None = None,
                 engine_limits: engine_cache.EngineCacheLimits | None = None,
                 pod_event: PodEvent | None = None, observe_compile: ObserveCompile | None = None,
                 on_adapters: Callable[[], None] = lambda: None) -> None:
        self._store = store
        self._tier = tier
        self._fetches = fetches
        self._node_id = node_id
        self._authority = authority
        self._targets = KubeletTargets(kubelet_dir)
        self._publish_timeout = publish_timeout
        self._book = book or VolumeBook(store.root)
        self._locks = VolumeLocks()
        self._host = VolumeHost(store, self._book, self._targets,
                                pool or ThreadPoolExecutor(4, thread_name_prefix="wc-csi"))
        self._telemetry = PodTelemetry(observe_stage=observe_stage, pod_event=pod_event,
                                       observe_compile=observe_compile)
        self._engines = EngineCacheVolumes(self._host, self._locks,
                                           engine_limits or engine_cache.EngineCacheLimits(), self._telemetry)
        self._streams = StreamVolumes(self._host, fetches, authority)
        self._adapters = AdapterVolumes(self._host, self._streams.views, fetches, authority, on_adapters)
        self.observe: Observe | None = observe
        # volume id -> monotonic time of kubelet's first publish of it: a cold model's wait spans kubelet's retries
        self._attempts: dict[str, float] = {}

    async def resume_streams(self) -> None:
        """After a restart: fill again every streaming view whose snapshot is not published yet (stream.py)."""
        await self._streams.resume()

    async def hand_over_running(self, volume_id: str) -> bool:
        """Read a running pod's engine cache back now if it is due (engine_volumes.py)."""
        return await self._engines.hand_over_running(volume_id)

    # ---- publish / unpublish ----

    @rpc
    async def NodePublishVolume(self, request: csi_pb2.NodePublishVolumeRequest,
                                context: grpc.aio.ServicerContext[Any, Any]) -> csi_pb2.NodePublishVolumeResponse:
        args = parse_publish(request)
        io = self._host.io
        await io(self._targets.refuse_links, args.target_path)
        with self._locks.hold(args.volume_id):
            if await self._published_already(args):
                return csi_pb2.NodePublishVolumeResponse()
            retry = args.volume_id in self._attempts  # an earlier attempt waited: a miss, whatever this one finds
            self._telemetry.first_attempt(args.pod)
            started = self._first_attempt(args.volume_id)
            grant = self._authority.authorize(args.ref, Requester(args.pod_namespace))  # weightcache/access.py
            if args.kind is VolumeKind.REPORT:  # the model granted: the pod's report scratch, no fetch to wait for
                await finish_even_if_cancelled(io(self._engines.publish_report, args))
                self._attempts.pop(args.volume_id, None)
                return csi_pb2.NodePublishVolumeResponse()
            if args.kind is VolumeKind.ADAPTERS:  # the base model granted: its adapters, each decided as it comes
                await self._adapters.publish(args.record(""))
                self._attempts.pop(args.volume_id, None)
                return csi_pb2.NodePublishVolumeResponse()
            if args.kind is VolumeKind.STREAM:  # a miss does not wait: the pod gets a view that fills as files arrive
                cached = await self._fetches.lookup(grant)
                if cached is None:
                    await self._streams.publish(args.record(""), grant)
                    self._attempts.pop(args.volume_id, None)  # no stages: the model lands after the volume
                    return csi_pb2.NodePublishVolumeResponse()
                snapshot, hit = cached, True
            else:
                snapshot, hit = await self._ensure(args, grant, context)
            model_s, hit = time.monotonic() - started, hit and not retry
            if args.kind is VolumeKind.ENGINE_CACHE:  # the key's model snapshot is the one this grant resolves to
                await finish_even_if_cancelled(io(self._engines.publish, args, grant, snapshot))
                self._attempts.pop(args.volume_id, None)  # the pod's model volume counts its stages, not this
                return csi_pb2.NodePublishVolumeResponse()
            await asyncio.to_thread(self._keep_resident, snapshot, args.tier)  # long (page locking): not our pool
            await finish_even_if_cancelled(io(self._mount, args, snapshot))
        self._published(args, snapshot, hit, model_s, time.monotonic() - self._attempts.pop(args.volume_id, started))
        return csi_pb2.NodePublishVolumeResponse()

    async def _published_already(self, args: PublishArgs) -> bool:
        """A kubelet retry of a publish that finished: True (OK). The same id with other arguments is refused."""
        existing = await self._host.io(self._book.get, args.volume_id)
        if existing is None:
            return False
        if not args.matches(existing):
            raise VolumeConflictError(f"volume {args.volume_id} is already published with model {existing.model} "
                                      f"for {existing.describe()}; unpublish it first")
        if not await self._host.io(self._host.is_mounted, args.target_path):
            return False
        if existing.adopted:  # learn the pod and model again from kubelet's retry
            await self._host.io(self._book.put, args.record(existing.snapshot_id))
        return True

    def _first_attempt(self, volume_id: str) -> float:
        """When kubelet first asked to publish `volume_id` (now, for a first attempt): the oldest is forgotten past
        MAX_ATTEMPTS, so pods deleted while their model downloaded cannot grow the map."""
        if volume_id not in self._attempts and len(self._attempts) >= MAX_ATTEMPTS:
            del self._attempts[next(iter(self._attempts))]
        return self._attempts.setdefault(volume_id, time.monotonic())


    def _published(self, args: PublishArgs, snapshot: Snapshot, hit: bool, model_s: float, published_s: float) -> None:
        """The cold-start stages of a published model volume: the metrics' histograms (no pod names: unbounded
        labels) and one key=value log line that names the pod."""
        cache = "hit" if hit else "miss"
        self._telemetry.published(args.pod, str(args.ref), cache, model_s, published_s)
        logger.info("published pod=%s/%s model=%s key=%s snapshot=%s cache=%s %s=%.3fs %s=%.3fs target=%s",
                    args.pod_namespace, args.pod_name, args.ref, args.ref.key, snapshot.id[:12], cache,
                    STAGE_MODEL_ON_NODE, model_s, STAGE_VOLUME_PUBLISHED, published_s, args.target_path)


    def _keep_resident(self, snapshot: Snapshot, tier: str) -> None:
        if self._tier is None:
            if tier == "memory":
                logger.warning("tier=memory asked for %s, but the memory tier is off on this node (set "
                               "memoryBudget in the daemon config); serving it from disk", snapshot.uri)
            return
        if tier != "memory":
            self._tier.touch(snapshot.id)
            return
        try:
            self._tier.promote(snapshot)
        except MemoryTierError as exc:
            logger.warning("serving %s from disk: %s", snapshot.uri, exc)


    def _mount(self, args: PublishArgs, snapshot: Snapshot) -> None:
        """Lease, record, then mount: a crash in between leaves a lease that reconcile settles. With hfRepo the
        source is the snapshot's hub cache layout (weightcache.hf_layout: hard links, built once), where the
        reference's revision (a branch or tag) resolves too."""
        record = args.record(snapshot.id)
        with self._host.recorded(record, snapshot.id):
            source = snapshot.path
            if args.hf_repo is not None:
                revision = args.ref.revision
                source = hub_cache(self._store, snapshot, args.hf_repo, refs=(revision,) if revision else ())
            self._host.bind(source, record.target_path)

    def _wait_budget(self, args: PublishArgs, context: grpc.aio.ServicerContext[Any, Any]) -> float:
        """As long as the caller waits: its deadline less a margin (kubelet: 2 minutes), capped by
        volume_context.timeout."""
        remaining = context.time_remaining()
        budget = self._publish_timeout if remaining is None else remaining - DEADLINE_MARGIN_S
        if args.timeout is not None:
            budget = min(budget, args.timeout)
        return max(budget, 0.0)


    async def _ensure(self, args: PublishArgs, grant: Grant,
                      context: grpc.aio.ServicerContext[Any, Any]) -> tuple[Snapshot, bool]:
        """The model's snapshot and whether it was cached: at once when cached; else join its one fetch for as long
        as the caller waits, then raise FetchPendingError with the progress and let the fetch run on for kubelet's
        retry. The queue's
        lookup is the one store lookup before the engine's own under its lock; a hit never waits on the caller's
        deadline budget (a tiny volume timeout must not delay a cached model)."""
        cached = await self._fetches.lookup(grant)
        if cached is not None:
            return cached, True
        budget = self._wait_budget(args, context)
        try:
            return await asyncio.wait_for(self._fetches.fetch(grant, keep=True), budget), False
        except TimeoutError:
            progress = self._fetches.progress(args.ref)
            text = progress.describe() if progress is not None else f"fetching {args.ref}: starting"
            raise FetchPendingError(f"{text}; not ready within {budget:.1f}s; the volume is published when the "
                                    "download completes (kubelet retries)") from None


    @rpc
    async def NodeUnpublishVolume(self, request: csi_pb2.NodeUnpublishVolumeRequest,
                                  context: grpc.aio.ServicerContext[Any, Any]) -> csi_pb2.NodeUnpublishVolumeResponse:
        volume_id = require_id(request.volume_id, "volume_id")
        target = require_path(request.target_path, "target_path")
        self._targets.check(target)
        await self._engines.running_hand_over(volume_id)  # a running pod's read-back: let it finish
        with self._locks.hold(volume_id):
            self._attempts.pop(volume_id, None)
            await finish_even_if_cancelled(self._streams.stop(volume_id))
            await self._engines.before_unpublish(volume_id, target)  # the pod has ended: its cache read back first
            await finish_even_if_cancelled(self._host.io(self._unmount, volume_id, target))
        return csi_pb2.NodeUnpublishVolumeResponse()

    def _unmount(self, volume_id: str, target: str) -> None:
        """Undo what this plugin did at `target`: its bind mounts of snapshots, the directory it made, the lease
        and record. Anything else there (a file, a foreign mount) is left as it is; the answer is OK all the same."""
        record = self._book.get(volume_id) or self._book.find_target(target)
        ours = record is not None and record.target_path == target
        self._targets.refuse_links(target)
        try:
            with self._targets.open_parent(target, create=False) as parent:
                count = self._host.unmount_ours(parent, target)
                foreign = mounts.top_mount_at(parent, "mount", target) if ours else None
        except TargetMissingError:
            count, foreign = 0, None
        if foreign is not None:  # ours may lie under it: keep the lease and record until it is gone
            raise MountError(errno.EBUSY, f"{target} has a mount that is not a weightcache snapshot on it "
                             f"({foreign.fstype} {foreign.source} {foreign.root}); unmount it, kubelet retries")
        if count or ours:
            mounts.remove_target(target)
        if record is None or ours:
            self._streams.views.remove(volume_id)  # a streaming view's links (the blobs stay: a snapshot's, or gc's)
            adapters.release_volume(self._store, volume_id)  # an adapter directory's leases
        if record is None:
            self._store.release(holder_for(volume_id))
        elif ours:
            self._store.release(record.holder)
            self._book.remove(record.volume_id)
        if count or ours:
            logger.info("unpublished volume %s at %s (%d mounts removed)", volume_id, target, count)
        else:
            logger.info("unpublish of volume %s: nothing of ours at %s; left it untouched", volume_id, target)


    # ---- stats, capabilities, info ----

    @quiet_rpc
    async def NodeGetVolumeStats(self, request: csi_pb2.NodeGetVolumeStatsRequest,
                                 context: grpc.aio.ServicerContext[Any, Any]) -> csi_pb2.NodeGetVolumeStatsResponse:
        volume_id = require_id(request.volume_id, "volume_id")
        if not request.volume_path:
            raise InvalidRequestError("volume_path", "is required")
        record = await self._host.io(self._book.get, volume_id)
        if record is None:
            raise VolumeNotFoundError(f"volume {volume_id} is not published on node {self._node_id}")
        if os.path.normpath(request.volume_path) != record.target_path:  # noqa: ASYNC240 - a string op, no I/O
            raise VolumeNotFoundError(f"volume {volume_id} is published at {record.target_path}, "
                                      f"not at {request.volume_path}")
        if record.kind in REPORTING and (scratch := await self._engines.usage(record)) is not None:
            return scratch
        if record.kind is VolumeKind.STREAM and not record.snapshot_id:  # still filling
            return await self._streams.usage(volume_id)
        snapshot = await self._host.io(self._store.get, record.snapshot_id)
        usage = [csi_pb2.VolumeUsage(total=snapshot.size, used=snapshot.size, available=0,
                                     unit=csi_pb2.VolumeUsage.BYTES)]
        if snapshot.files:
            usage.append(csi_pb2.VolumeUsage(total=len(snapshot.files), used=len(snapshot.files), available=0,
                                             unit=csi_pb2.VolumeUsage.INODES))
        return csi_pb2.NodeGetVolumeStatsResponse(usage=usage)

    @quiet_rpc
    async def NodeGetCapabilities(self, request: csi_pb2.NodeGetCapabilitiesRequest,
                                  context: grpc.aio.ServicerContext[Any, Any]) -> csi_pb2.NodeGetCapabilitiesResponse:
        rpc_cap = csi_pb2.NodeServiceCapability.RPC(type=csi_pb2.NodeServiceCapability.RPC.GET_VOLUME_STATS)
        return csi_pb2.NodeGetCapabilitiesResponse(capabilities=[csi_pb2.NodeServiceCapability(rpc=rpc_cap)])

    @quiet_rpc
    async def NodeGetInfo(self, request: csi_pb2.NodeGetInfoRequest,
                          context: grpc.aio.ServicerContext[Any, Any]) -> csi_pb2.NodeGetInfoResponse:
        return csi_pb2.NodeGetInfoResponse(node_id=self._node_id)

    # ---- not advertised ----

    @rpc
    async def NodeStageVolume(self, request: csi_pb2.NodeStageVolumeRequest,
                              context: grpc.aio.ServicerContext[Any, Any]) -> csi_pb2.NodeStageVolumeResponse:
        raise NotImplementedError("NodeStageVolume: weightcache does not advertise STAGE_UNSTAGE_VOLUME")

    @rpc
    async def NodeUnstageVolume(self, request: csi_pb2.NodeUnstageVolumeRequest,
                                context: grpc.aio.ServicerContext[Any, Any]) -> csi_pb2.NodeUnstageVolumeResponse:
        raise NotImplementedError("NodeUnstageVolume: weightcache does not advertise STAGE_UNSTAGE_VOLUME")

    @rpc
    async def NodeExpandVolume(self, request: csi_pb2.NodeExpandVolumeRequest,
                               context: grpc.aio.ServicerContext[Any, Any]) -> csi_pb2.NodeExpandVolumeResponse:
        raise NotImplementedError("NodeExpandVolume: model volumes are read-only snapshots and never expand")
