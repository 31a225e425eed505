"""The thin aiohttp adapter around `mutate.review`: HTTPS, /mutate, /healthz, /metrics, certificate reload.

    POST /mutate[?timeout=10s]   AdmissionReview v1 -> AdmissionReview v1 (HTTP 200, denials included);
                                 a body that is not an AdmissionReview v1 Pod CREATE -> 400 {"error", "message"}
    GET  /healthz                "ok" while the process serves (liveness)
    GET  /readyz                 "ok" once the ModelCache list is synced, else 503 (readiness: the Service
                                 routes no review to a replica that would deny for want of ModelCaches)
    GET  /metrics                Prometheus text: reviews by outcome, review latency, certificate reloads

The API server appends `?timeout=` to every call; a review takes well under a millisecond, so it is accepted
and needs no deadline of its own. What bounds a review: the body (MAX_BODY), the annotations and the models per
pod (annotations.MAX_MODELS, MAX_ANNOTATION_CHARS: a denial past them), and the ModelCaches, indexed by source
once per change of their list (policy.CacheIndex), so a review costs O(its models + the grants of their sources).
A body over INLINE_BODY (a normal pod is a few KiB) is parsed and reviewed in a thread, SLOW_REVIEWS at a time,
so /healthz and the small reviews keep being answered while it runs. The TLS listener is the daemon's guarded
site (weightcache.listener, LIMITS): with failurePolicy Fail, a webhook whose descriptors a flood of
half-open connections took refuses every annotated pod in the cluster.

Rotated certificates (cert-manager, or a Secret update swapping the mounted `..data` link) are picked up without
a restart: watchdog reports a change in the files' directories, a fresh SSLContext is built from the new files,
and the TLS server-name callback hands it to every new handshake. A half written pair fails to load and the
previous one stays in use.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import ssl
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from weightcache.errors import BadAdmissionReviewError, ConfigError, InvalidRequestError
from weightcache.jsonbody import parse_json
from weightcache.listener import ConnectionLimits, GuardedTCPSite
from weightcache.placement.nodes import NodeFacts
from weightcache.pods.annotations import MAX_MODELS
from weightcache.pods.unknown_keys import Mode
from weightcache.policy import CacheIndex
from weightcache.redact import redact
from weightcache.webhook.mutate import AdmissionReview, review
from weightcache.webhook.mutate import _deny as deny  # the one way a denial is written
from weightcache.webhook.mutate import _request as envelope  # the one check of a review's envelope

log = logging.getLogger(__name__)

ModelCaches = Callable[[], Iterable[Mapping[str, Any]] | CacheIndex]  # an index: built once per change
REVIEW_EXAMPLE = '{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": ..., ...}}'
MAX_BODY = 8 * 1024 * 1024  # a Pod may be ~1.5 MiB in etcd; an AdmissionReview carries it once more as JSON
INLINE_BODY = 64 * 1024  # bodies up to this are reviewed on the event loop (well under a millisecond)
SLOW_REVIEWS = 1  # larger ones run in a thread, one at a time: each holds tens of MB of parsed JSON and the GIL
# kube-apiserver keeps a pool of connections per replica and sends whole requests at once; a review must arrive
# within seconds (the call's own timeout is 10 s by default)
LIMITS = ConnectionLimits(max_connections=256, header_timeout_s=10.0, body_timeout_s=10.0, idle_timeout_s=60.0)


@dataclass(frozen=True)
class Metrics:
    reviews: Counter
    latency: Histogram
    reloads: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> Metrics:
        return cls(
            reviews=Counter(
                "weightcache_webhook_reviews",
                "Admission reviews by outcome: patched, unchanged, denied, bad_request, error",
                ["outcome"],
                registry=registry,
            ),
            latency=Histogram(
                "weightcache_webhook_review_seconds",
                "Time to answer one admission review, from body read to response",
                buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
                registry=registry,
            ),
            reloads=Counter(
                "weightcache_webhook_cert_reloads",
                "Serving certificate reloads by result",
                ["result"],
                registry=registry,
            ),
        )


@dataclass(frozen=True)
class Policy:
    """Where the allow decision's inputs come from."""

    model_caches: ModelCaches
    allow_undeclared: bool
    synced: Callable[[], bool] = lambda: True
    nodes: Callable[[], Sequence[NodeFacts] | None] = lambda: None  # placement's view; None: unknown
    max_models: int = MAX_MODELS  # per pod (`--max-models`)
    unknown_annotations: Mode = "warn"  # an unknown weightcache.io/ key: warn or deny (`--unknown-annotations`)


