"""What every kind of volume (reconcile.VolumeKind) is published and unpublished with: the store, the volume
records, kubelet's targets and the plugin's own pool (`VolumeHost`); one operation per volume at a time
(`VolumeLocks`); a mount begun is finished before its volume's lock is let go (`finish_even_if_cancelled`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from weightcache.csi import mounts
from weightcache.csi.reconcile import SnapshotMounts, VolumeBook, VolumeRecord
from weightcache.csi.targets import KubeletTargets, TargetMissingError
from weightcache.errors import OperationPendingError
from weightcache.store import Store

logger = logging.getLogger(__name__)

T = TypeVar("T")


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


@dataclass
class VolumeHost:
    store: Store
    book: VolumeBook
    targets: KubeletTargets
    pool: ThreadPoolExecutor  # the plugin's blocking work (records, mounts, stats)

    async def io(self, fn: Callable[..., T], *args: object) -> T:
        """Blocking work on the plugin's own pool (never queued behind downloads or API requests)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))

    @contextlib.contextmanager
    def recorded(self, record: VolumeRecord, snapshot_id: str | None) -> Iterator[None]:
        """Lease (when there is a snapshot to hold), record, then mount inside: a crash in between leaves a lease
        that reconcile settles; a failed mount takes both back."""
        if snapshot_id is not None:
            self.store.lease(record.holder, snapshot_id)
        self.book.put(record)
        try:
            yield
        except BaseException:
            self.book.remove(record.volume_id)
            if snapshot_id is not None:
                self.store.release(record.holder)
            raise

    def bind(self, source: Path, target: str) -> None:
        """Bind `source` read-only on `target`, walked once; a stale mount of ours from a crashed attempt goes first."""
        with self.targets.open_parent(target, create=True) as parent:
            self.unmount_ours(parent, target)
            mounts.bind_readonly_at(source, parent, "mount", target)

    def is_mounted(self, target: str) -> bool:
        try:
            with self.targets.open_parent(target, create=False) as parent:
                return mounts.top_mount_at(parent, "mount", target) is not None
        except TargetMissingError:
            return False

    def unmount_ours(self, parent: int, target: str) -> int:
        """Unmount the snapshot bind mounts stacked on `target` (directory "mount" of the walked `parent` fd), down
        to the first mount that is not ours. Each mount is checked and unmounted through the same parent fd, so a
        path swapped meanwhile cannot redirect the unmount."""
        count = 0
        while True:
            entry = mounts.top_mount_at(parent, "mount", target)
            snapshots = SnapshotMounts.of(self.store, mounts.mount_table())
            scratch = entry is not None and mounts.is_scratch(entry)
            if entry is None or (not scratch and (snapshots is None or not snapshots.is_ours(entry))):
                if entry is not None and count == 0:
                    logger.warning("%s is a mount point that is not a weightcache snapshot; not unmounting it",
                                   target)
                return count
            if not mounts.unmount_top_at(parent, "mount", target):
                return count
            count += 1
