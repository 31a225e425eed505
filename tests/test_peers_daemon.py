"""Two real daemons (own roots, sockets and peer ports) configured with peerListen / peers / peerTokenFile, one
moto origin behind the fault proxy: the second daemon's fetch costs the origin nothing, and both daemons say so
in their metrics."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from tests.fake_apiserver import FakeApiServer
from tests.faultproxy import FaultProxy
from tests.fixtures_daemon import RunningDaemon, eventually, start_daemon
from tests.fixtures_s3 import S3
from tests.peers_fleet import origin_bytes
from weightcache.cli import build_parser, main
from weightcache.daemon.command import flags_of
from weightcache.daemon.config import load_settings
from weightcache.errors import ConfigError
from weightcache.uri import parse_ref

TOKEN = "fleet-token-0123456789abcdef"
BODY = bytes(range(256)) * 8192  # 2 MiB


def ranged_get_bytes(proxy: FaultProxy) -> int:
    return origin_bytes(proxy, "/models/m/")


def status_json(d: RunningDaemon) -> dict[str, Any]:
    """`weightcache status -o json` against a daemon: where its bytes came from."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["status", "--socket", str(d.socket), "-o", "json"]) == 0
    return dict(json.loads(out.getvalue()))


async def test_a_daemon_fills_from_its_peer_and_the_metrics_say_where_bytes_came_from(
        s3: S3, fault_proxy: FaultProxy, short_dir: Path, model_copy: Path) -> None:
    s3.put("models", "m/w.bin", BODY, ChecksumAlgorithm="SHA256")
    s3.put("models", "m/config.json", b"{}", ChecksumAlgorithm="SHA256")
    token = short_dir / "peer-token"
    token.write_text(TOKEN + "\n")
    common = {"peerTokenFile": str(token), "endpoints": {"s3": {"endpointUrl": fault_proxy.endpoint_url}}}
    (short_dir / "a").mkdir()
    (short_dir / "b").mkdir()
    # a's serving limit (bytesPerSecond.serve) paces what its peer server sends: 2 MiB at 4 MiB/s
    a = await start_daemon(short_dir / "a", model_copy, config={**common, "peerListen": "127.0.0.1:0",
                                                                 "bytesPerSecond": {"serve": "4Mi"}})
    b: RunningDaemon | None = None
    try:
        assert a.daemon.peer_port
        b = await start_daemon(short_dir / "b", model_copy,
                               config={**common, "peers": [f"http://127.0.0.1:{a.daemon.peer_port}"]})
        await asyncio.to_thread(a.client.ensure, "s3://models/m/")
        assert ranged_get_bytes(fault_proxy) == len(BODY) + 2
        snap_b = await asyncio.to_thread(b.client.ensure, "s3://models/m/")
        assert Path(snap_b["path"], "w.bin").read_bytes() == BODY
        # b's bytes came from a, but for the first piece b took of a: a is its only holder, so that piece was
        # judged by the origin's bytes before use (docs/peers.md, "The lying peer"). The 2 MiB file is one piece,
        # too big a share of its blob to judge; config.json's 2 bytes are
        assert ranged_get_bytes(fault_proxy) == len(BODY) + 2 + 2
        assert b.daemon.node is not None and a.daemon.node is not None
        sample = await asyncio.to_thread(b.daemon.node.sample)
        assert sum(sample["weightcache_peer_bytes"].values()) == len(BODY)  # type: ignore[union-attr]
        served = (await asyncio.to_thread(a.daemon.node.sample))["weightcache_peer_served_bytes"]
        assert served == len(BODY) + 2
        assert a.daemon.node.bandwidth.status()["waited_seconds"]["serve"] > 0.2  # type: ignore[index]
        text = (await asyncio.to_thread(b.daemon.node.metrics.exposition)).decode()
        key = parse_ref("s3://models/m/").key  # the metrics port names no URI
        assert f'weightcache_model_fetched_bytes_total{{model="{key}",source="peers"}} 2.097152e+06' in text
        assert f'weightcache_model_fetched_bytes_total{{model="{key}",source="origin"}} 2' in text
        assert "s3://" not in text
        status = await asyncio.to_thread(status_json, b)
        assert (status["peer_bytes"], status["origin_bytes"]) == (len(BODY), 2)
        assert (await asyncio.to_thread(status_json, a))["origin_bytes"] == len(BODY) + 2
    finally:
        if b is not None:
            await b.daemon.stop()
        await a.daemon.stop()


