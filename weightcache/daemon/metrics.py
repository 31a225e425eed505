"""Prometheus metrics of one daemon, in a registry of its own (so tests and two daemons in a process never clash).

What others already count (the fetchers' origin bytes and fetches in flight; store bytes, budget, leases,
snapshots; memory-tier bytes) is read from them at scrape time by a Collector, so it can never drift; the daemon
counts the rest itself (hits, misses, durations, failures, its evictions, reloads, reconcile passes).
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from weightcache import __version__
from weightcache.vocabulary import (
    COMPILE_RESULTS,
    ENGINE_STAGES,
    SOURCE_CHECKS,
    STAGE_MODEL_ON_NODE,
    STAGE_VOLUME_PUBLISHED,
    STARTUP_TAINT,
)

log = logging.getLogger(__name__)

# 0.1 s (a cache hit that still checks the source) to 2 h (a 400 GB model on a slow link).
FETCH_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)
# 1 ms (Probe, a cached publish) to kubelet's 2-minute CSI timeout (a publish held for a download).
CSI_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# A cached publish (milliseconds) to a cold 400 GB model that kubelet's retries waited for (2 h).
STAGE_BUCKETS = (0.005, 0.025, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)


class Metrics:
    """What the daemon counts itself; `watch` adds what is read at scrape time."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.cache_hits = Counter("weightcache_cache_hits", "Ensures answered from the node cache", ["scheme"],
                                  registry=r)
        self.cache_misses = Counter("weightcache_cache_misses", "Ensures that had to fetch (or wait for a fetch)",
                                    ["scheme"], registry=r)
        self.fetch_failures = Counter("weightcache_fetch_failures", "Ensures that failed, by the error's code "
                                      "(source_not_found, insufficient_space, fetch_cancelled, ...)",
                                      ["scheme", "reason"], registry=r)
        self.fetch_seconds = Histogram("weightcache_fetch_duration_seconds", "Duration of ensures that missed "
                                       "the cache (fetched, or waited for another's fetch)", ["scheme"],
                                       buckets=FETCH_BUCKETS, registry=r)
        # `model` is the model's key (ModelRef.key), never its URI: the metrics port has no token, and bucket and
        # prefix names say whose models a node holds
        self.model_bytes = Counter("weightcache_model_fetched_bytes", "Bytes fetched per model (label: the model's "
                                   "key, weightcache.uri.model_key), from the origin or from peers (fleet fill: "
                                   "docs/peers.md)", ["model", "source"], registry=r)
        self.published_files = Counter(
            "weightcache_published_files", f"Files of the snapshots this daemon published, by what verified each "
            f"against its source ({', '.join(SOURCE_CHECKS)}; docs/fetch.md, \"What verified a file\")",
            ["scheme", "check"], registry=r)
        self.evictions = Counter("weightcache_evictions", "Snapshots evicted by the daemon", ["reason"], registry=r)
        self.reloads = Counter("weightcache_config_reloads", "Config reloads", ["result"], registry=r)
        self.reconcile_seconds = Histogram("weightcache_reconcile_duration_seconds", "One reconcile pass",
                                           buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 30, 120, 600), registry=r)
        self.startup_taint_seconds = Histogram(
            "weightcache_startup_taint_seconds", f"From a Node's creation to its daemon removing the startup taint "
            f"{STARTUP_TAINT} (docs/startup-taint.md), by why: models_ready or deadline", ["reason"],
            buckets=(5, 10, 30, 60, 120, 300, 600, 900, 1200, 1800, 3600, 7200), registry=r)
        self.csi_seconds = Histogram("weightcache_csi_request_duration_seconds", "CSI calls, by method, whatever "
                                     "their outcome", ["method"], buckets=CSI_BUCKETS, registry=r)
        # pods are not labels (unbounded): the Events on each pod and the publish log line name it with its stages
        self.stage_seconds = Histogram(
            "weightcache_coldstart_stage_seconds", f"Per pod, from kubelet's first NodePublishVolume of its "
            f"volumes (retries included) to: {STAGE_MODEL_ON_NODE} (the model on the node), "
            f"{STAGE_VOLUME_PUBLISHED} (the volume mounted) and what its engine reports: "
            f"{', '.join(ENGINE_STAGES)}; cache: whether its model was on the node, hit or miss "
            "(docs/telemetry.md)", ["stage", "cache"], buckets=STAGE_BUCKETS, registry=r)
        self.engine_cache_results = Counter(
            "weightcache_engine_cache_results", f"What each pod's engine did with the compile cache it was handed, "
            f"by engine name and result: {', '.join(COMPILE_RESULTS)} (docs/engine-caches.md)",
            ["engine", "result"], registry=r)
        self.csi_errors = Counter("weightcache_csi_errors", "CSI calls that answered an error, by gRPC code",
                                  ["method", "code"], registry=r)
        Gauge("weightcache_build_info", "Always 1; the labels say what runs", ["version", "python"],
              registry=r).labels(__version__, platform.python_version()).set(1)

    def observe_csi(self, method: str, seconds: float, code: str) -> None:
        """One CSI call (the CSI server's hook): `code` is the gRPC code's name, OK for success."""
        self.csi_seconds.labels(method).observe(seconds)
        if code != "OK":
            self.csi_errors.labels(method, code).inc()

    def observe_stage(self, stage: str, seconds: float, cache: str) -> None:
        """One cold-start stage of a published volume (the CSI plugin's hook): `cache` is hit or miss."""
        self.stage_seconds.labels(stage, cache).observe(seconds)

    def observe_compile(self, engine: str, result: str) -> None:
        """One pod's compile-cache result (the CSI plugin's hook, from the pod's engine report)."""
        self.engine_cache_results.labels(engine, result).inc()

    def watch(self, sample: Callable[[], Sample]) -> None:
        """Export the SAMPLED metrics, computed by `sample` at each scrape."""
        self.registry.register(_SampleCollector(sample))

    def exposition(self) -> bytes:
        """The text format; blocking (the collector reads SQLite), so call it from a thread."""
        return generate_latest(self.registry)


