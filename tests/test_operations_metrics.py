"""The read-only metrics port: a real daemon started with `metricsListen`, scraped over TCP like Prometheus would;
everything but GET/HEAD /metrics is refused there, without any token."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import aiohttp
import pytest

from tests import fixtures_daemon
from tests.fixtures_daemon import start_daemon
from weightcache.cli import build_parser
from weightcache.daemon import metrics_server
from weightcache.daemon.command import flags_of
from weightcache.daemon.config import load_settings
from weightcache.errors import ConfigError
from weightcache.listener import ConnectionLimits
from weightcache.uri import parse_ref

# fixtures, used by name
off_cluster, tiny_model = fixtures_daemon.off_cluster, fixtures_daemon.tiny_model
short_dir, model_copy = fixtures_daemon.short_dir, fixtures_daemon.model_copy


async def test_metrics_port_serves_only_metrics(short_dir: Path, model_copy: Path) -> None:
    running = await start_daemon(short_dir, model_copy, config={"metricsListen": "127.0.0.1:0"})
    try:
        port = running.daemon.metrics_port
        assert port
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            async with http.get("/metrics") as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                body = await r.text()
            assert "# TYPE" in body and "weightcache_" in body
            async with http.head("/metrics") as r:
                assert r.status == 200
            for method, path in [("PUT", "/v1/models"), ("GET", "/v1/models"), ("DELETE", "/v1/models/x"),
                                 ("POST", "/v1/leases"), ("GET", "/healthz"), ("GET", "/"), ("GET", "/metrics/x")]:
                async with http.request(method, path, json={"uri": running.model_uri}) as r:
                    assert r.status == 404, (method, path)
            for method in ("PUT", "POST", "DELETE", "PATCH"):
                async with http.request(method, "/metrics") as r:
                    assert r.status == 405, method
        # the admin API is untouched by any of it: nothing was fetched
        assert await asyncio.to_thread(running.client.list) == []
    finally:
        await running.daemon.stop()
    with pytest.raises(OSError):  # stopped with the daemon
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


async def test_half_sent_requests_on_the_metrics_port_cannot_take_the_daemons_descriptors(
        short_dir: Path, model_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hardening III: 562 half-sent requests on the (token-free, default-on) metrics port took every descriptor
    and the Unix-socket API stopped answering. Replayed: 300 of them; the daemon holds at most its cap."""
    # the flood is held for the whole test (a minute's header timeout), so the answers below come during it
    limits = ConnectionLimits(max_connections=8, header_timeout_s=60.0, body_timeout_s=60.0, idle_timeout_s=60.0)
    monkeypatch.setattr(metrics_server, "LIMITS", limits)
    running = await start_daemon(short_dir, model_copy, config={"metricsListen": "127.0.0.1:0"})
    port = running.daemon.metrics_port
    assert port
    baseline = len(os.listdir("/proc/self/fd"))

    def flood() -> list[socket.socket]:
        socks = []
        for _ in range(300):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: n\r\nX-Slow: ")  # headers never finish
            socks.append(sock)
        return socks

    socks = await asyncio.to_thread(flood)
    try:
        await asyncio.sleep(0)  # let the loop accept what the kernel queued
        assert await asyncio.wait_for(asyncio.to_thread(running.client.list), 30) == []  # the Unix API answers
        held_by_daemon = len(os.listdir("/proc/self/fd")) - baseline - len(socks)  # the test's own sockets aside
        assert held_by_daemon <= limits.max_connections + 8, held_by_daemon
        # Prometheus, sending whole requests, still scrapes during the flood
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http, http.get("/metrics") as r:
            assert r.status == 200 and "weightcache_build_info" in await r.text()
    finally:
        for sock in socks:
            sock.close()
        await running.daemon.stop()