def test_peer_flags_and_config_keys(tmp_path: Path) -> None:
    token = tmp_path / "t"
    token.write_text(TOKEN)
    args = build_parser().parse_args(["daemon", "--peer-listen", "0.0.0.0:9479", "--peer", "http://10.0.0.2:9479",
                                      "--peer", "http://10.0.0.3:9479/", "--peer-token-file", str(token)])
    s = load_settings(None, env={}, flags=flags_of(args))
    assert s.peers.listen == ("0.0.0.0", 9479)
    assert s.peers.urls == ("http://10.0.0.2:9479", "http://10.0.0.3:9479")
    assert s.peers.token_file == token
    env = {"WEIGHTCACHE_PEER_LISTEN": "127.0.0.1:0", "WEIGHTCACHE_PEER_TOKEN_FILE": str(token)}
    assert load_settings(None, env=env).peers.listen == ("127.0.0.1", 0)
    both = load_settings(None, env={**env, "WEIGHTCACHE_PEERS": "http://a:1, http://b:2"})
    assert both.peers.urls == ("http://a:1", "http://b:2")
    with pytest.raises(ConfigError, match="peerTokenFile"):
        load_settings(None, env={}, flags={"peerListen": "0.0.0.0:9479"})
    with pytest.raises(ConfigError, match="peerTokenFile"):
        load_settings(None, env={}, flags={"peers": ["http://10.0.0.2:9479"]})
    with pytest.raises(ConfigError, match="peerListen"):
        load_settings(None, env={}, flags={"peerListen": "nowhere", "peerTokenFile": str(token)})
    with pytest.raises(ConfigError, match="no userinfo") as err:
        load_settings(None, env={}, flags={"peers": ["http://u:hunter2@10.0.0.2:9479"], "peerTokenFile": "/t"})
    assert "hunter2" not in str(err.value)


def model_cache(name: str, pool: str) -> dict[str, Any]:
    return {"metadata": {"name": name},
            "spec": {"source": "s3://models/m/", "nodeSelector": {"pool": pool}, "allowedNamespaces": ["*"]}}


async def test_in_a_cluster_daemons_find_each_other_through_modelcachenode_status(
        cluster: FakeApiServer, s3: S3, fault_proxy: FaultProxy, short_dir: Path, model_copy: Path) -> None:
    s3.put("models", "m/w.bin", BODY, ChecksumAlgorithm="SHA256")
    token = short_dir / "peer-token"
    token.write_text(TOKEN)
    config = {"peerTokenFile": str(token), "peerListen": "127.0.0.1:0",
              "endpoints": {"s3": {"endpointUrl": fault_proxy.endpoint_url}}}
    cluster.create("nodes", {"metadata": {"name": "gpu-2", "labels": {"pool": "b"}}})  # gpu-1 is in pool a100
    cluster.create("modelcaches", model_cache("on-a", "a100"))
    (short_dir / "a").mkdir()
    (short_dir / "b").mkdir()
    a = await start_daemon(short_dir / "a", model_copy, config=config, env={"NODE_NAME": "gpu-1"})
    b: RunningDaemon | None = None
    try:
        def status(name: str) -> dict[str, Any]:
            found = [o for o in cluster.list("modelcachenodes") if o["metadata"]["name"] == name]
            return dict(found[0].get("status") or {}) if found else {}

        await eventually(lambda: status("gpu-1").get("models", {}).get("on-a", {}).get("phase") == "Ready",
                         what="node a to cache the model")
        assert status("gpu-1")["peerAddress"] == f"http://127.0.0.1:{a.daemon.peer_port}"
        b = await start_daemon(short_dir / "b", model_copy, config=config, env={"NODE_NAME": "gpu-2"})
        assert b.daemon.node is not None and b.daemon.node.fetcher.peers is not None
        peers = b.daemon.node.fetcher.peers
        await eventually(lambda: peers.urls == [f"http://127.0.0.1:{a.daemon.peer_port}"], what="b to find a")
        cluster.create("modelcaches", model_cache("on-b", "b"))
        await eventually(lambda: status("gpu-2").get("models", {}).get("on-b", {}).get("phase") == "Ready",
                         what="node b to cache the model")
        assert origin_bytes(fault_proxy, "/models/m/") == len(BODY)  # b's copy came from a
        assert sum(peers.stats.bytes_by_peer.values()) == len(BODY)
    finally:
        if b is not None:
            await b.daemon.stop()
        await a.daemon.stop()
