"""The DRAResourceHealth service (k8s.io/kubelet/pkg/apis/dra-health/v1alpha1) on the plugin's DRA socket.

kubelet 1.34+ (feature gate ResourceHealthStatus, on by default from 1.36) opens `NodeWatchResources` on every DRA
plugin and puts each allocated device's health into the pod's `status.containerStatuses[].allocatedResourcesStatus`;
a plugin that does not serve it makes kubelet log an error every few seconds. This stream sends the health of every
device of this node's pool that is published or prepared for a claim: a full list when kubelet connects, then the
list again whenever a device's health changes (checked every `interval` seconds):

    HEALTHY    the device's snapshot is whole: its manifest (the commit marker) and its tree are in the store
    UNHEALTHY  the snapshot is damaged (tree or manifest missing) or was evicted while a claim still names it

The check is a stat of two paths per snapshot, not a re-hash: `weightcache verify` is what reads the bytes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc

from weightcache.dra._pb import dra_health_v1alpha1_pb2 as pb
from weightcache.dra._pb import dra_health_v1alpha1_pb2_grpc as pb_grpc
from weightcache.dra.claims import ClaimBook
from weightcache.dra.devices import snapshot_of
from weightcache.store import Store

log = logging.getLogger(__name__)

HEALTHY: pb.HealthStatus = pb.HealthStatus.HEALTHY
UNHEALTHY: pb.HealthStatus = pb.HealthStatus.UNHEALTHY
DeviceNames = Callable[[], Iterable[str]]


def snapshot_whole(store: Store, snapshot_id: str) -> bool:
    return store.is_complete(snapshot_id) and store.layout.snapshot(snapshot_id).is_dir()


class DeviceHealth:
    """The health of this pool's devices, and when each last changed (blocking: call from a thread)."""

    def __init__(self, store: Store, book: ClaimBook, *, published: DeviceNames = lambda: ()) -> None:
        self._store, self._book, self._published = store, book, published
        self._since: dict[str, tuple[pb.HealthStatus, int]] = {}  # device -> (health, unix seconds of the last change)

    def devices(self) -> list[str]:
        names = set(self._published())
        for uid in self._book.uids():
            record = self._book.get(uid)
            if record is not None:
                names.update(d.device for d in record.devices)
        return sorted(n for n in names if snapshot_of(n) is not None)

    def check(self) -> dict[str, tuple[pb.HealthStatus, int]]:
        """device -> (HEALTHY|UNHEALTHY, last change); devices that are gone are dropped."""
        now = int(time.time())
        whole: dict[str, bool] = {}
        current: dict[str, tuple[pb.HealthStatus, int]] = {}
        for name in self.devices():
            sid = snapshot_of(name)
            assert sid is not None
            if sid not in whole:
                whole[sid] = snapshot_whole(self._store, sid)
            health = HEALTHY if whole[sid] else UNHEALTHY
            old = self._since.get(name)
            current[name] = old if old is not None and old[0] == health else (health, now)
        for name, (health, _) in current.items():
            if health == UNHEALTHY and self._since.get(name, (None,))[0] != UNHEALTHY:
                log.warning("DRA device %s is unhealthy: its snapshot is damaged or was evicted", name)
        self._since = current
        return current


class HealthServicer(pb_grpc.DRAResourceHealthServicer):
    def __init__(self, health: DeviceHealth, *, pool: str, interval: float = 2.0) -> None:
        self._health, self._pool, self._interval = health, pool, interval
        self._lock = asyncio.Lock()  # one check at a time, shared by every watcher

    def _message(self, state: dict[str, tuple[pb.HealthStatus, int]]) -> pb.NodeWatchResourcesResponse:
        return pb.NodeWatchResourcesResponse(devices=[pb.DeviceHealth(
            device=pb.DeviceIdentifier(pool_name=self._pool, device_name=name), health=health,
            last_updated_time=since) for name, (health, since) in sorted(state.items())])

    async def _check(self) -> dict[str, tuple[pb.HealthStatus, int]]:
        async with self._lock:
            return await asyncio.to_thread(self._health.check)

    async def NodeWatchResources(self, request: pb.NodeWatchResourcesRequest,
                                 context: grpc.aio.ServicerContext[Any, Any],
                                 ) -> AsyncIterator[pb.NodeWatchResourcesResponse]:
        sent: dict[str, pb.HealthStatus] | None = None
        while True:
            state = await self._check()
            now = {name: health for name, (health, _) in state.items()}
            if now != sent:
                yield self._message(state)
                sent = now
            await asyncio.sleep(self._interval)