async def test_metrics_port_names_no_model_uri(short_dir: Path, model_copy: Path) -> None:
    """Hardening III: /metrics (no token) listed every model URI, and bucket/prefix names leak tenants' models."""
    running = await start_daemon(short_dir, model_copy, config={"metricsListen": "127.0.0.1:0"})
    try:
        await asyncio.to_thread(running.client.ensure, running.model_uri)
        async with (aiohttp.ClientSession(f"http://127.0.0.1:{running.daemon.metrics_port}") as http,
                    http.get("/metrics") as r):
            body = await r.text()
        key = parse_ref(running.model_uri).key
        assert f'weightcache_model_fetched_bytes_total{{model="{key}",source="origin"}}' in body
        assert running.model_uri not in body and str(running.model_dir) not in body
    finally:
        await running.daemon.stop()


async def test_metrics_port_taken_is_a_config_error(short_dir: Path, model_copy: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError, match="another port"):
            await start_daemon(short_dir, model_copy, config={"metricsListen": f"127.0.0.1:{port}"})


@pytest.mark.parametrize(("value", "expected"), [("0.0.0.0:9478", ("0.0.0.0", 9478)), ("[::]:9478", ("::", 9478)),
                                                 ("localhost:0", ("localhost", 0))])
def test_metrics_listen_parses(value: str, expected: tuple[str, int]) -> None:
    assert load_settings(None, env={}, flags={"metricsListen": value}).api.metrics_listen == expected
    assert load_settings(None, env={"WEIGHTCACHE_METRICS_LISTEN": value}).api.metrics_listen == expected


@pytest.mark.parametrize("value", ["9478", ":9478", "host:", "host:99999", "host:http"])
def test_metrics_listen_rejects_bad_values(value: str) -> None:
    with pytest.raises(ConfigError, match="metricsListen: expected HOST:PORT"):
        load_settings(None, env={}, flags={"metricsListen": value})


def test_metrics_listen_flag_reaches_the_settings() -> None:
    parser = build_parser()  # `daemon` declares its flags, the settings' own, when it parses
    args = parser.parse_args(["daemon", "--metrics-listen", "0.0.0.0:9478"])
    assert load_settings(None, env={}, flags=flags_of(args)).api.metrics_listen == ("0.0.0.0", 9478)


DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana-dashboard.json"
PODMONITOR = Path(__file__).resolve().parents[1] / "deploy" / "components" / "prometheus" / "podmonitor.yaml"


def exported_names() -> set[str]:
    """Every series name the daemon's and the webhook's registries can produce (counters gain _total, ...)."""
    from prometheus_client import CollectorRegistry

    from weightcache.daemon.metrics import SAMPLED, Metrics
    from weightcache.webhook.server import Metrics as WebhookMetrics

    webhook = CollectorRegistry()
    WebhookMetrics.create(webhook)
    names = set()
    for registry in (Metrics().registry, webhook):
        for family in registry.collect():
            names |= {family.name + s for s in ("", "_total", "_bucket", "_count", "_sum")}
    sampled = {n + s for n in SAMPLED for s in ("", "_total")}  # read from the store etc. at scrape time
    return names | sampled


def test_dashboard_queries_only_real_series_and_filters_by_node_name() -> None:
    import json
    import re

    import yaml

    dashboard = json.loads(DASHBOARD.read_text())
    assert "__inputs" not in dashboard  # no datasource input left unused: the datasource variable picks it
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queried = {n for e in exprs for n in re.findall(r"\bweightcache_[a-z_]+", e)}
    assert queried <= exported_names(), queried - exported_names()
    assert any("weightcache_csi_" in e for e in exprs) and any("weightcache_webhook_" in e for e in exprs)
    (node,) = [v for v in dashboard["templating"]["list"] if v.get("label") == "Node"]
    assert "node)" in node["definition"] and "instance" not in json.dumps(dashboard)
    # the node label exists: the PodMonitor copies the pod's node name into it
    monitor = yaml.safe_load(PODMONITOR.read_text())
    relabel = monitor["spec"]["podMetricsEndpoints"][0]["relabelings"]
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in relabel
    for panel in dashboard["panels"]:
        assert panel.get("datasource", {"uid": "${datasource}"})["uid"] == "${datasource}", panel["title"]
