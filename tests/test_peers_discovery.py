"""Peers in a cluster find each other through ModelCacheNode status (the fake API server validates against the
shipped CRD schema): each daemon writes status.peerAddress and reads the others'."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from tests.fake_apiserver import FakeApiServer, node
from weightcache.kube.report import ModelState, NodeReporter
from weightcache.peers import PeerClient, PeerSet
from weightcache.peers.discovery import advertised_url, discover, peer_urls

TOKEN = b"peer-token-0123456789abcdef"
RBAC = Path(__file__).resolve().parents[1] / "deploy" / "daemonset" / "rbac.yaml"


@pytest.fixture
def server(apiserver: FakeApiServer) -> FakeApiServer:
    for name in ("n1", "n2", "n3", "n4"):
        apiserver.create("nodes", node(name, {}))
    return apiserver


def publish(server: FakeApiServer, name: str, address: str | None) -> None:
    reporter = NodeReporter(server.api_client(), name, min_interval=0)
    reporter.peer_address = address
    reporter.report("llama", ModelState("Ready", bytes_done=1, bytes_total=1, snapshot="s"))


def test_each_daemon_publishes_its_address_and_finds_the_others(server: FakeApiServer) -> None:
    publish(server, "n1", "http://10.0.0.1:9479")
    publish(server, "n2", "http://10.0.0.2:9479")
    publish(server, "n3", "http://user:secret@10.0.0.3:9479")  # not an address we accept: skipped
    publish(server, "n4", None)  # no peer listener
    assert server.get("modelcachenodes", "n1")["status"]["peerAddress"] == "http://10.0.0.1:9479"
    assert "peerAddress" not in server.get("modelcachenodes", "n4")["status"]
    assert discover(server.api_client(), "n1") == ["http://10.0.0.2:9479"]
    assert discover(server.api_client(), "n2") == ["http://10.0.0.1:9479"]


def test_an_unreadable_api_keeps_the_peers_known() -> None:
    config = kubernetes.client.Configuration()
    config.host = "http://127.0.0.1:9"  # nothing listens on the discard port
    config.retries = 0
    assert discover(kubernetes.client.ApiClient(config), "n1") is None


def test_statuses_are_untrusted_input() -> None:
    items: list[Any] = [
        "not an object",
        {"metadata": {"name": "a"}, "status": {"peerAddress": 42}},
        {"metadata": {"name": "b"}, "status": {"peerAddress": "file:///etc/passwd"}},
        {"metadata": {"name": "c"}, "status": {"peerAddress": "http://10.0.0.3:9479/../x"}},
        {"metadata": {"name": "d"}, "status": None},
        {"metadata": {"name": "e"}, "status": {"peerAddress": "https://[fd00::5]:9479"}},
    ]
    assert peer_urls(items, "self") == ["https://[fd00::5]:9479"]


def test_update_keeps_configured_peers_and_follows_discovered_ones() -> None:
    def client(url: str) -> PeerClient:
        return PeerClient(url, TOKEN, connect_timeout=1, read_timeout=1)

    peers = PeerSet([client("http://10.0.0.9:9479")], client)
    peers.update(["http://10.0.0.1:9479", "http://10.0.0.2:9479/"])
    assert peers.urls == ["http://10.0.0.1:9479", "http://10.0.0.2:9479", "http://10.0.0.9:9479"]
    kept = peers.clients[0]
    peers.update(["http://10.0.0.1:9479"])
    assert peers.urls == ["http://10.0.0.1:9479", "http://10.0.0.9:9479"]
    assert peers.clients[0] is kept  # its connection pool stays
    peers.close()


def test_the_advertised_address() -> None:
    assert advertised_url("10.0.0.5", 9479, {}) == "http://10.0.0.5:9479"
    assert advertised_url("0.0.0.0", 9479, {"POD_IP": "10.0.0.6"}) == "http://10.0.0.6:9479"
    assert advertised_url("::", 9479, {"POD_IP": "fd00::6"}) == "http://[fd00::6]:9479"
    assert advertised_url("0.0.0.0", 9479, {}) is None


def test_the_daemon_may_list_modelcachenodes() -> None:
    docs = [d for d in yaml.safe_load_all(RBAC.read_text()) if d and d.get("kind") == "ClusterRole"]
    daemon = next(d for d in docs if any("modelcachenodes/status" in r.get("resources", []) for r in d["rules"]))
    verbs = {v for r in daemon["rules"] if "modelcachenodes" in r.get("resources", []) for v in r["verbs"]}
    assert "list" in verbs