METRICS = web.AppKey("metrics", Metrics)
REGISTRY = web.AppKey("registry", CollectorRegistry)
POLICY = web.AppKey("policy", Policy)
SLOW = web.AppKey("slow", asyncio.Semaphore)


def make_app(policy: Policy, *, registry: CollectorRegistry | None = None) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY)
    app[REGISTRY] = registry or CollectorRegistry()
    app[METRICS] = Metrics.create(app[REGISTRY])
    app[POLICY] = policy
    app[SLOW] = asyncio.Semaphore(SLOW_REVIEWS)
    app.router.add_post("/mutate", _mutate)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    return app


async def _mutate(request: web.Request) -> web.Response:
    metrics, policy = request.app[METRICS], request.app[POLICY]
    started = time.perf_counter()
    outcome = "error"
    try:
        length = request.content_length
        if length is not None and length <= INLINE_BODY:
            outcome, status, payload = _answer(await request.read(), policy)
        else:  # read it too under the semaphore: a flood of big bodies holds SLOW_REVIEWS of them in memory
            async with request.app[SLOW]:
                raw = await request.read()
                outcome, status, payload = await asyncio.to_thread(_answer, raw, policy)
        return web.Response(body=payload, status=status, content_type="application/json")
    finally:
        metrics.reviews.labels(outcome).inc()
        metrics.latency.observe(time.perf_counter() - started)


def _answer(raw: bytes, policy: Policy) -> tuple[str, int, bytes]:
    """(outcome, HTTP status, JSON body) of one /mutate request; blocking, so big ones run in a thread."""
    try:
        body = parse_json(raw, what="request body", example=REVIEW_EXAMPLE)
        answer = _review(body, policy)
    except (InvalidRequestError, BadAdmissionReviewError) as exc:
        message = redact(str(exc))
        log.warning("rejected webhook request: %s", message)
        return "bad_request", 400, json.dumps({"error": "bad_request", "message": message}).encode()
    response = answer["response"]
    if "status" in response:  # a denial quotes the pod's annotation back: the API server records it in events
        response["status"]["message"] = redact(response["status"]["message"])
    outcome = "patched" if "patch" in response else "unchanged" if response["allowed"] else "denied"
    if outcome == "denied":
        log.info("denied pod in %s: %s", body["request"].get("namespace"), response["status"]["message"])
    return outcome, 200, json.dumps(answer).encode()


