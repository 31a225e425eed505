"""Filling one streaming volume's view while its model downloads (docs/streaming-pods.md).

A streaming publish (volume attribute `stream: "true"`, no cached snapshot) mounts `streams/<volume id>/` read-only
on the target at once and hands a `StreamFill` to the model's one fetch as a file subscriber (weightcache/
fetch_queue.py). Each file the volume's grant allows is linked into the view once it is verified and durable; the
state file (`.weightcache/state`) lists the files the view will hold as soon as the listing is known, then says
`complete` (every file of the published snapshot linked) or `failed` (with the error text the CLI prints).

The fill is told of files on the fetch engine's thread and completed on the plugin's pool: one lock orders both,
and `close` (unpublish) makes every later call a no-op, so nothing is linked into a view being removed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading

from weightcache.access import Authority, Grant, Requester
from weightcache.csi._pb import csi_pb2
from weightcache.csi.reconcile import VolumeKind, VolumeRecord
from weightcache.csi.volumes import VolumeHost, finish_even_if_cancelled
from weightcache.errors import FetchCancelledError, PolicyNotListedError, WeightcacheError
from weightcache.fetch import DurableFile
from weightcache.fetch_queue import FetchQueue
from weightcache.redact import redact
from weightcache.store import Snapshot, StreamViews
from weightcache.uri import parse_ref
from weightcache.vocabulary import STREAM_COMPLETE, STREAM_DIR, STREAM_FAILED, STREAM_FETCHING

logger = logging.getLogger(__name__)


class StreamFill:
    """The view of volume `volume_id`, filled with the files `grant` allows."""

    def __init__(self, views: StreamViews, volume_id: str, grant: Grant) -> None:
        self.volume_id, self.grant = volume_id, grant
        self._views = views
        self._lock = threading.Lock()
        self._closed = False
        self._failed = False
        self._planned: list[str] | None = None
        self._linked: dict[str, int] = {}  # relpath -> size

    def on_file(self, durable: DurableFile) -> None:
        """The fetch queue's file subscriber (the engine's thread): link the file, list the plan on the first."""
        entry = durable.entry
        with self._lock:
            if self._closed or self._failed:
                return
            try:
                if self._planned is None:
                    self._planned = sorted(p for p in durable.planned if self._shown(p))
                    self._views.write_state(self.volume_id, STREAM_FETCHING, self._planned)
                if self._shown(entry.path):  # a file of the same fetch the grant leaves out: never
                    self._link(entry.path, entry.sha256, entry.size)
            except (OSError, WeightcacheError) as exc:
                self._fail_locked(exc)

    def complete(self, snapshot: Snapshot) -> bool:
        """The snapshot is published: link what is not linked yet, state `complete`. False when the view was
        closed or has failed meanwhile (then nothing changes)."""
        with self._lock:
            if self._closed or self._failed:
                return False
            try:
                files = [f for f in snapshot.files if self._shown(f.path)]
                for f in files:
                    self._link(f.path, f.sha256, f.size)
                self._views.write_state(self.volume_id, STREAM_COMPLETE, [f.path for f in files])
            except (OSError, WeightcacheError) as exc:
                self._fail_locked(exc)
                return False
            return True

    def fail(self, exc: BaseException) -> None:
        """The fetch failed: the state says so with its error text; the view keeps what it has."""
        with self._lock:
            if not self._closed and not self._failed:
                self._fail_locked(exc)

    def close(self) -> None:
        """Unpublish: from now on nothing is linked or written."""
        with self._lock:
            self._closed = True

    def usage(self) -> tuple[int, int]:
        """(bytes, files) linked so far."""
        with self._lock:
            return sum(self._linked.values()), len(self._linked)

    def _shown(self, relpath: str) -> bool:
        """In the view: the grant selects it, and it is not under the view's own `.weightcache/` (a model's file
        there is left out, so a source cannot plant a state of its own)."""
        return self.grant.ref.matches(relpath) and relpath.split("/", 1)[0] != STREAM_DIR

    def _link(self, relpath: str, sha256: str, size: int) -> None:
        if relpath not in self._linked:
            self._views.link(self.volume_id, relpath, sha256)
            self._linked[relpath] = size

    def _fail_locked(self, exc: BaseException) -> None:
        self._failed = True
        logger.warning("streaming volume %s of %s failed: %s", self.volume_id, self.grant.ref, exc)
        fail_view(self._views, self.volume_id, exc, self._planned)


def fail_view(views: StreamViews, volume_id: str, exc: BaseException, planned: list[str] | None = None) -> None:
    """State `failed` with the words the CLI would print for `exc`: a WeightcacheError's or an OSError's (redacted
    again: it reaches a pod), an unexpected error's type only (its text may hold anything)."""
    text = redact(str(exc)) if isinstance(exc, WeightcacheError | OSError) else \
        f"internal error ({type(exc).__name__}); see the weightcache daemon's log on the node"
    text += "; delete the pod to try again (its volume is then published anew)"
    try:
        views.write_state(volume_id, STREAM_FAILED, planned, error=text)
    except OSError as write_exc:  # the pod's loader then times out instead, naming the stall
        logger.error("could not write the failed state of streaming volume %s: %s", volume_id, write_exc)


