"""The daemon's HTTP API through its real Unix socket (and its TCP listener with a bearer token)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.faultproxy import FaultProxy
from tests.fixtures_daemon import RunningDaemon, eventually, start_daemon
from tests.fixtures_s3 import S3
from weightcache.errors import InUseError, InvalidReferenceError, NotCachedError
from weightcache.uri import parse_ref


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


async def _ensure_lines(d: RunningDaemon, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with d.http() as http, http.put("/v1/models?wait=1", json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("application/x-ndjson")
        return [json.loads(line) async for line in r.content if line.strip()]


async def test_ensure_wait_streams_progress_then_the_snapshot(daemon: RunningDaemon) -> None:
    lines = await _ensure_lines(daemon, {"uri": daemon.model_uri})
    *progress, final = lines
    assert progress and all(set(p) == {"progress"} for p in progress)
    assert progress[-1]["progress"]["phase"] in ("publishing", "done")
    assert progress[-1]["progress"]["text"].startswith(f"fetching {daemon.model_uri}")
    snap = final["snapshot"]
    assert snap["uri"] == daemon.model_uri and snap["files"] == 6
    assert _tree(Path(snap["path"])) == _tree(daemon.model_dir)


async def test_ensure_without_wait_answers_202_then_200_with_the_snapshot(daemon: RunningDaemon) -> None:
    async with daemon.http() as http:
        async with http.put("/v1/models", json={"uri": daemon.model_uri}) as r:
            assert r.status == 202
            assert (await r.json())["fetching"] == daemon.model_uri
        await _ensure_lines(daemon, {"uri": daemon.model_uri})  # joins the fetch started above
        async with http.put("/v1/models", json={"uri": daemon.model_uri, "pin": True}) as r:
            assert r.status == 200
            snap = (await r.json())["snapshot"]
    info = await asyncio.to_thread(daemon.client.get, snap["id"])
    assert info["pinned"] is True and info["refs"] == [daemon.model_uri]


async def test_client_ensure_list_get_and_errors_map_back_to_exceptions(daemon: RunningDaemon) -> None:
    seen: list[dict[str, Any]] = []
    snap = await asyncio.to_thread(daemon.client.ensure, daemon.model_uri, include=["*.json"],
                                   on_progress=seen.append)
    assert snap["files"] == 4  # config, index, tokenizer, tokenizer_config: the globs reached the fetch
    assert seen and seen[-1]["uri"] == daemon.model_uri
    listed = await asyncio.to_thread(daemon.client.list)
    assert [m["id"] for m in listed] == [snap["id"]]
    with pytest.raises(NotCachedError, match="not in the store"):
        await asyncio.to_thread(daemon.client.get, "0" * 40)
    with pytest.raises(InvalidReferenceError, match="not a snapshot id"):
        await asyncio.to_thread(daemon.client.get, "..")
    with pytest.raises(InvalidReferenceError, match="unknown scheme"):
        await asyncio.to_thread(daemon.client.ensure, "ftp://x/y/")


async def test_delete_is_refused_while_leased_and_names_the_holder(daemon: RunningDaemon) -> None:
    snap = await asyncio.to_thread(daemon.client.ensure, daemon.model_uri)
    lease = await asyncio.to_thread(daemon.client.lease, "pod-a", uri=daemon.model_uri)
    assert lease == {"holder": "pod-a", "snapshot": snap["id"], "path": snap["path"]}
    async with daemon.http() as http, http.delete(f"/v1/models/{snap['id']}") as r:
        assert r.status == 409
        body = await r.json()
    assert body["error"] == "in_use" and body["holders"] == ["pod-a"] and "pod-a" in body["message"]
    with pytest.raises(InUseError):
        await asyncio.to_thread(daemon.client.delete, snap["id"])
    assert Path(snap["path"]).is_dir()  # refusing lost nothing
    await asyncio.to_thread(daemon.client.release, "pod-a")
    await asyncio.to_thread(daemon.client.release, "pod-a")  # idempotent
    assert await asyncio.to_thread(daemon.client.delete, snap["id"]) == {"evicted": snap["id"]}
    assert not Path(snap["path"]).exists()
    assert await asyncio.to_thread(daemon.client.list) == []


@pytest.mark.parametrize(("method", "path", "body", "status", "code"), [
    ("PUT", "/v1/models", b"{not json", 400, "invalid_request"),
    ("PUT", "/v1/models", b'{"uri": "s3://Bad_Bucket/x/"}', 400, "invalid_reference"),
    ("PUT", "/v1/models", b'{"uri": "s3://models/x/", "tier": "gpu"}', 400, "invalid_reference"),
    ("PUT", "/v1/models", b'{"uri": "s3://models/x/", "colour": 1}', 400, "invalid_reference"),
    ("POST", "/v1/leases", b'{"holder": "a/b", "uri": "s3://models/x/"}', 400, "invalid_reference"),
    ("POST", "/v1/leases", b'{"holder": "pod-b", "uri": "s3://models/never-fetched/"}', 404, "not_cached"),
    ("GET", "/v1/nothing-here", None, 404, "not_found"),
    ("POST", "/v1/models", b"{}", 405, "method_not_allowed"),
])
async def test_bad_requests_get_json_errors(daemon: RunningDaemon, method: str, path: str, body: bytes | None,
                                            status: int, code: str) -> None:
    async with daemon.http() as http, http.request(method, path, data=body) as r:
        assert r.status == status
        answer = await r.json()
    assert answer["error"] == code and answer["message"]


async def test_a_failed_fetch_ends_the_stream_with_an_error_line(daemon: RunningDaemon, short_dir: Path) -> None:
    lines = await _ensure_lines(daemon, {"uri": f"file://{short_dir}/missing/"})
    assert lines[-1]["error"].startswith("source") and "missing" in lines[-1]["message"]
    assert await asyncio.to_thread(daemon.client.list) == []


async def test_metrics_parse_and_count_misses_hits_and_origin_bytes(daemon: RunningDaemon) -> None:
    await asyncio.to_thread(daemon.client.ensure, daemon.model_uri)
    await asyncio.to_thread(daemon.client.ensure, daemon.model_uri)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(await asyncio.to_thread(daemon.client.metrics))
               for s in family.samples}
    size = sum(p.stat().st_size for p in daemon.model_dir.iterdir())
    file_ = (("scheme", "file"),)
    assert samples[("weightcache_cache_misses_total", file_)] == 1
    assert samples[("weightcache_cache_hits_total", file_)] == 1
    assert samples[("weightcache_origin_bytes_total", file_)] == size
    assert samples[("weightcache_fetch_duration_seconds_count", file_)] == 1
    # every file of the one snapshot published, by what checked it against the source: file:// has no checksum
    assert samples[("weightcache_published_files_total", (("check", "none"), ("scheme", "file")))] == \
        len(list(daemon.model_dir.iterdir()))
    assert samples[("weightcache_store_used_bytes", ())] == size
    assert samples[("weightcache_snapshots", ())] == 1
    assert samples[("weightcache_leases", ())] == 0
    assert samples[("weightcache_fetches_in_flight", ())] == 0


async def test_socket_is_0660_and_probes_answer(daemon: RunningDaemon) -> None:
    mode = os.stat(daemon.socket).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o660
    assert await asyncio.to_thread(daemon.client.ready) == {"ready": True, "checks": {"store": True}}
    assert await asyncio.to_thread(daemon.client.available)


async def test_a_second_daemon_on_a_live_socket_is_refused(daemon: RunningDaemon, short_dir: Path,
                                                           model_copy: Path) -> None:
    from weightcache.errors import ConfigError

    other = short_dir / "other"
    other.mkdir()
    with pytest.raises(ConfigError, match="another process serves"):
        await start_daemon(other, model_copy, socket=daemon.socket)
    assert await asyncio.to_thread(daemon.client.available)  # the running one kept its socket


async def test_tcp_listener_needs_the_bearer_token(short_dir: Path, model_copy: Path) -> None:
    token_file = short_dir / "token"
    token_file.write_text("s3cr3t-token-0123456789abcdef\n")
    d = await start_daemon(short_dir, model_copy, config={"tcp": {"port": 0, "tokenFile": str(token_file)}})
    base = f"http://127.0.0.1:{d.daemon.tcp_port}"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/v1/models") as r:
                assert r.status == 401
                assert (await r.json())["error"] == "unauthorized"
            async with http.get(f"{base}/metrics", headers={"Authorization": "Bearer wrong"}) as r:
                assert r.status == 401
            async with http.get(f"{base}/v1/models",
                                headers={"Authorization": "Bearer s3cr3t-token-0123456789abcdef"}) as r:
                assert r.status == 200 and await r.json() == []
            async with http.get(f"{base}/healthz") as r:  # probes stay open
                assert r.status == 200
        assert await asyncio.to_thread(d.client.list) == []  # the Unix socket needs no token
    finally:
        await d.daemon.stop()


async def test_undeclared_models_are_refused_when_the_config_says_so(short_dir: Path, model_copy: Path) -> None:
    d = await start_daemon(short_dir, model_copy, config={"allowUndeclaredModels": False})
    try:
        async with d.http() as http, http.put("/v1/models", json={"uri": "s3://other-bucket/m/"}) as r:
            assert r.status == 403
            body = await r.json()
        assert body["error"] == "not_allowed" and "allowUndeclaredModels" in body["message"]
    finally:
        await d.daemon.stop()


async def test_every_metric_the_grafana_dashboard_queries_is_exported(daemon: RunningDaemon) -> None:
    import re

    await asyncio.to_thread(daemon.client.ensure, daemon.model_uri)
    dashboard = json.loads((Path(__file__).resolve().parents[1] / "deploy" / "grafana-dashboard.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel.get("targets", [])
               for name in re.findall(r"\bweightcache_[a-z_]+", target["expr"])
               if not name.startswith("weightcache_webhook_")}  # the webhook's: test_operations_metrics.py
    families = text_string_to_metric_families(await asyncio.to_thread(daemon.client.metrics))
    exported = {family.name + suffix for family in families for suffix in ("", "_total", "_bucket")}
    missing = queried - exported - {"weightcache_memory_tier_locked_bytes", "weightcache_memory_tier_budget_bytes",
                                    "weightcache_store_budget_bytes"}  # only with a tier / a budget
    assert not missing and len(queried) >= 12


async def test_the_listing_follows_changes_made_by_other_processes_at_once(daemon: RunningDaemon) -> None:
    """The daemon keeps its rendered listing; a CLI writing the store directly must never see it stale."""
    from weightcache.store import Store

    snap = await asyncio.to_thread(daemon.client.ensure, daemon.model_uri)
    other = Store(daemon.root)  # another process's view: its own index connection, its own files
    try:
        steps: list[tuple[Callable[[], None], Callable[[list[dict[str, Any]]], bool]]] = [
                 (lambda: other.lease("cli-holder", snap["id"]), lambda m: m[0]["leases"] == ["cli-holder"]),
                 (lambda: other.pin(snap["id"]), lambda m: m[0]["pinned"]),
                 (lambda: other.unpin(snap["id"]), lambda m: not m[0]["pinned"]),
                 (lambda: other.release("cli-holder"), lambda m: m[0]["leases"] == []),
                 (lambda: other.evict(snap["id"]), lambda m: m == [])]
        for change, check in steps:
            await asyncio.to_thread(daemon.client.list)  # cache the current answer
            change()
            assert check(await asyncio.to_thread(daemon.client.list))
    finally:
        other.close()


async def test_a_client_that_hangs_up_alone_stops_the_fetch(short_dir: Path, model_copy: Path, s3: S3,
                                                             fault_proxy: FaultProxy) -> None:
    s3.upload_dir(model_copy, "models", "tiny/")
    fault_proxy.add("delay", seconds=1.0, method="GET", ranged_only=True, count=-1)
    d = await start_daemon(short_dir, model_copy, config={
        "endpoints": {"s3": {"endpointUrl": fault_proxy.endpoint_url}}, "concurrency": 1, "chunkSize": "64Ki"})
    try:
        async with d.http() as http, http.put("/v1/models?wait=1", json={"uri": "s3://models/tiny/"}) as r:
            while json.loads(await r.content.readline())["progress"]["phase"] != "downloading":
                pass
        # hung up (Ctrl-C) mid-download and nobody else wants the model: the daemon stops fetching it
        node = d.daemon.node
        assert node is not None
        await eventually(lambda: node.fetches.depth() == (0, 0), what="the fetch to stop")
        assert await asyncio.to_thread(node.store.lookup, parse_ref("s3://models/tiny/")) is None
        metrics = await asyncio.to_thread(d.client.metrics)
        assert "weightcache_fetch_failures_total{reason=\"fetch_cancelled\",scheme=\"s3\"} 1.0" in metrics, [
            line for line in metrics.splitlines() if "failures" in line]
    finally:
        await d.daemon.stop()


async def test_a_client_that_hangs_up_does_not_stop_a_fetch_someone_else_wants(short_dir: Path, model_copy: Path,
                                                                               s3: S3, fault_proxy: FaultProxy) -> None:
    s3.upload_dir(model_copy, "models", "tiny/")
    fault_proxy.add("delay", seconds=0.2, method="GET", ranged_only=True, count=-1)
    d = await start_daemon(short_dir, model_copy, config={
        "endpoints": {"s3": {"endpointUrl": fault_proxy.endpoint_url}}, "concurrency": 1, "chunkSize": "64Ki"})
    try:
        async with d.http() as http:
            async with http.put("/v1/models", json={"uri": "s3://models/tiny/"}) as r:  # fire and forget: kept
                assert r.status == 202
            async with http.put("/v1/models?wait=1", json={"uri": "s3://models/tiny/"}) as r:
                assert "progress" in json.loads(await r.content.readline())
        # hung up after one line, but the first request still wants the model: the fetch finishes
        ref = parse_ref("s3://models/tiny/")
        node = d.daemon.node
        assert node is not None
        snap = await eventually(lambda: node.store.lookup(ref), what="the fetch to finish")
        assert _tree(snap.path) == _tree(model_copy)
        size = sum(p.stat().st_size for p in model_copy.iterdir())
        metrics = await asyncio.to_thread(d.client.metrics)
        assert f'weightcache_origin_bytes_total{{scheme="s3"}} {float(size)}' in metrics.splitlines()  # once
    finally:
        await d.daemon.stop()
