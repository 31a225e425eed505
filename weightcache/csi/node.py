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
the plugin's own small pool, so Probe, unpublish and a cached publish answer while downloads run; the read-back of
a pod's engine cache (as long as the pod wrote, up to 4 GiB) runs on a pool of its own, so they answer while
read-backs run too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from weightcache import engine_cache
from weightcache.access import Authority, Grant, Requester
from weightcache.csi import mounts
from weightcache.csi._pb import csi_pb2, csi_pb2_grpc
from weightcache.csi.errors import quiet_rpc, rpc
from weightcache.csi.reconcile import SnapshotMounts, VolumeBook, VolumeRecord
from weightcache.csi.stream import StreamFill, fail_view
from weightcache.csi.targets import KubeletTargets, TargetMissingError
from weightcache.csi.telemetry import ObserveCompile, Pod, PodEvent, PodTelemetry
from weightcache.engine_name import EngineName
from weightcache.errors import (
    FetchPendingError,
    InvalidReferenceError,
    InvalidRequestError,
    MemoryTierError,
    MountError,
    OperationPendingError,
    VolumeConflictError,
    VolumeNotFoundError,
    WeightcacheError,
)
from weightcache.fetch import FetchCancelledError
from weightcache.fetch_queue import FetchQueue
from weightcache.hf_layout import hub_cache
from weightcache.memory import MemoryTier
from weightcache.store import Snapshot, Store, StreamViews
from weightcache.store.holders import csi_holder as holder_for
from weightcache.uri import ModelRef, parse_globs, parse_ref, validate_repo_id
from weightcache.vocabulary import (
    ENGINE_CACHE_ATTRIBUTE,
    STAGE_MODEL_ON_NODE,
    STAGE_VOLUME_PUBLISHED,
    STREAM_ATTRIBUTE,
)

logger = logging.getLogger(__name__)

POD_NAMESPACE, POD_NAME, POD_UID = (f"csi.storage.k8s.io/pod.{k}" for k in ("namespace", "name", "uid"))
TIERS = ("disk", "memory")
MAX_ID_BYTES = 128  # the CSI spec's size limit for ids
MAX_TIMEOUT_S = 600.0
CSI_TIMEOUT_S = 120.0  # kubelet's csiTimeout (pkg/volume/csi/csi_plugin.go): how long it waits for one call
DEADLINE_MARGIN_S = 1.0  # answer this long before the caller's deadline, so it reads our progress, not a timeout
READBACKS = 2  # engine-cache read-backs at once; more wait their turn, on their own pool
MAX_ATTEMPTS = 4096  # volumes whose first publish attempt is remembered (a pod deleted mid-retry is never unpublished)
T = TypeVar("T")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m)?$")
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
    hf_repo: str | None = None  # volume_context.hfRepo: mount the snapshot as a hub cache for this repo
    engine_cache: EngineName | None = None  # volume_context.engineCache: the pod's engine cache, not the model
    readonly: bool = True
    stream: bool = False  # volume_context.stream: on a miss, a view that fills while the model downloads

    @property
    def pod(self) -> Pod:
        return Pod(self.pod_namespace, self.pod_name, self.pod_uid)

    def record(self, snapshot_id: str, *, handover: bool = False) -> VolumeRecord:
        return VolumeRecord(self.volume_id, self.target_path, str(self.ref), snapshot_id, self.tier,
                            self.pod_namespace, self.pod_name, self.pod_uid, time.time(),
                            engine_cache=str(self.engine_cache or ""), handover=handover, stream=self.stream,
                            include=self.ref.include, exclude=self.ref.exclude)

    def matches(self, record: VolumeRecord) -> bool:
        """Whether `record` is this very volume (a kubelet retry), not another use of the id."""
        if record.adopted:  # rebuilt from the mount table after a restart: only the target is known
            return record.target_path == self.target_path
        return (record.target_path, record.model, record.tier, record.pod_namespace, record.pod_name,
                record.pod_uid, record.engine_cache, record.stream) == (
                    self.target_path, str(self.ref), self.tier, self.pod_namespace, self.pod_name, self.pod_uid,
                    str(self.engine_cache or ""), self.stream)