class StreamVolumes:
    """Streaming volumes (VolumeKind.STREAM): each view mounted at once, filled by the model's one fetch."""

    def __init__(self, host: VolumeHost, fetches: FetchQueue, authority: Authority) -> None:
        self._host, self._fetches, self._authority = host, fetches, authority
        self.views = StreamViews(host.store.layout)
        self._fills: dict[str, tuple[StreamFill, asyncio.Task[None]]] = {}  # volume id -> its view's filling
        self._resuming: asyncio.Future[None] | None = None  # resume's second look, once the ModelCaches are listed

    async def publish(self, record: VolumeRecord, grant: Grant) -> None:
        """The view mounted for the pod (its model not cached), then filled while the model downloads."""
        await finish_even_if_cancelled(self._host.io(self._mount_view, record))
        self._start(record, grant)
        logger.info("published a streaming view of %s for pod %s/%s at %s", grant.ref, record.pod_namespace,
                    record.pod_name, record.target_path)

    def _mount_view(self, record: VolumeRecord) -> None:
        """Record, make the view (state `fetching`, nothing listed yet), bind it read-only on the target. No lease
        yet: there is no snapshot to hold; the view's own hard links keep its blobs."""
        with self._host.recorded(record, None):
            try:
                self._host.bind(self.views.create(record.volume_id), record.target_path)
            except BaseException:
                self.views.remove(record.volume_id)
                raise

    def _start(self, record: VolumeRecord, grant: Grant) -> None:
        fill = StreamFill(self.views, record.volume_id, grant)
        task = asyncio.ensure_future(self._fill(fill, record))
        self._fills[record.volume_id] = (fill, task)
        task.add_done_callback(lambda _: self._fills.pop(record.volume_id, None)
                               if self._fills.get(record.volume_id, (None, None))[1] is task else None)

    async def _fill(self, fill: StreamFill, record: VolumeRecord) -> None:
        """Join the model's one fetch as a file subscriber (kept: it goes on when the pod goes); once the snapshot
        is published, lease it for the volume and record its id, so eviction and gc see a mounted snapshot."""
        try:
            snapshot = await self._fetches.fetch(fill.grant, keep=True, on_file=fill.on_file)
        except Exception as exc:
            if isinstance(exc, FetchCancelledError) and self._fetches.closing:
                return  # the daemon stops: the view stays `fetching`, and the next start resumes it
            await self._host.io(fill.fail, exc)
            return
        await finish_even_if_cancelled(self._host.io(self._complete, fill, record, snapshot))

    def _complete(self, fill: StreamFill, record: VolumeRecord, snapshot: Snapshot) -> None:
        if not fill.complete(snapshot):
            return
        try:
            self._host.store.lease(record.holder, snapshot.id)
        except WeightcacheError as exc:  # evicted in the instant since it was published: the view's links hold it
            logger.warning("streaming volume %s: could not lease snapshot %s: %s", record.volume_id, snapshot.id,
                           exc)
            return
        self._host.book.put(dataclasses.replace(record, snapshot_id=snapshot.id))
        logger.info("streaming volume %s is complete: snapshot %s (%d files)", record.volume_id, snapshot.id[:12],
                    len(snapshot.files))

    async def stop(self, volume_id: str) -> None:
        """Unpublish: stop filling the view (the fetch goes on for its other callers and the cache)."""
        running = self._fills.pop(volume_id, None)
        if running is None:
            return
        fill, task = running
        await self._host.io(fill.close)  # waits out a link in progress on the engine's thread
        task.cancel()
        await asyncio.wait({task})

    async def usage(self, volume_id: str) -> csi_pb2.NodeGetVolumeStatsResponse:
        """A view still filling: what it holds so far."""
        fill = self._fills.get(volume_id)
        size, files = await self._host.io(fill[0].usage) if fill is not None else (0, 0)
        return csi_pb2.NodeGetVolumeStatsResponse(usage=[
            csi_pb2.VolumeUsage(total=size, used=size, available=0, unit=csi_pb2.VolumeUsage.BYTES),
            csi_pb2.VolumeUsage(total=files, used=files, available=0, unit=csi_pb2.VolumeUsage.INODES)])

    async def resume(self) -> None:
        """After a restart (reconcile kept only mounted volumes): fill again every streaming view whose snapshot
        is not published yet. The grant is decided anew for the pod's namespace, as at publish: a refusal now
        fails the view with the refusal's words. A view refused before the node listed the cluster's ModelCaches
        (a restart's first seconds) is no refusal: all are looked at again once they are listed (`_after_listing`),
        without holding up the daemon's start."""
        waiting = False
        for record in await self._host.io(self._host.book.all):
            if record.kind is not VolumeKind.STREAM or record.snapshot_id or record.volume_id in self._fills:
                continue
            try:
                ref = parse_ref(record.model, include=record.include, exclude=record.exclude)
                grant = self._authority.authorize(ref, Requester(record.pod_namespace))
            except PolicyNotListedError:
                waiting = True
                continue
            except WeightcacheError as exc:
                await self._host.io(fail_view, self.views, record.volume_id, exc)
                continue
            self._start(record, grant)
            logger.info("resumed filling streaming volume %s of %s for pod %s/%s", record.volume_id, ref,
                        record.pod_namespace, record.pod_name)
        if waiting and (self._resuming is None or self._resuming.done()):
            logger.info("streaming volumes to resume wait for this node to list the cluster's ModelCaches")
            self._resuming = asyncio.ensure_future(self._after_listing())

    async def _after_listing(self) -> None:
        await self._authority.until_synced()  # the watch's own retries bring the list; its first wakes this
        await self.resume()
