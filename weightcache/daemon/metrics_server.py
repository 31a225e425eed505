"""The read-only metrics listener (`--metrics-listen HOST:PORT`, config `metricsListen`).

Prometheus scrapes it without a credential, so it serves exactly one thing: `GET /metrics` (and HEAD). Every other
path is 404 and every other method 405; the admin API (PUT/DELETE models, leases) is never reachable here, so
opening this port to the cluster network grants no control over the node.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from weightcache.daemon.metrics import Metrics
from weightcache.errors import ConfigError

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus text exposition format
_METRICS: web.AppKey[Metrics] = web.AppKey("metrics", Metrics)


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
    runner = web.AppRunner(make_metrics_app(metrics), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(f"metricsListen: cannot listen on {host}:{port}: {exc.strerror}; "
                          "pick another port or stop what holds it") from exc
    bound = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    log.info("metrics on http://%s:%d/metrics (read-only, no token)", host, bound)
    return runner, bound