def _require_id(value: str, field: str) -> str:
    if not value:
        raise InvalidRequestError(field, "is required")
    if len(value.encode()) > MAX_ID_BYTES or "\0" in value:
        raise InvalidRequestError(field, f"must be at most {MAX_ID_BYTES} bytes without NUL")
    return value


def _require_path(value: str, field: str) -> str:
    """Present, absolute, without NUL; not normalised: a `..` must be seen (and refused), not resolved."""
    if not value:
        raise InvalidRequestError(field, "is required")
    if "\0" in value or not os.path.isabs(value):
        raise InvalidRequestError(field, f"must be an absolute path, got {value!r}")
    return value


def parse_timeout(text: str) -> float | None:
    """volume_context.timeout: at most how long one publish waits for a download (a cached model never waits)."""
    if not text:
        return None
    match = _DURATION.match(text.strip())
    seconds = float(match[1]) * _UNIT[match[2]] if match else -1.0
    if not 0 < seconds <= MAX_TIMEOUT_S:
        raise InvalidRequestError("volume_context.timeout",
                                  f"{text!r} is not a duration more than 0 and at most {MAX_TIMEOUT_S:.0f}s; write "
                                  "e.g. \"30s\", or leave it out to wait as long as kubelet does")
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
    ctx = request.volume_context
    engine = _engine_cache(ctx.get(ENGINE_CACHE_ATTRIBUTE, ""))
    if not request.readonly and engine is None:  # only an engine cache's private scratch is ever writable
        raise InvalidRequestError("readonly", "weightcache volumes are read-only; set `readOnly: true` on the "
                                  f"pod's csi volume (only a volume with {ENGINE_CACHE_ATTRIBUTE} may be writable)")
    globs = {}
    for field in ("include", "exclude"):  # docs/csi.md: a JSON list or comma-separated globs
        try:
            globs[field] = parse_globs(ctx.get(field, ""), field)
        except InvalidReferenceError as exc:
            raise InvalidRequestError(f"volume_context.{field}", str(exc)) from None
    try:
        ref = parse_ref(ctx.get("model", ""), revision=ctx.get("revision") or None, include=globs["include"],
                        exclude=globs["exclude"])
    except InvalidReferenceError as exc:  # its message is already redacted (uri._fail)
        raise InvalidRequestError("volume_context.model",
                                  f"{exc} (set it in the volume's volumeAttributes)") from None
    tier = ctx.get("tier") or "disk"
    if tier not in TIERS:
        raise InvalidRequestError("volume_context.tier", f"{tier!r} is not one of {', '.join(TIERS)}")
    hf_repo = ctx.get("hfRepo") or None
    if hf_repo is not None:
        try:
            validate_repo_id(hf_repo)
        except InvalidReferenceError as exc:
            raise InvalidRequestError("volume_context.hfRepo", str(exc)) from None
        if engine is not None:
            raise InvalidRequestError("volume_context.hfRepo", f"is for a model volume; a volume with "
                                      f"{ENGINE_CACHE_ATTRIBUTE} holds an engine's compile cache, not the model")
    stream = ctx.get(STREAM_ATTRIBUTE, "") or "false"
    if stream not in ("true", "false"):
        raise InvalidRequestError(f"volume_context.{STREAM_ATTRIBUTE}", f"{stream!r} is not \"true\" or \"false\"")
    if stream == "true":  # docs/streaming-pods.md: a plain tree of verified files, nothing built from the whole
        clash = ("engineCache" if engine is not None else "hfRepo" if hf_repo is not None else
                 "tier: memory" if tier == "memory" else None)
        if clash is not None:
            raise InvalidRequestError(f"volume_context.{STREAM_ATTRIBUTE}", f"cannot be \"true\" with {clash}: "
                                      "a streaming view holds the model's files as they arrive; remove one of the two")
    namespace = ctx.get(POD_NAMESPACE, "")
    if not namespace:
        raise InvalidRequestError(f"volume_context.{POD_NAMESPACE}", "is missing; the CSIDriver "
                                  "csi.weightcache.io must have podInfoOnMount: true")
    return PublishArgs(volume_id, target, ref, tier, parse_timeout(ctx.get("timeout", "")), namespace,
                       ctx.get(POD_NAME, ""), ctx.get(POD_UID, ""), hf_repo, engine, bool(request.readonly),
                       stream == "true")


