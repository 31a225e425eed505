"""A pod's cold start as the node sees it: its stages as Events on the pod and observations of the daemon's
histogram, and what its engine did with the compile cache it was handed (docs/telemetry.md).

    stage            told by                                      when the CSI plugin learns it
    model_on_node    the plugin (cache hit, or the fetch joined)  NodePublishVolume of the model's volume
    volume_published the plugin (the bind mount made)             same
    weights_loaded   the pod's engine, in its report file          NodeGetVolumeStats of its engine-cache (or
    engine_ready     the engine's report, else the ready file      report) volume, about every minute, and its
                                                                  unpublish
    first_token      the engine's report                          same

Each duration counts from kubelet's first NodePublishVolume of any of the pod's volumes (its retries included),
on the node's clock, which the pod shares. A pod's report is read at most once a stats call, is its word about
itself alone (its own Events, one observation per stage per volume) and is dropped where it makes no sense (a
time before the pod's first publish or after now).

Nothing here blocks on the API server: `pod_event` is the daemon's hook, which queues the write on a thread of its
own (daemon/cluster.py), or None off-cluster, where the log line is the record.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from weightcache import engine_report
from weightcache.engine_name import EngineName
from weightcache.vocabulary import (
    COMPILE_HIT,
    COMPILE_INCOMPATIBLE,
    ENGINE_CACHE_READY,
    STAGE_ENGINE_READY,
    STAGE_FIRST_TOKEN,
    STAGE_MODEL_ON_NODE,
    STAGE_VOLUME_PUBLISHED,
    STAGE_WEIGHTS_LOADED,
)

logger = logging.getLogger(__name__)

MAX_PODS = 4096  # pods whose first publish is remembered (a pod deleted mid-retry is never unpublished)
CLOCK_SLACK_S = 5.0  # a report time this far past `now` is still believed (the file's write and our read race)

REASONS = {STAGE_MODEL_ON_NODE: "ModelOnNode", STAGE_VOLUME_PUBLISHED: "VolumePublished",
           STAGE_WEIGHTS_LOADED: "WeightsLoaded", STAGE_ENGINE_READY: "EngineReady", STAGE_FIRST_TOKEN: "FirstToken"}
COMPILE_REASONS = {COMPILE_HIT: "EngineCacheHit", "miss": "EngineCacheMiss",
                   COMPILE_INCOMPATIBLE: "EngineCacheIncompatible"}


@dataclass(frozen=True)
class Pod:
    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


# (pod, reason, message, type): an Event on the pod; must not block (the daemon queues it)
PodEvent = Callable[[Pod, str, str, str], None]
# (stage, seconds, cache): the daemon's weightcache_coldstart_stage_seconds
ObserveStage = Callable[[str, float, str], None]
# (engine name, result): the daemon's weightcache_engine_cache_results
ObserveCompile = Callable[[str, str], None]


@dataclass
class _Start:
    first: float  # wall time of kubelet's first publish of any of the pod's volumes
    cache: str = "unknown"  # whether the pod's model was cached: its volume's stages' label
    told: frozenset[str] = frozenset()  # stages and compile results already turned into Events


class PodTelemetry:
    def __init__(self, *, observe_stage: ObserveStage | None = None, pod_event: PodEvent | None = None,
                 observe_compile: ObserveCompile | None = None, clock: Callable[[], float] = time.time) -> None:
        self._observe_stage = observe_stage
        self._pod_event = pod_event
        self._observe_compile = observe_compile
        self._clock = clock
        self._lock = threading.Lock()  # publish runs on the loop, reports on the plugin's pool
        self._pods: OrderedDict[str, _Start] = OrderedDict()  # pod uid -> its start

    def first_attempt(self, pod: Pod) -> None:
        """kubelet asks to publish one of `pod`'s volumes: the first ask starts its clock."""
        self._start(pod, self._clock())

    def published(self, pod: Pod, model: str, cache: str, model_s: float, published_s: float) -> None:
        """The pod's model volume is mounted: its first two stages, with whether the model was cached."""
        start = self._start(pod, self._clock() - published_s)
        start.cache = cache
        what = f"{model} ({'cached on the node' if cache == 'hit' else 'fetched'})"
        for stage, seconds in ((STAGE_MODEL_ON_NODE, model_s), (STAGE_VOLUME_PUBLISHED, published_s)):
            self._stage(pod, start, stage, seconds, what)

    def engine_volume(self, pod: Pod, engine: str, directory: str, published_at: float) -> None:
        """Read the report of `pod`'s engine-cache volume mounted at `directory` (blocking: a small read) and tell
        what is new in it. `published_at`: the volume's publish time, the clock when the daemon restarted since.
        `engine` "": a report volume, which holds no compile cache: its stages alone are told."""
        if not pod.uid:  # a volume adopted after a restart: which pod it serves is not known
            return
        try:
            report = engine_report.read(directory)
        except ValueError as exc:
            logger.warning("pod %s: its engine report is not used: %s", pod, exc)
            report = None
        stages = dict(report.stages) if report is not None else {}
        if STAGE_ENGINE_READY not in stages and (ready := engine_report.ready_at(directory, ENGINE_CACHE_READY)):
            stages[STAGE_ENGINE_READY] = ready  # its startup probe touched the ready file once the engine answered
        start = self._start(pod, published_at)
        now = self._clock()
        for stage in (STAGE_WEIGHTS_LOADED, STAGE_ENGINE_READY, STAGE_FIRST_TOKEN):
            at = stages.get(stage)
            if at is None or stage in start.told:
                continue
            if not start.first <= at <= now + CLOCK_SLACK_S:
                logger.warning("pod %s reports %s at %s, outside its start (%s to now); not used", pod, stage,
                               _stamp(at), _stamp(start.first))
                start.told |= {stage}
                continue
            self._stage(pod, start, stage, at - start.first, f"engine {engine}" if engine else "the pod's report")
        if report is not None and report.compile is not None and engine:
            self._compile(pod, start, engine, report.compile)

    def forget(self, pod_uid: str) -> None:
        with self._lock:
            self._pods.pop(pod_uid, None)

    def _start(self, pod: Pod, at: float) -> _Start:
        with self._lock:
            start = self._pods.get(pod.uid)
            if start is None:
                if len(self._pods) >= MAX_PODS:
                    self._pods.popitem(last=False)
                start = self._pods[pod.uid] = _Start(at)
            return start

    def _stage(self, pod: Pod, start: _Start, stage: str, seconds: float, what: str) -> None:
        with self._lock:
            if stage in start.told:
                return
            start.told |= {stage}
        if self._observe_stage is not None:
            self._observe_stage(stage, seconds, start.cache)
        message = f"{stage} at {_stamp(start.first + seconds)}, {seconds:.3f}s after kubelet first asked for " \
                  f"the pod's volumes: {what}"
        logger.info("pod=%s %s=%.3fs cache=%s", pod, stage, seconds, start.cache)
        self._event(pod, REASONS[stage], message, "Normal")

    def _compile(self, pod: Pod, start: _Start, engine: str, outcome: engine_report.CompileOutcome) -> None:
        told = f"compile:{outcome.result}"
        with self._lock:
            if told in start.told:
                return
            start.told |= {told}
        if self._observe_compile is not None:
            self._observe_compile(engine, outcome.result)
        handed = ", ".join(outcome.handed) or "none"
        if outcome.result == COMPILE_HIT:
            message = f"engine cache {engine} hit: vLLM loaded its compiled graphs from {outcome.dir or '?'}"
        elif outcome.result == COMPILE_INCOMPATIBLE:
            message = (f"engine cache {engine} incompatible: vLLM compiled again ({outcome.written} files written) "
                       f"beside the cache it was handed (made with other compile settings; this pod's compile key "
                       f"is {outcome.key or '?'}); see docs/engine-caches.md")
        else:
            message = (f"engine cache {engine} miss: vLLM compiled ({outcome.written} files written); handed over: "
                       f"{handed}")
        if outcome.result != COMPILE_HIT and len(outcome.key) == 16 and engine.count("-") == 2:
            message += f"; name it {engine}-{outcome.key} to key the cache by these compile settings"
        logger.info("pod=%s engine_cache=%s result=%s key=%s dir=%s handed=%s written=%d", pod, engine,
                    outcome.result, outcome.key, outcome.dir, handed, outcome.written)
        # a first pod's compile is no surprise; an incompatible cache always is: it means one was handed over (on
        # vLLM's CPU build the handed cache is inductor's alone, so `handed`, vLLM's own cache dirs, stays empty)
        quiet = outcome.result == COMPILE_HIT or (outcome.result != COMPILE_INCOMPATIBLE and not outcome.handed)
        self._event(pod, COMPILE_REASONS[outcome.result], message, "Normal" if quiet else "Warning")

    def _event(self, pod: Pod, reason: str, message: str, kind: str) -> None:
        if self._pod_event is not None and pod.name and pod.namespace:
            self._pod_event(pod, reason, message, kind)


def worth_handing_over(name: EngineName, directory: str) -> str | None:
    """Why the engine-cache volume at `directory` (it started empty) is not to be handed over as `name`, from its
    engine's report; None when it is, or when there is no report (an engine that does not report: the ready file
    alone decides, as before). A cache compiled under another compile key than the name declares would be served
    to pods that miss it; an engine that wrote nothing hands back nothing new (an equal cache, or none)."""
    try:
        report = engine_report.read(directory)
    except ValueError:
        return None
    outcome = report.compile if report is not None else None
    if outcome is None:
        return None
    if name.compile and outcome.key and outcome.key != name.compile:
        return (f"its engine compiled under compile key {outcome.key}, the volume asked for {name} (its compile "
                "settings differ from the name's)")
    if outcome.written == 0:
        return "its engine compiled nothing into it"
    return None


def _stamp(at: float) -> str:
    when = datetime.datetime.fromtimestamp(at, datetime.UTC)
    return f"{when:%Y-%m-%dT%H:%M:%S}.{when.microsecond // 1000:03d}Z"