# Read at scrape time from their owners (store, fetchers, memory tier): name -> (kind, help, label or None).
SAMPLED: dict[str, tuple[str, str, str | None]] = {
    "weightcache_origin_bytes": ("counter", "Bytes downloaded from the object store", "scheme"),
    "weightcache_fetches_in_flight": ("gauge", "Fetches downloading now", None),
    "weightcache_fetches_queued": ("gauge", "Fetches waiting for a slot (parallelModels run at once)", None),
    "weightcache_store_used_bytes": ("gauge", "Bytes the store's blobs use", None),
    "weightcache_store_budget_bytes": ("gauge", "Disk budget of the store (absent when unlimited)", None),
    "weightcache_store_quarantine_bytes": ("gauge", "Bytes of records and entries the store refused to read, "
                                           "kept in quarantine/ for inspection (pruned by age and size)", None),
    "weightcache_store_quarantine_entries": ("gauge", "Entries in the store's quarantine/", None),
    "weightcache_snapshots": ("gauge", "Published snapshots in the store", None),
    "weightcache_pinned_snapshots": ("gauge", "Snapshots pinned against eviction", None),
    "weightcache_leases": ("gauge", "Leases held (mounted volumes and other holders)", None),
    "weightcache_memory_tier_locked_bytes": ("gauge", "Bytes held resident by the memory tier", None),
    "weightcache_memory_tier_budget_bytes": ("gauge", "Budget of the memory tier", None),
    "weightcache_peer_bytes": ("counter", "Bytes fetched from each peer", "peer"),
    "weightcache_peer_errors": ("counter", "Failed or contradicted reads from each peer", "peer"),
    "weightcache_peer_served_bytes": ("counter", "Bytes this node's peer listener served", None),
}
# name -> a number, or {label value: number} for labelled ones; None or missing = not exported.
Sample = Mapping[str, "float | Mapping[str, float] | None"]


class _SampleCollector(Collector):
    def __init__(self, sample: Callable[[], Sample]) -> None:
        self._sample = sample

    def describe(self) -> list[Metric]:
        return [_family(name, kind, doc, label) for name, (kind, doc, label) in SAMPLED.items()]

    def collect(self) -> Iterator[Metric]:
        try:
            values = self._sample()
        except Exception:  # a broken sample must not break /metrics: log it, export the rest
            log.exception("sampling metrics failed")
            return
        for name, (kind, doc, label) in SAMPLED.items():
            value = values.get(name)
            if value is None:
                continue
            family = _family(name, kind, doc, label)
            if isinstance(value, Mapping):
                for label_value, number in sorted(value.items()):
                    family.add_metric([label_value], float(number))
            else:
                family.add_metric([], float(value))
            yield family


def _family(name: str, kind: str, doc: str, label: str | None) -> CounterMetricFamily | GaugeMetricFamily:
    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    return cls(name, doc, labels=[label] if label else [])