def _engine_cache(text: str) -> EngineName | None:
    """volume_context.engineCache: `vllm-0.32.0-cpu` (docs/engine-caches.md), or None for a model volume."""
    if not text:
        return None
    try:
        return EngineName.parse(text)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"volume_context.{ENGINE_CACHE_ATTRIBUTE}",
                                  f"{str(exc).removeprefix('engine cache: ')} (set it in the volume's "
                                  "volumeAttributes, or remove it for a model volume)") from None


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


async def finish_even_if_cancelled(work: Awaitable[T]) -> T:
    """Await `work` to its end even when our caller is cancelled meanwhile (then re-raise the cancellation):
    a mount begun is finished and recorded before the volume's lock is let go."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait({task})
        raise


class NodeServicer(csi_pb2_grpc.NodeServicer):
    """`pool` runs the plugin's blocking work (records, mounts, stats); `observe(method, seconds, code)` is told
    about every call and `observe_stage(stage, seconds, cache)` about each pod's cold-start stages (the daemon's
    metrics), `pod_event` writes them as Events on the pod and `observe_compile` hears what each pod's engine did
    with the compile cache it was handed (csi/telemetry.py)."""

    def __init__(self, store: Store, fetches: FetchQueue, *, node_id: str, authority: Authority,
                 kubelet_dir: str | Path, publish_timeout: float = CSI_TIMEOUT_S, book: VolumeBook | None = None,
                 tier: MemoryTier | None = None, pool: ThreadPoolExecutor | None = None,
                 observe: Callable[[str, float, str], None] | None = None,
                 observe_stage: Callable[[str, float, str], None] | None = None,
                 engine_limits: engine_cache.EngineCacheLimits | None = None,
                 pod_event: PodEvent | None = None, observe_compile: ObserveCompile | None = None) -> None:
        self._store = store
        self._tier = tier
        self._fetches = fetches
        self._node_id = node_id
        self._authority = authority
        self._targets = KubeletTargets(kubelet_dir)
        self._publish_timeout = publish_timeout
        self._book = book or VolumeBook(store.root)
        self._locks = VolumeLocks()
        self._handing: dict[str, asyncio.Future[bool]] = {}  # volume id -> its running hand-over
        self._views = StreamViews(store.layout)
        self._streams: dict[str, tuple[StreamFill, asyncio.Task[None]]] = {}  # volume id -> its view's filling
        self._pool = pool or ThreadPoolExecutor(4, thread_name_prefix="wc-csi")
        self._readbacks = ThreadPoolExecutor(READBACKS, thread_name_prefix="wc-csi-readback")
        self._engine_limits = engine_limits or engine_cache.EngineCacheLimits()
        self.observe = observe
        self._telemetry = PodTelemetry(observe_stage=observe_stage, pod_event=pod_event,
                                       observe_compile=observe_compile)
        # volume id -> monotonic time of kubelet's first publish of it: a cold model's wait spans kubelet's retries
        self._attempts: dict[str, float] = {}

    async def _io(self, fn: Callable[..., T], *args: object) -> T:
        """Blocking work on the plugin's own pool (never queued behind downloads or API requests)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    async def _read_back(self, volume_id: str) -> bool:
        """`_hand_over_running` on the read-backs' own pool: a pod's cache of gigabytes never holds a thread that
        publish, unpublish and stats need."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._readbacks, self._hand_over_running, volume_id)

    # ---- publish / unpublish ----

    @rpc
    async def NodePublishVolume(self, request: csi_pb2.NodePublishVolumeRequest,
                                context: grpc.aio.ServicerContext[Any, Any]) -> csi_pb2.NodePublishVolumeResponse:
        args = parse_publish(request)
        await self._io(self._targets.refuse_links, args.target_path)
        with self._locks.hold(args.volume_id):
            existing = await self._io(self._book.get, args.volume_id)
            if existing is not None:
                if not args.matches(existing):
                    raise VolumeConflictError(
                        f"volume {args.volume_id} is already published with model {existing.model} for "
                        f"{existing.describe()}; unpublish it first")
                if await self._io(self._is_mounted, args.target_path):
                    if existing.adopted:  # learn the pod and model again from kubelet's retry
                        await self._io(self._book.put, args.record(existing.snapshot_id))
                    return csi_pb2.NodePublishVolumeResponse()
            retry = args.volume_id in self._attempts  # an earlier attempt waited: a miss, whatever this one finds
            self._telemetry.first_attempt(args.pod)
            started = self._first_attempt(args.volume_id)
            grant = self._authority.authorize(args.ref, Requester(args.pod_namespace))  # weightcache/access.py
            if args.stream:  # a miss does not wait: the pod gets a view that fills as the files arrive
                cached = await self._fetches.lookup(grant)
                if cached is None:
                    record = args.record("")
                    await finish_even_if_cancelled(self._io(self._mount_view, record))
                    self._start_stream(record, grant)
                    self._attempts.pop(args.volume_id, None)  # no stages: the model lands after the volume
                    logger.info("published a streaming view of %s for pod %s/%s at %s", args.ref,
                                args.pod_namespace, args.pod_name, args.target_path)
                    return csi_pb2.NodePublishVolumeResponse()
                snapshot, hit = cached, True
            else:
                snapshot, hit = await self._ensure(args, grant, context)
            model_s, hit = time.monotonic() - started, hit and not retry
            if args.engine_cache is not None:  # the key's model snapshot is the one this grant resolves to
                await finish_even_if_cancelled(self._io(self._mount_engine_cache, args, grant, snapshot))
                self._attempts.pop(args.volume_id, None)  # the pod's model volume counts its stages, not this
                return csi_pb2.NodePublishVolumeResponse()
            await asyncio.to_thread(self._keep_resident, snapshot, args.tier)  # long (page locking): not our pool
            await finish_even_if_cancelled(self._io(self._mount, args.record(snapshot.id), snapshot, args.hf_repo,
                                                            args.ref.revision))
        self._published(args, snapshot, hit, model_s, time.monotonic() - self._attempts.pop(args.volume_id, started))
        return csi_pb2.NodePublishVolumeResponse()

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

    def _mount_engine_cache(self, args: PublishArgs, grant: Grant, model: Snapshot) -> None:
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
            self._mount(args.record(found.id), found)
        else:
            record = args.record((found or model).id, handover=found is None and not args.readonly)
            self._store.lease(record.holder, record.snapshot_id)
            self._book.put(record)
            try:
                size, inodes = engine_cache.scratch_bounds(self._engine_limits, found)
                with self._targets.open_parent(record.target_path, create=True) as parent:
                    self._unmount_ours(parent, record.target_path)  # a stale mount of ours from a crashed attempt
                    if args.readonly:
                        mounts.tmpfs_at(parent, "mount", record.target_path, size_bytes=1 << 20, inodes=16,
                                        readonly=True)
                    elif found is None:
                        mounts.tmpfs_at(parent, "mount", record.target_path, size_bytes=size, inodes=inodes)
                    else:
                        metacopy = mounts.overlay_at(parent, "mount", record.target_path, found.path,
                                                     size_bytes=size, inodes=inodes)
                        engine_cache.open_up(found, f"/proc/self/fd/{parent}/mount", files=metacopy)
            except BaseException:
                with contextlib.suppress(TargetMissingError), \
                        self._targets.open_parent(record.target_path, create=False) as parent:
                    self._unmount_ours(parent, record.target_path)
                self._book.remove(record.volume_id)
                self._store.release(record.holder)
                raise
        logger.info("published engine cache %s of %s for pod %s/%s at %s: %s", args.engine_cache, args.ref,
                    args.pod_namespace, args.pod_name, args.target_path,
                    f"snapshot {found.id[:12]}" if found else "none yet, started empty")

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

    def _mount(self, record: VolumeRecord, snapshot: Snapshot, hf_repo: str | None = None,
               revision: str | None = None) -> None:
        """Lease, record, then mount: a crash in between leaves a lease that reconcile settles. With `hf_repo` the
        source is the snapshot's hub cache layout (weightcache.hf_layout: hard links, built once), where the
        reference's `revision` (a branch or tag) resolves too."""
        self._store.lease(record.holder, snapshot.id)
        self._book.put(record)
        try:
            source = snapshot.path
            if hf_repo is not None:
                source = hub_cache(self._store, snapshot, hf_repo, refs=(revision,) if revision else ())
            self._bind(source, record.target_path)
        except BaseException:
            self._book.remove(record.volume_id)
            self._store.release(record.holder)
            raise

    def _bind(self, source: Path, target: str) -> None:
        """Bind `source` read-only on `target`, walked once; a stale mount of ours from a crashed attempt goes first."""
        with self._targets.open_parent(target, create=True) as parent:
            self._unmount_ours(parent, target)
            mounts.bind_readonly_at(source, parent, "mount", target)

    # ---- streaming views (csi/stream.py, docs/streaming-pods.md) ----

    def _mount_view(self, record: VolumeRecord) -> None:
        """Record, make the view (state `fetching`, nothing listed yet), bind it read-only on the target. No lease
        yet: there is no snapshot to hold; the view's own hard links keep its blobs."""
        self._book.put(record)
        try:
            self._bind(self._views.create(record.volume_id), record.target_path)
        except BaseException:
            self._book.remove(record.volume_id)
            self._views.remove(record.volume_id)
            raise

    def _start_stream(self, record: VolumeRecord, grant: Grant) -> None:
        fill = StreamFill(self._views, record.volume_id, grant)
        task = asyncio.ensure_future(self._fill(fill, record))
        self._streams[record.volume_id] = (fill, task)
        task.add_done_callback(lambda _: self._streams.pop(record.volume_id, None)
                               if self._streams.get(record.volume_id, (None, None))[1] is task else None)

    async def _fill(self, fill: StreamFill, record: VolumeRecord) -> None:
        """Join the model's one fetch as a file subscriber (kept: it goes on when the pod goes); once the snapshot
        is published, lease it for the volume and record its id, so eviction and gc see a mounted snapshot."""
        try:
            snapshot = await self._fetches.fetch(fill.grant, keep=True, on_file=fill.on_file)
        except Exception as exc:
            if isinstance(exc, FetchCancelledError) and self._fetches.closing:
                return  # the daemon stops: the view stays `fetching`, and the next start resumes it
            await self._io(fill.fail, exc)
            return
        await finish_even_if_cancelled(self._io(self._complete_stream, fill, record, snapshot))

    def _complete_stream(self, fill: StreamFill, record: VolumeRecord, snapshot: Snapshot) -> None:
        if not fill.complete(snapshot):
            return
        try:
            self._store.lease(record.holder, snapshot.id)
        except WeightcacheError as exc:  # evicted in the instant since it was published: the view's links hold it
            logger.warning("streaming volume %s: could not lease snapshot %s: %s", record.volume_id, snapshot.id,
                           exc)
            return
        self._book.put(dataclasses.replace(record, snapshot_id=snapshot.id))
        logger.info("streaming volume %s is complete: snapshot %s (%d files)", record.volume_id, snapshot.id[:12],
                    len(snapshot.files))

    async def _stop_stream(self, volume_id: str) -> None:
        """Unpublish: stop filling the view (the fetch goes on for its other callers and the cache)."""
        running = self._streams.pop(volume_id, None)
        if running is None:
            return
        fill, task = running
        await self._io(fill.close)  # waits out a link in progress on the engine's thread
        task.cancel()
        await asyncio.wait({task})

    async def resume_streams(self) -> None:
        """After a restart (reconcile kept only mounted volumes): fill again every streaming view whose snapshot
        is not published yet. The grant is decided anew for the pod's namespace, as at publish: a refusal now
        fails the view with the refusal's words."""
        for record in await self._io(self._book.all):
            if not record.stream or record.snapshot_id or record.volume_id in self._streams:
                continue
            try:
                ref = parse_ref(record.model, include=record.include, exclude=record.exclude)
                grant = self._authority.authorize(ref, Requester(record.pod_namespace))
            except WeightcacheError as exc:
                await self._io(fail_view, self._views, record.volume_id, exc)
                continue
            self._start_stream(record, grant)
            logger.info("resumed filling streaming volume %s of %s for pod %s/%s", record.volume_id, ref,
                        record.pod_namespace, record.pod_name)

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
        volume_id = _require_id(request.volume_id, "volume_id")
        target = _require_path(request.target_path, "target_path")
        self._targets.check(target)
        if (handing := self._handing.get(volume_id)) is not None:  # a running pod's read-back: let it finish
            await asyncio.wait({handing})
        with self._locks.hold(volume_id):
            self._attempts.pop(volume_id, None)
            await finish_even_if_cancelled(self._stop_stream(volume_id))
            if (record := await self._io(self._book.get, volume_id)) is not None and record.engine_cache:
                await self._io(self._engine_report, record)  # what the pod's engine said last
            if await self._io(self._due, volume_id, target):  # the pod has ended: its cache, read back first
                await finish_even_if_cancelled(self._read_back(volume_id))
            await finish_even_if_cancelled(self._io(self._unmount, volume_id, target))
        return csi_pb2.NodeUnpublishVolumeResponse()

    def _unmount(self, volume_id: str, target: str) -> None:
        """Undo what this plugin did at `target`: its bind mounts of snapshots, the directory it made, the lease
        and record. Anything else there (a file, a foreign mount) is left as it is; the answer is OK all the same."""
        record = self._book.get(volume_id) or self._book.find_target(target)
        ours = record is not None and record.target_path == target
        self._targets.refuse_links(target)
        try:
            with self._targets.open_parent(target, create=False) as parent:
                count = self._unmount_ours(parent, target)
                foreign = mounts.top_mount_at(parent, "mount", target) if ours else None
        except TargetMissingError:
            count, foreign = 0, None
        if foreign is not None:  # ours may lie under it: keep the lease and record until it is gone
            raise MountError(errno.EBUSY, f"{target} has a mount that is not a weightcache snapshot on it "
                             f"({foreign.fstype} {foreign.source} {foreign.root}); unmount it, kubelet retries")
        if count or ours:
            mounts.remove_target(target)
        if record is None or ours:
            self._views.remove(volume_id)  # a streaming view's links (the blobs stay: a snapshot's, or gc's)
        if record is None:
            self._store.release(holder_for(volume_id))
        elif ours:
            self._store.release(record.holder)
            self._book.remove(record.volume_id)
        if count or ours:
            logger.info("unpublished volume %s at %s (%d mounts removed)", volume_id, target, count)
        else:
            logger.info("unpublish of volume %s: nothing of ours at %s; left it untouched", volume_id, target)

    def _hand_over(self, record: VolumeRecord, parent: int) -> None:
        """The pod has ended: publish what it wrote into its engine cache scratch under its namespace's trust
        domain and the key fixed at publish (the model snapshot its grant resolved to), if it says its engine
        served (engine_cache.hand_over). Its bytes are hostile: read without following links, within the bounds.
        A refusal costs only this pod's cache: it is logged and the unpublish goes on (a pod must not be stuck
        terminating because of what it wrote)."""
        entry = mounts.top_mount_at(parent, "mount", record.target_path)
        if entry is None or not mounts.is_scratch(entry) or entry.fstype != "tmpfs":  # not a hit's overlay
            return
        try:
            key = engine_cache.EngineCacheKey(record.snapshot_id, EngineName.parse(record.engine_cache),
                                              record.pod_namespace)
            snapshot = engine_cache.hand_over(self._store, key, f"/proc/self/fd/{parent}/mount", self._engine_limits)
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

    def _is_mounted(self, target: str) -> bool:
        try:
            with self._targets.open_parent(target, create=False) as parent:
                return mounts.top_mount_at(parent, "mount", target) is not None
        except TargetMissingError:
            return False

    def _unmount_ours(self, parent: int, target: str) -> int:
        """Unmount the snapshot bind mounts stacked on `target` (directory "mount" of the walked `parent` fd), down
        to the first mount that is not ours. Each mount is checked and unmounted through the same parent fd, so a
        path swapped meanwhile cannot redirect the unmount."""
        count = 0
        while True:
            entry = mounts.top_mount_at(parent, "mount", target)
            snapshots = SnapshotMounts.of(self._store, mounts.mount_table())
            scratch = entry is not None and mounts.is_scratch(entry)
            if entry is None or (not scratch and (snapshots is None or not snapshots.is_ours(entry))):
                if entry is not None and count == 0:
                    logger.warning("%s is a mount point that is not a weightcache snapshot; not unmounting it",
                                   target)
                return count
            if not mounts.unmount_top_at(parent, "mount", target):
                return count
            count += 1

    # ---- stats, capabilities, info ----

    @quiet_rpc
    async def NodeGetVolumeStats(self, request: csi_pb2.NodeGetVolumeStatsRequest,
                                 context: grpc.aio.ServicerContext[Any, Any]) -> csi_pb2.NodeGetVolumeStatsResponse:
        volume_id = _require_id(request.volume_id, "volume_id")
        if not request.volume_path:
            raise InvalidRequestError("volume_path", "is required")
        record = await self._io(self._book.get, volume_id)
        if record is None:
            raise VolumeNotFoundError(f"volume {volume_id} is not published on node {self._node_id}")
        if os.path.normpath(request.volume_path) != record.target_path:  # noqa: ASYNC240 - a string op, no I/O
            raise VolumeNotFoundError(f"volume {volume_id} is published at {record.target_path}, "
                                      f"not at {request.volume_path}")
        if record.engine_cache and not await self._io(self._is_view, record):
            await self._io(self._engine_report, record)
            if record.handover:  # kubelet asks about a running pod's volumes every minute: its ready file counts now
                self._start_hand_over(record.volume_id)
            return csi_pb2.NodeGetVolumeStatsResponse(usage=await self._io(self._scratch_usage, record))
        if record.stream and not record.snapshot_id:  # still filling: what the view holds so far
            fill = self._streams.get(volume_id)
            size, files = await self._io(fill[0].usage) if fill is not None else (0, 0)
            return csi_pb2.NodeGetVolumeStatsResponse(usage=[
                csi_pb2.VolumeUsage(total=size, used=size, available=0, unit=csi_pb2.VolumeUsage.BYTES),
                csi_pb2.VolumeUsage(total=files, used=files, available=0, unit=csi_pb2.VolumeUsage.INODES)])
        snapshot = await self._io(self._store.get, record.snapshot_id)
        usage = [csi_pb2.VolumeUsage(total=snapshot.size, used=snapshot.size, available=0,
                                     unit=csi_pb2.VolumeUsage.BYTES)]
        if snapshot.files:
            usage.append(csi_pb2.VolumeUsage(total=len(snapshot.files), used=len(snapshot.files), available=0,
                                             unit=csi_pb2.VolumeUsage.INODES))
        return csi_pb2.NodeGetVolumeStatsResponse(usage=usage)

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
                if not await self._io(self._due, volume_id):  # told on the plugin's pool: a stat or two
                    return False
                return await finish_even_if_cancelled(self._read_back(volume_id))
        except OperationPendingError:
            return False

    def _due(self, volume_id: str, target: str | None = None) -> bool:
        """Whether the engine cache volume `volume_id` (at `target`, when given) is to be read back now: it started
        empty, was not read back yet, and its scratch holds the ready file."""
        return self._due_record(volume_id, target) is not None

    def _due_record(self, volume_id: str, target: str | None = None) -> VolumeRecord | None:
        record = self._book.get(volume_id)
        if record is None or not record.handover or not record.engine_cache or \
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
        self._book.put(dataclasses.replace(record, handover=False))
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