def _review(body: Any, policy: Policy) -> AdmissionReview:
    """`review`, except that a well-formed review of a malformed pod (a list where the Pod API has a name, an
    object where it has a list) is denied: the API server shows a denial's message to the user, while an HTTP 400
    is a webhook failure it reports as "failed calling webhook". An unreadable review stays an HTTP 400."""
    try:
        return review(body, model_caches=policy.model_caches(), allow_undeclared=policy.allow_undeclared,
                      nodes=policy.nodes(), max_models=policy.max_models,
                      unknown_annotations=policy.unknown_annotations)
    except (BadAdmissionReviewError, TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        try:
            uid = envelope(body)["uid"]
        except BadAdmissionReviewError:
            if isinstance(exc, BadAdmissionReviewError):
                raise
            raise BadAdmissionReviewError(f"{type(exc).__name__}: {str(exc)[:200]}; send an AdmissionReview v1 like "
                                          f"{REVIEW_EXAMPLE}") from exc
        problem = str(exc) if isinstance(exc, BadAdmissionReviewError) else f"{type(exc).__name__}: {str(exc)[:200]}"
        log.warning("denied a malformed pod: %s", problem)
        return deny(uid, BadAdmissionReviewError(
            f"weightcache cannot read this pod ({problem}); names in spec.containers, initContainers, volumes, env "
            "and volumeMounts must be strings and lists must be lists of objects, as the Pod API requires"))


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _readyz(request: web.Request) -> web.Response:
    if request.app[POLICY].synced():
        return web.Response(text="ok")
    return web.Response(status=503, text="waiting for the first list of ModelCaches")


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


class CertReloader(FileSystemEventHandler):
    """Serves the newest loadable cert/key pair: a base context whose SNI callback swaps in the current one."""

    def __init__(self, cert: Path, key: Path, metrics: Metrics | None = None) -> None:
        self.cert, self.key, self._metrics = cert, key, metrics
        try:
            self.current = self._load()
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"cannot load the serving certificate {cert} with key {key}: {exc}; "
                f"pass --cert and --key of a matching PEM pair"
            ) from exc
        self.context = self.current  # the listening context; its callback hands each handshake the newest pair
        self.context.sni_callback = self._select
        self._loop: asyncio.AbstractEventLoop | None = None
        self._observer: Any = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._observer = Observer()
        for folder in {self.cert.parent, self.key.parent}:
            self._observer.schedule(self, str(folder), recursive=False)
        self._observer.daemon = True
        self._observer.start()

    def stop(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join()

    def on_any_event(self, event: FileSystemEvent) -> None:  # watchdog's thread
        if self._loop is not None and event.event_type not in ("opened", "closed_no_write"):
            self._loop.call_soon_threadsafe(self.reload)

    def reload(self) -> bool:
        """Load the files again if they changed; keep the previous pair when the new one does not load."""
        try:
            if self._contents() == self._loaded:
                return True  # one rotation fires several events; only a real change counts
            self.current = self._load()
        except (OSError, ssl.SSLError) as exc:
            log.warning("keeping the previous serving certificate: %s does not load yet: %s", self.cert, exc)
            result = "failed"
        else:
            log.info("reloaded serving certificate %s", self.cert)
            result = "ok"
        if self._metrics is not None:
            self._metrics.reloads.labels(result).inc()
        return result == "ok"

    def _select(self, sslobj: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        sslobj.context = self.current

    def _contents(self) -> tuple[bytes, bytes]:
        return self.cert.read_bytes(), self.key.read_bytes()

    def _load(self) -> ssl.SSLContext:
        contents = self._contents()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        self._loaded = contents  # may predate a write racing with the load: the next event then reloads again
        return context


@dataclass(frozen=True)
class Running:
    runner: web.AppRunner
    reloader: CertReloader
    port: int

    async def stop(self) -> None:
        self.reloader.stop()
        await self.runner.cleanup()


async def start(app: web.Application, *, cert: Path, key: Path, host: str, port: int) -> Running:
    """Serve `app` over TLS on host:port (0: any free port, read back in `Running.port`)."""
    reloader = CertReloader(cert, key, app[METRICS])
    runner = web.AppRunner(app, access_log=None, **LIMITS.runner_args())
    await runner.setup()
    site = GuardedTCPSite(runner, host, port, limits=LIMITS, ssl_context=reloader.context)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port or stop what "
                          "holds it") from exc
    reloader.start(asyncio.get_running_loop())
    bound = site.port
    log.info("webhook listening on https://%s:%d/mutate", host, bound)
    return Running(runner, reloader, bound)


async def serve(
    policy: Policy,
    *,
    cert: Path,
    key: Path,
    host: str,
    port: int,
    on_ready: Callable[[int], None] | None = None,
) -> None:
    """Run until SIGTERM or SIGINT, then finish in-flight reviews and stop; `on_ready` gets the bound port."""
    running = await start(make_app(policy), cert=cert, key=key, host=host, port=port)
    gc.freeze()  # what startup made (modules, the Kubernetes client) lives forever: keep full collections short
    if on_ready is not None:
        on_ready(running.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await running.stop()
