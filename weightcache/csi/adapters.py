"""A pod's LoRA adapter directory: a read-only view the node fills while the pod runs (docs/adapters.md).

A CSI volume with `adapters: "true"` and `model: <base model>` is published as an empty `streams/<volume id>/`
(the store's growing views, store/streams.py) bind-mounted read-only; a bind mount shows what is later made inside
its source, so the pod sees each adapter appear. `fill` links into it, as `<name>/…`, every adapter declared for
that base (ModelCaches with `spec.baseModel`, weightcache/kube/adapters.py) that is in the store and that the pod's
namespace may have: `Authority.authorize` decides each one for that namespace, as at every door. It runs at
publish, and after each reconcile pass of the daemon, which fetches the adapters of every base that has such a view
on the node (kube/desired.plan). An adapter appears whole: its files are hard links to its blobs, the weights
first and `adapter_config.json` (what an engine looks for) last.

Each linked adapter is leased by `adapter:<volume id>/<name>`, so it is never evicted while the pod runs (it may
ask for it at any time) — unless the disk is below the store's free-space floor: then the views hold nothing (their
links and leases go), the floor is restored LRU as for any unpinned model, and the views fill again once the disk is
above it. An adapter no longer declared, or no longer allowed to the namespace, leaves the view at the next fill; a
new revision of one (its ModelCache's rollout) replaces it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence

from weightcache.access import Authority, Requester
from weightcache.csi.reconcile import VolumeBook, VolumeKind, VolumeRecord
from weightcache.csi.volumes import VolumeHost, finish_even_if_cancelled
from weightcache.errors import InvalidReferenceError, NotAllowedError, WeightcacheError
from weightcache.fetch_queue import FetchQueue
from weightcache.kube.adapters import Adapter, declared
from weightcache.store import Snapshot, Store, StreamViews
from weightcache.uri import canonical_uri
from weightcache.vocabulary import ADAPTER_HOLDER_PREFIX, STREAM_DIR

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"  # PEFT's: what vLLM's resolvers and loader look for


class AdapterVolumes:
    """Adapter directories (VolumeKind.ADAPTERS): each view mounted empty, then filled (`fill`)."""

    def __init__(self, host: VolumeHost, views: StreamViews, fetches: FetchQueue, authority: Authority,
                 on_publish: Callable[[], None]) -> None:
        self._host, self._views, self._fetches, self._authority = host, views, fetches, authority
        self._on_publish = on_publish  # the daemon's reconcile: it fetches the adapters of the new directory's base

    async def publish(self, record: VolumeRecord) -> None:
        """Mount the view for the pod (its namespace was granted the base model), then fill it at once."""
        await finish_even_if_cancelled(self._host.io(self._mount_view, record))
        await fill(self._host.store, self._views, self._authority, self._fetches, [record])
        self._on_publish()
        logger.info("published the adapter directory of %s for pod %s/%s at %s", record.model, record.pod_namespace,
                    record.pod_name, record.target_path)

    def _mount_view(self, record: VolumeRecord) -> None:
        """Record, make the view (empty, no state file), bind it read-only on the target; no lease of its own."""
        with self._host.recorded(record, None):
            try:
                self._host.bind(self._views.create(record.volume_id, state=False), record.target_path)
            except BaseException:
                self._views.remove(record.volume_id)
                raise


def holder(volume_id: str, name: str) -> str:
    return f"{ADAPTER_HOLDER_PREFIX}{volume_id}/{name}"


def views_by_base(book: VolumeBook) -> dict[str, tuple[str, ...]]:
    """Base model uri -> the namespaces of the pods on this node with an adapter directory for it."""
    found: dict[str, set[str]] = {}
    for record in book.all():
        if record.kind is VolumeKind.ADAPTERS:
            try:
                found.setdefault(canonical_uri(record.model), set()).add(record.pod_namespace)
            except InvalidReferenceError:
                continue
    return {base: tuple(sorted(namespaces)) for base, namespaces in found.items()}


async def fill(store: Store, views: StreamViews, authority: Authority, fetches: FetchQueue,
               records: Iterable[VolumeRecord]) -> None:
    """Bring the adapter directories of these volumes up to date (others are skipped)."""
    records = [r for r in records if r.kind is VolumeKind.ADAPTERS]
    if not records:
        return
    adapters = declared(authority.model_caches())
    shed = await asyncio.to_thread(store.floor_deficit) > 0
    for record in records:
        wanted = {} if shed else await _wanted(authority, fetches, record, adapters)
        await asyncio.to_thread(_settle, store, views, record.volume_id, wanted)
    if shed:
        gone = await asyncio.to_thread(store.restore_floor)
        logger.warning("the disk is below the store's free-space floor: adapter directories hold nothing until it "
                       "is above again (%d snapshots evicted)", len(gone))


async def fill_all(store: Store, book: VolumeBook, views: StreamViews, authority: Authority,
                   fetches: FetchQueue) -> None:
    """Every adapter directory of the node; leases of volumes that are gone are released."""
    records = [r for r in await asyncio.to_thread(book.all) if r.kind is VolumeKind.ADAPTERS]
    await fill(store, views, authority, fetches, records)
    await asyncio.to_thread(release_stale, store, {r.volume_id for r in records})


def release_stale(store: Store, volumes: set[str]) -> list[str]:
    """Release the adapter leases of volumes not in `volumes` (unpublished while a fill ran, or before a crash)."""
    stale = [h for h in store.leases() if h.startswith(ADAPTER_HOLDER_PREFIX)
             and h[len(ADAPTER_HOLDER_PREFIX):].rpartition("/")[0] not in volumes]
    for h in stale:
        store.release(h)
    return stale


def release_volume(store: Store, volume_id: str) -> None:
    """Release every adapter lease of one volume (its unpublish)."""
    for h in store.leases():
        if h.startswith(ADAPTER_HOLDER_PREFIX) and h[len(ADAPTER_HOLDER_PREFIX):].rpartition("/")[0] == volume_id:
            store.release(h)


async def _wanted(authority: Authority, fetches: FetchQueue, record: VolumeRecord,
                  adapters: Sequence[Adapter]) -> dict[str, Snapshot]:
    """The cached adapters of the volume's base that its pod's namespace may have, by name."""
    try:
        base = canonical_uri(record.model)
    except InvalidReferenceError:
        return {}
    wanted: dict[str, Snapshot] = {}
    for adapter in adapters:
        if adapter.base != base:
            continue
        try:
            grant = authority.authorize(adapter.ref, Requester(record.pod_namespace))  # weightcache/access.py
        except NotAllowedError:
            continue
        snapshot = await fetches.lookup(grant)
        if snapshot is not None:
            wanted[adapter.name] = snapshot
    return wanted


def _settle(store: Store, views: StreamViews, volume_id: str, wanted: dict[str, Snapshot]) -> None:
    """Make the view hold exactly `wanted`: remove what is not (or another snapshot of it), link what is missing."""
    if not views.exists(volume_id):  # unpublished meanwhile
        return
    view = views.path(volume_id)
    leases = store.leases()
    present = {name for name in store.tree.listdir(view) if name != STREAM_DIR}
    for name in sorted(present):
        snapshot = wanted.get(name)
        if snapshot is None or leases.get(holder(volume_id, name)) != snapshot.id:
            store.tree.remove_tree(view / name)
            store.release(holder(volume_id, name))
            present.discard(name)
            logger.info("adapter %s left the adapter directory of volume %s", name, volume_id)
    for name, snapshot in sorted(wanted.items()):
        if name in present:
            continue
        try:
            store.lease(holder(volume_id, name), snapshot.id)  # first: nothing evicts it while it is linked
            for f in sorted(snapshot.files, key=lambda f: (f.path == ADAPTER_CONFIG, f.path)):
                views.link(volume_id, f"{name}/{f.path}", f.sha256)
        except (WeightcacheError, OSError) as exc:
            logger.warning("adapter %s not linked into volume %s: %s", name, volume_id, exc)
            store.tree.remove_tree(view / name)
            store.release(holder(volume_id, name))
            continue
        logger.info("adapter %s (snapshot %s) added to the adapter directory of volume %s", name, snapshot.id[:12],
                    volume_id)
