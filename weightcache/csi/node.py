"""CSI Node service: publish a cached model as a read-only ephemeral inline volume, unpublish it.

NodePublishVolume, as kubelet calls it for an inline volume:
  1. validate the request (INVALID_ARGUMENT naming the field) and read the pod's volumeAttributes;
  2. one operation per volume id at a time (ABORTED otherwise); a repeat of a finished publish is OK,
     the same id with other arguments is ALREADY_EXISTS;
  3. policy: may the pod's namespace read this model (PERMISSION_DENIED);
  4. ensure the model through the fetch engine, waiting a bounded time; past it answer UNAVAILABLE with the
     download's progress, leaving the download running so kubelet's retry joins it;
  5. with `tier: memory`, make the snapshot resident in the memory tier (its pages locked in place, so the pod's
     reads through the mount hit RAM); where the tier is off or full, the pod is served from disk and a warning
     is logged: a slower start beats a pod that never starts;
  6. lease `csi:<volume_id>`, write the volume record, bind-mount the snapshot ro,nosuid,nodev.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from weightcache.csi import mounts
from weightcache.csi._pb import csi_pb2, csi_pb2_grpc
from weightcache.csi.errors import quiet_rpc, rpc
from weightcache.csi.reconcile import VolumeBook, VolumeRecord, holder_for
from weightcache.errors import (
    FetchPendingError,
    InvalidReferenceError,
    InvalidRequestError,
    MemoryTierError,
    NotAllowedError,
    OperationPendingError,
    VolumeConflictError,
    VolumeNotFoundError,
)
from weightcache.fetch import Fetcher
from weightcache.memory import MemoryTier
from weightcache.policy import Decision
from weightcache.store import Snapshot, Store
from weightcache.uri import ModelRef, parse_ref

logger = logging.getLogger(__name__)

Policy = Callable[[str, str], Decision]  # (model uri, pod namespace) -> Decision
POD_NAMESPACE, POD_NAME, POD_UID = (f"csi.storage.k8s.io/pod.{k}" for k in ("namespace", "name", "uid"))
TIERS = ("disk", "memory")
MAX_ID_BYTES = 128  # the CSI spec's size limit for ids
MAX_TIMEOUT_S = 600.0
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m)?$")
_USERINFO = re.compile(r"//[^/@\s]*@")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}


@dataclass(frozen=True)
class PublishArgs:
    """A validated NodePublishVolume request."""

    volume_id: str
    target_path: str
    ref: ModelRef
    tier: str
    timeout: float | None  # seconds, from volume_context.timeout
    pod_namespace: str
    pod_name: str
    pod_uid: str

    def record(self, snapshot_id: str) -> VolumeRecord:
        return VolumeRecord(self.volume_id, self.target_path, str(self.ref), snapshot_id, self.tier,
                            self.pod_namespace, self.pod_name, self.pod_uid, time.time())

    def matches(self, record: VolumeRecord) -> bool:
        """Whether `record` is this very volume (a kubelet retry), not another use of the id."""
        if record.adopted:  # rebuilt from the mount table after a restart: only the target is known
            return record.target_path == self.target_path
        return (record.target_path, record.model, record.tier, record.pod_namespace, record.pod_name,
                record.pod_uid) == (self.target_path, str(self.ref), self.tier, self.pod_namespace, self.pod_name,
                                    self.pod_uid)


def _require_id(value: str, field: str) -> str:
    if not value:
        raise InvalidRequestError(field, "is required")
    if len(value.encode()) > MAX_ID_BYTES or "\0" in value:
        raise InvalidRequestError(field, f"must be at most {MAX_ID_BYTES} bytes without NUL")
    return value


def _require_path(value: str, field: str) -> str:
    if not value:
        raise InvalidRequestError(field, "is required")
    if "\0" in value or not os.path.isabs(value):
        raise InvalidRequestError(field, f"must be an absolute path, got {value!r}")
    return os.path.normpath(value)


def parse_timeout(text: str) -> float | None:
    if not text:
        return None
    match = _DURATION.match(text.strip())
    seconds = float(match[1]) * _UNIT[match[2]] if match else -1.0
    if not 0 <= seconds <= MAX_TIMEOUT_S:
        raise InvalidRequestError("volume_context.timeout",
                                  f"{text!r} is not a duration of at most {MAX_TIMEOUT_S:.0f}s; write e.g. \"30s\"")
    return seconds


def parse_publish(request: csi_pb2.NodePublishVolumeRequest) -> PublishArgs:
    """Validate a NodePublishVolume request, field by field in the spec's order (pure: no I/O)."""
    volume_id = _require_id(request.volume_id, "volume_id")
    target = _require_path(request.target_path, "target_path")
    if not request.HasField("volume_capability"):
        raise InvalidRequestError("volume_capability", "is required")
    capability = request.volume_capability
    if capability.HasField("block"):
        raise InvalidRequestError("volume_capability.block", "weightcache volumes are directories; use a "
                                  "filesystem (mount) volume")
    if capability.access_mode.mode == csi_pb2.VolumeCapability.AccessMode.UNKNOWN:
        raise InvalidRequestError("volume_capability.access_mode", "is required")
    if not request.readonly:
        raise InvalidRequestError("readonly", "weightcache volumes are read-only; set `readOnly: true` on the "
                                  "pod's csi volume")
    ctx = request.volume_context
    try:
        ref = parse_ref(ctx.get("model", ""), revision=ctx.get("revision") or None)
    except InvalidReferenceError as exc:
        # the reference may carry credentials (user:password@host): never echo them into events and logs
        message = _USERINFO.sub("//***@", str(exc))
        raise InvalidRequestError("volume_context.model",
                                  f"{message} (set it in the volume's volumeAttributes)") from None
    tier = ctx.get("tier") or "disk"
    if tier not in TIERS:
        raise InvalidRequestError("volume_context.tier", f"{tier!r} is not one of {', '.join(TIERS)}")
    namespace = ctx.get(POD_NAMESPACE, "")
    if not namespace:
        raise InvalidRequestError(f"volume_context.{POD_NAMESPACE}", "is missing; the CSIDriver "
                                  "csi.weightcache.io must have podInfoOnMount: true")
    return PublishArgs(volume_id, target, ref, tier, parse_timeout(ctx.get("timeout", "")), namespace,
                       ctx.get(POD_NAME, ""), ctx.get(POD_UID, ""))


