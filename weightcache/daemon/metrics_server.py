"""The read-only metrics listener (`--metrics-listen HOST:PORT`, config `metricsListen`).

Prometheus scrapes it without a credential, so it serves exactly one thing: `GET /metrics` (and HEAD). Every other
path is 404 and every other method 405; the admin API (PUT/DELETE models, leases) is never reachable here, so
opening this port to the cluster network grants no control over the node. Being token-free and on by default,
it is the daemon's most exposed listener: it is the same guarded site as the API's TCP listener
(`weightcache.listener`: a connection cap, header and body deadlines), or a few hundred half-sent requests
would take the process's descriptors and with them the Unix-socket API, CSI and the store. Its series carry no
model URI (bucket and prefix names say whose models a node holds): a model is labelled by its key (`ref.key`,
the hash its readiness node label carries), which whoever knows the URI computes (`weightcache.uri.model_key`).
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from weightcache.daemon.metrics import Metrics
from weightcache.errors import ConfigError
from weightcache.listener import ConnectionLimits, GuardedTCPSite

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus text exposition format
_METRICS: web.AppKey[Metrics] = web.AppKey("metrics", Metrics)
# A scraper sends one small GET every 15-60 s on a kept-alive connection: a few slots are plenty, and a request
# that is not whole within 5 s is not Prometheus.
LIMITS = ConnectionLimits(max_connections=16, header_timeout_s=5.0, body_timeout_s=5.0, idle_timeout_s=75.0)


async def _metrics(request: web.Request) -> web.Response:
    body = await asyncio.to_thread(request.app[_METRICS].exposition)  # rendering must not hold the event loop
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def make_metrics_app(metrics: Metrics) -> web.Application:
    app = web.Application(client_max_size=1024)  # nothing here takes a body
    app[_METRICS] = metrics
    app.router.add_get("/metrics", _metrics)
    return app


async def start_metrics_server(metrics: Metrics, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Listen on host:port; returns the runner (`await runner.cleanup()` stops it) and the bound port."""
    runner = web.AppRunner(make_metrics_app(metrics), access_log=None, handle_signals=False, **LIMITS.runner_args())
    await runner.setup()
    site = GuardedTCPSite(runner, host, port, limits=LIMITS)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(f"metricsListen: cannot listen on {host}:{port}: {exc.strerror}; "
                          "pick another port or stop what holds it") from exc
    log.info("metrics on http://%s:%d/metrics (read-only, no token)", host, site.port)
    return runner, site.port
