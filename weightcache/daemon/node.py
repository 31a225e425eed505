"""What the API, the reconcile loop, CSI and DRA share in one daemon: store, fetch queue, tier, metrics, policy.

Every fetch goes through `Node.fetches` (the one FetchQueue: single flight, the queue's lookup first), whose jobs
run `MeteredFetcher.ensure`: a Fetcher per fetch, built by the settings' FetchSettings (with the daemon's peer set
in them: `FetchSettings.with_peers`), counted for /metrics.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from weightcache.access import ADMIN, Authority, Grant, Requester
from weightcache.daemon.client import error_code
from weightcache.daemon.config import Settings
from weightcache.daemon.metrics import Metrics, Sample
from weightcache.daemon.tasks import Tasks
from weightcache.dra.states import DeviceStates
from weightcache.errors import ConfigError, WeightcacheError
from weightcache.fetch import DurableFile, Fetcher
from weightcache.fetch_queue import FetchQueue
from weightcache.progress import Progress
from weightcache.ratelimit import BandwidthLimits
from weightcache.signatures import SignaturePolicy
from weightcache.sources import ClientPool
from weightcache.store import Snapshot, Store, quarantine_usage
from weightcache.uri import ModelRef

if TYPE_CHECKING:
    from weightcache.csi.telemetry import Pod
    from weightcache.kube.client import ApiClient
    from weightcache.memory import MemoryTier  # imported only when a memory budget is set
    from weightcache.peers import PeerSet
    from weightcache.peers.server import PeerServer  # imported only when peerListen is set

log = logging.getLogger(__name__)

ProgressCallback = Callable[[Progress], None]


class MeteredFetcher:
    """Fetcher facade: a Fetcher per fetch (so one fetch can be stopped alone: its `cancel` event), their own
    counters (origin bytes, fetches in flight) summed per scheme for export at scrape time; counts hits, misses,
    failures by reason and times fetches around ensure."""

    stops_on_cancel = True  # fetch_queue.Engine: each fetch's own Fetcher watches its `cancel`

    def __init__(self, store: Store, settings: Settings, metrics: Metrics, peers: PeerSet | None = None, *,
                 limits: BandwidthLimits | None = None, clients: ClientPool | None = None) -> None:
        self._store = store
        # fetch settings are read at start (docs/config.md: restart); blobs with a trusted sha256 come from the
        # peers first (docs/peers.md); origin reads wait on the node's bandwidth limits; source clients are kept
        self._fetch = settings.fetch.with_peers(peers, limits=limits, clients=clients)
        self._metrics = metrics
        self._live: dict[Fetcher, str] = {}  # running fetchers -> scheme
        self._done: dict[str, dict[str, int]] = {}  # scheme -> counters of finished fetchers
        self._closed = threading.Event()
        self._lock = threading.Lock()

    @property
    def peers(self) -> PeerSet | None:
        return self._fetch.peers

    def _fetcher(self, ref: ModelRef, cancel: threading.Event | None = None) -> Fetcher:
        return self._fetch.fetcher(self._store, ref, cancel=cancel)

    def lookup(self, grant: Grant) -> Snapshot | None:
        """The cached snapshot (a hit), or None; blocking. The engine's own lookup: a hit of a moved tag is vetoed
        (`Fetcher._still_named`), so the fetch queue, and every API ensure, CSI publish and reconcile behind it,
        fetches what the tag names now instead of serving the old snapshot."""
        cached = self._fetcher(grant.ref).lookup(grant)
        if cached is not None:
            self._metrics.cache_hits.labels(grant.ref.scheme).inc()
        return cached

    def ensure(self, grant: Grant, *, progress: ProgressCallback | None = None,
               cancel: threading.Event | None = None,
               on_file: Callable[[DurableFile], None] | None = None) -> Snapshot:
        """Blocking, like Fetcher.ensure; setting `cancel` stops this fetch at its next read (chunks kept). Called
        by the fetch queue after its own lookup missed, so the store is not asked again before the engine's
        re-check under the fetch lock (a hit there is counted by the engine's stats, not as a cache hit)."""
        ref = grant.ref
        self._metrics.cache_misses.labels(ref.scheme).inc()
        start = time.monotonic()
        fetcher = self._fetcher(ref, cancel or threading.Event())
        with self._lock:
            self._live[fetcher] = ref.scheme
        if self._closed.is_set():
            fetcher.close()
        try:
            snapshot = fetcher.ensure(grant, progress=progress, looked_up=True, on_file=on_file)
        except Exception as exc:
            reason = error_code(type(exc)) if isinstance(exc, WeightcacheError) else "internal"
            self._metrics.fetch_failures.labels(ref.scheme, reason).inc()
            raise
        finally:
            for source, stat in (("origin", "origin_bytes"), ("peers", "peer_bytes")):
                if n := fetcher.stats.get(stat, 0):
                    self._metrics.model_bytes.labels(ref.key, source).inc(n)
            with self._lock:
                del self._live[fetcher]
                done = self._done.setdefault(ref.scheme, {})
                for name, value in fetcher.stats.items():
                    done[name] = done.get(name, 0) + value
        self._metrics.fetch_seconds.labels(ref.scheme).observe(time.monotonic() - start)
        for check, n in fetcher.published_checks.items():
            self._metrics.published_files.labels(ref.scheme, check).inc(n)
        return snapshot

    def close(self) -> None:
        """Park every download (partials and journals stay for the next start)."""
        self._closed.set()
        with self._lock:
            fetchers = list(self._live)
        for fetcher in fetchers:
            fetcher.close()

    def counters(self) -> dict[str, dict[str, float]]:
        """Per-scheme sums of the fetchers' own counters (origin_bytes, fetches_in_flight, ...)."""
        out: dict[str, dict[str, float]] = {}
        with self._lock:
            items = [*((scheme, dict(f.stats)) for f, scheme in self._live.items()),
                     *((scheme, dict(stats)) for scheme, stats in self._done.items())]
        for scheme, stats in items:
            for name, value in stats.items():
                per = out.setdefault(name, {})
                per[scheme] = per.get(scheme, 0) + value
        return out


@dataclass(frozen=True)
class Want:
    """One model this node should hold. `model_cache` is the ModelCache object (None for config models)."""

    name: str
    ref: ModelRef
    tier: str = "disk"
    pin: bool = True
    priority: int = 0
    model_cache: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    namespaces: tuple[str, ...] | None = None  # who asked: None = an admin (config, ModelCache); else demand's
    warm_first: bool = False  # ModelCache spec.warmBeforeSchedulable: the startup taint waits for it
    serves: bool = False  # the store's `latest` ref of its selection follows it (a rollout's served revision)


class Service(Protocol):
    """A node service the daemon started (the CSI server, the DRA plugin): stopped with a grace period."""

    async def stop(self, grace: float) -> None: ...


class ClusterBridge(Protocol):
    """What the daemon asks of its Kubernetes bridge (weightcache/daemon/cluster.py's Cluster; None off-cluster).
    Typed here, below the reconcile loop and the startup taint that use it, so neither imports the bridge."""

    node_name: str
    api_client: ApiClient  # only kube/ and peer discovery use it
    started: float  # the startup taint's clock when the Node carries no creationTimestamp

    def stop(self) -> None: ...
    def synced(self) -> bool: ...
    def model_caches(self) -> list[dict[str, Any]]: ...
    def node(self) -> dict[str, Any]: ...
    def node_labels(self) -> dict[str, str]: ...
    def has_startup_taint(self) -> bool: ...
    def remove_startup_taint(self) -> bool: ...
    def node_event(self, reason: str, message: str, type: str) -> None: ...
    def pod_event(self, pod: Pod, reason: str, message: str, type: str) -> None: ...
    def desired(self, adapter_views: Mapping[str, tuple[str, ...]] | None = None) -> list[Want]: ...
    def report_many(self, states: Sequence[tuple[Want, str, Any, str]]) -> None: ...
    def progress(self, want: Want, done: int, total: int) -> None: ...
    def set_labels(self, changes: Mapping[str, str | None]) -> None: ...
    def forget(self, name: str) -> None: ...
    def advertise_peer(self, address: str | None) -> None: ...


@dataclass
class Node:
    """The daemon's shared state. `cluster` is the kube bridge (None off-cluster); `tier` None = no memory tier."""

    settings: Settings
    store: Store
    metrics: Metrics
    fetcher: MeteredFetcher
    tier: MemoryTier | None = None
    cluster: ClusterBridge | None = None
    tasks: Tasks = field(default_factory=Tasks)
    store_ready: bool = False
    kick: Callable[[], None] = lambda: None  # wakes the reconcile loop
    peer_server: PeerServer | None = None  # when peerListen is set
    fetches: FetchQueue = field(init=False)  # the one queue every fetch of this daemon goes through
    # held copies whose DRA devices are tainted now (evicting, verifying, damaged): the API marks, the slice
    # publisher reads (dra/states.py)
    device_states: DeviceStates = field(default_factory=DeviceStates)
    # the node's bytesPerSecond buckets (weightcache/ratelimit.py), configured at start and by a reload
    bandwidth: BandwidthLimits = field(default_factory=BandwidthLimits)
    # set on the loop once `listed` says yes (`heard_from_cluster`): what `until_listed` waits on
    _listed: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)

    def __post_init__(self) -> None:
        self.fetches = FetchQueue(self.fetcher, parallel=self.settings.models.parallel)

    async def ensure(self, grant: Grant, *, progress: ProgressCallback | None = None) -> Snapshot:
        """A model the node keeps wanting (reconcile): its fetch goes on whoever else stops waiting."""
        return await self.fetches.ensure(grant, progress=progress, keep=True)

    def check_tier(self, tier: str) -> None:
        if tier == "memory" and self.tier is None:
            raise ConfigError("tier=memory needs the memory tier, which is off on this node: set memoryBudget "
                              "in the daemon config, or ask for tier=disk")

    async def settle(self, snapshot: Snapshot, *, tier: str, pin: bool) -> None:
        """Apply what an API ensure asked for beyond the bytes: a pin, the memory tier."""
        if pin:
            await asyncio.to_thread(self.store.pin, snapshot.id)
        if tier == "memory":
            self.check_tier(tier)
            assert self.tier is not None
            await asyncio.to_thread(self.tier.promote, snapshot)

    def model_caches(self) -> list[Mapping[str, Any]]:
        return list(self.cluster.model_caches()) if self.cluster is not None else []

    def listed(self) -> bool:
        """This node has the cluster's ModelCaches (always off-cluster): a refusal before then is no decision."""
        return self.cluster is None or bool(self.cluster.synced())

    def heard_from_cluster(self) -> None:
        """On the loop, after each word from the ModelCache watch (its list or a change: cluster.connect)."""
        if self.listed():
            self._listed.set()

    async def until_listed(self) -> None:
        """Returns once this node has listed the cluster's ModelCaches: the watch sets its flag, then tells
        `heard_from_cluster`, so a listing after the look here wakes the wait (and one before it is seen)."""
        if not self.listed():
            await self._listed.wait()

    def allow_undeclared(self) -> bool:
        return self.settings.models.undeclared_allowed(cluster=self.cluster is not None)

    @property
    def authority(self) -> Authority:
        """The one decision (weightcache/access.py) with this node's ModelCaches, settings and directories."""
        return Authority(model_caches=self.model_caches, allow_undeclared=self.allow_undeclared,
                         forbidden_paths=(self.settings.csi.kubelet_dir, self.settings.store.root),
                         declared=lambda: [m.ref for m in self.settings.models.warm],
                         synced=self.listed, until_synced=self.until_listed)

    def authorize(self, ref: ModelRef, namespace: str | None, *, signed_by: SignaturePolicy | None = None) -> Grant:
        """A namespace's request, or (None) an admin's on the node: the one decision, or NotAllowedError.
        `signed_by`: the request's own signature requirement (weightcache/signatures.py)."""
        return self.authority.authorize(ref, ADMIN if namespace is None else Requester(namespace), signed_by=signed_by)

    def ready(self) -> dict[str, bool]:
        checks = {"store": self.store_ready}
        if self.cluster is not None:
            checks["modelcaches_synced"] = self.listed()
        return checks

    def sample(self) -> Sample:
        """Scrape-time gauges (blocking: reads the index)."""
        infos = self.store.list()
        fetched = self.fetcher.counters()
        quarantined = quarantine_usage(self.store)
        return {
            "weightcache_origin_bytes": fetched.get("origin_bytes", {}),
            "weightcache_fetches_in_flight": sum(fetched.get("fetches_in_flight", {}).values()),
            "weightcache_fetches_queued": self.fetches.depth()[1],
            "weightcache_store_used_bytes": self.store.used_bytes(),
            "weightcache_store_budget_bytes": self.store.budget_bytes,
            "weightcache_store_quarantine_bytes": quarantined.bytes,
            "weightcache_store_quarantine_entries": quarantined.entries,
            "weightcache_snapshots": len(infos),
            "weightcache_pinned_snapshots": sum(1 for i in infos if i.pinned),
            "weightcache_leases": len(self.store.leases()),
            "weightcache_memory_tier_locked_bytes": self.tier.locked_bytes() if self.tier is not None else None,
            "weightcache_memory_tier_budget_bytes": self.settings.memory.budget if self.tier is not None else None,
            **self.peer_sample(),
        }

    def peer_sample(self) -> Sample:
        """Bytes and errors per peer this node fetched from; bytes it served to peers."""
        out: dict[str, float | Mapping[str, float] | None] = {}
        peers = self.fetcher.peers
        if peers is not None:
            with peers.stats.lock:
                out["weightcache_peer_bytes"] = dict(peers.stats.bytes_by_peer)
                out["weightcache_peer_errors"] = dict(peers.stats.errors_by_peer)
        if self.peer_server is not None:
            out["weightcache_peer_served_bytes"] = self.peer_server.bytes_served
        return out