class VolumeLocks:
    """One operation per volume id at a time; a second one is refused (ABORTED), not queued."""

    def __init__(self) -> None:
        self._busy: set[str] = set()

    @contextlib.contextmanager
    def hold(self, volume_id: str) -> Iterator[None]:
        if volume_id in self._busy:
            raise OperationPendingError(f"an operation on volume {volume_id} is already in progress; "
                                        "retry when it finishes")
        self._busy.add(volume_id)
        try:
            yield
        finally:
            self._busy.discard(volume_id)


class NodeServicer(csi_pb2_grpc.NodeServicer):
    def __init__(self, store: Store, fetcher: Fetcher, *, node_id: str, policy: Policy,
                 publish_timeout: float = 20.0, book: VolumeBook | None = None,
                 tier: MemoryTier | None = None) -> None:
        self._store = store
        self._tier = tier
        self._fetcher = fetcher
        self._node_id = node_id
        self._policy = policy
        self._publish_timeout = publish_timeout
        self._book = book or VolumeBook(store.root)
        self._locks = VolumeLocks()
        self._fetches: dict[ModelRef, asyncio.Future[Snapshot]] = {}

    # ---- publish / unpublish ----

    @rpc
    async def NodePublishVolume(self, request: csi_pb2.NodePublishVolumeRequest,
                                context: grpc.aio.ServicerContext) -> csi_pb2.NodePublishVolumeResponse:
        args = parse_publish(request)
        with self._locks.hold(args.volume_id):
            existing = await asyncio.to_thread(self._book.get, args.volume_id)
            if existing is not None:
                if not args.matches(existing):
                    raise VolumeConflictError(
                        f"volume {args.volume_id} is already published with model {existing.model} for "
                        f"{existing.describe()}; unpublish it first")
                if await asyncio.to_thread(mounts.mounted_at, args.target_path) is not None:
                    if existing.adopted:  # learn the pod and model again from kubelet's retry
                        await asyncio.to_thread(self._book.put, args.record(existing.snapshot_id))
                    return csi_pb2.NodePublishVolumeResponse()
            decision = self._policy(args.ref.uri, args.pod_namespace)
            if not decision.allowed:
                raise NotAllowedError(decision.reason)
            snapshot = await self._ensure(args.ref, self._wait_budget(args, context))
            await asyncio.to_thread(self._keep_resident, snapshot, args.tier)
            await asyncio.to_thread(self._mount, args.record(snapshot.id), snapshot)
        logger.info("published %s (snapshot %s) for pod %s/%s at %s", args.ref, snapshot.id,
                    args.pod_namespace, args.pod_name, args.target_path)
        return csi_pb2.NodePublishVolumeResponse()

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

    def _mount(self, record: VolumeRecord, snapshot: Snapshot) -> None:
        """Lease, record, then mount: a crash in between leaves a lease that reconcile settles."""
        self._store.lease(record.holder, snapshot.id)
        self._book.put(record)
        try:
            mounts.unmount(record.target_path)  # a stale mount from a crashed attempt; kubelet owns the path
            mounts.bind_readonly(snapshot.path, record.target_path)
        except BaseException:
            self._book.remove(record.volume_id)
            self._store.release(record.holder)
            raise

    def _wait_budget(self, args: PublishArgs, context: grpc.aio.ServicerContext) -> float:
        budget = args.timeout if args.timeout is not None else self._publish_timeout
        remaining = context.time_remaining()
        if remaining is not None:  # answer before the CO's deadline, so it sees our progress message
            budget = min(budget, max(remaining - 1.0, 0.0))
        return budget

    async def _ensure(self, ref: ModelRef, timeout: float) -> Snapshot:
        """Start or join the one fetch of `ref`; past `timeout` raise FetchPendingError and let it run on."""
        task = self._fetches.get(ref)
        if task is None:
            task = asyncio.ensure_future(asyncio.to_thread(self._fetcher.ensure, ref))
            self._fetches[ref] = task
            task.add_done_callback(lambda t: self._fetch_done(ref, t))
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            progress = self._fetcher.progress(ref)
            text = progress.describe() if progress is not None else f"fetching {ref}: starting"
            raise FetchPendingError(f"{text}; the volume is published when the download completes "
                                    "(kubelet retries)") from None

    def _fetch_done(self, ref: ModelRef, task: asyncio.Future[Snapshot]) -> None:
        if self._fetches.get(ref) is task:
            del self._fetches[ref]
        if not task.cancelled() and task.exception() is not None:  # also marks it retrieved
            logger.warning("fetching %s failed: %s", ref, task.exception())

    @rpc
    async def NodeUnpublishVolume(self, request: csi_pb2.NodeUnpublishVolumeRequest,
                                  context: grpc.aio.ServicerContext) -> csi_pb2.NodeUnpublishVolumeResponse:
        volume_id = _require_id(request.volume_id, "volume_id")
        target = _require_path(request.target_path, "target_path")
        with self._locks.hold(volume_id):
            await asyncio.to_thread(self._unmount, volume_id, target)
        return csi_pb2.NodeUnpublishVolumeResponse()

    def _unmount(self, volume_id: str, target: str) -> None:
        record = self._book.get(volume_id) or self._book.find_target(target)
        count = mounts.unmount(target)
        mounts.remove_target(target)
        if record is None:
            self._store.release(holder_for(volume_id))
        elif record.target_path == target:
            self._store.release(record.holder)
            self._book.remove(record.volume_id)
        logger.info("unpublished volume %s at %s (%d mounts removed)", volume_id, target, count)

    # ---- stats, capabilities, info ----

    @quiet_rpc
    async def NodeGetVolumeStats(self, request: csi_pb2.NodeGetVolumeStatsRequest,
                                 context: grpc.aio.ServicerContext) -> csi_pb2.NodeGetVolumeStatsResponse:
        volume_id = _require_id(request.volume_id, "volume_id")
        if not request.volume_path:
            raise InvalidRequestError("volume_path", "is required")
        record = await asyncio.to_thread(self._book.get, volume_id)
        if record is None:
            raise VolumeNotFoundError(f"volume {volume_id} is not published on node {self._node_id}")
        if os.path.normpath(request.volume_path) != record.target_path:
            raise VolumeNotFoundError(f"volume {volume_id} is published at {record.target_path}, "
                                      f"not at {request.volume_path}")
        snapshot = await asyncio.to_thread(self._store.get, record.snapshot_id)
        usage = [csi_pb2.VolumeUsage(total=snapshot.size, used=snapshot.size, available=0,
                                     unit=csi_pb2.VolumeUsage.BYTES)]
        if snapshot.files:
            usage.append(csi_pb2.VolumeUsage(total=len(snapshot.files), used=len(snapshot.files), available=0,
                                             unit=csi_pb2.VolumeUsage.INODES))
        return csi_pb2.NodeGetVolumeStatsResponse(usage=usage)

    @quiet_rpc
    async def NodeGetCapabilities(self, request: csi_pb2.NodeGetCapabilitiesRequest,
                                  context: grpc.aio.ServicerContext) -> csi_pb2.NodeGetCapabilitiesResponse:
        rpc_cap = csi_pb2.NodeServiceCapability.RPC(type=csi_pb2.NodeServiceCapability.RPC.GET_VOLUME_STATS)
        return csi_pb2.NodeGetCapabilitiesResponse(capabilities=[csi_pb2.NodeServiceCapability(rpc=rpc_cap)])

    @quiet_rpc
    async def NodeGetInfo(self, request: csi_pb2.NodeGetInfoRequest,
                          context: grpc.aio.ServicerContext) -> csi_pb2.NodeGetInfoResponse:
        return csi_pb2.NodeGetInfoResponse(node_id=self._node_id)

    # ---- not advertised ----

    @rpc
    async def NodeStageVolume(self, request: csi_pb2.NodeStageVolumeRequest,
                              context: grpc.aio.ServicerContext) -> csi_pb2.NodeStageVolumeResponse:
        raise NotImplementedError("NodeStageVolume: weightcache does not advertise STAGE_UNSTAGE_VOLUME")

    @rpc
    async def NodeUnstageVolume(self, request: csi_pb2.NodeUnstageVolumeRequest,
                                context: grpc.aio.ServicerContext) -> csi_pb2.NodeUnstageVolumeResponse:
        raise NotImplementedError("NodeUnstageVolume: weightcache does not advertise STAGE_UNSTAGE_VOLUME")

    @rpc
    async def NodeExpandVolume(self, request: csi_pb2.NodeExpandVolumeRequest,
                               context: grpc.aio.ServicerContext) -> csi_pb2.NodeExpandVolumeResponse:
        raise NotImplementedError("NodeExpandVolume: model volumes are read-only snapshots and never expand")
