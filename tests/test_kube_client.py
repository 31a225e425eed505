"""load_api_client: in-cluster, kubeconfig, or off-cluster; broken configs fail loudly without secrets."""

from __future__ import annotations

import logging

import kubernetes
import pytest
import yaml

from weightcache.errors import ConfigError
from weightcache.kube.client import in_cluster, load_api_client

TOKEN = "sekr1t-token-value-0123456789"


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch, tmp_path):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(kubernetes.config.incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "no-token"))


def kubeconfig(path, server_url: str) -> None:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "c", "cluster": {"server": server_url}}],
        "users": [{"name": "u", "user": {"token": TOKEN}}],
        "contexts": [{"name": "test", "context": {"cluster": "c", "user": "u"}}],
    }))


def test_no_config_means_off_cluster():
    assert not in_cluster()
    assert load_api_client() is None


def test_kubeconfig_is_used_and_the_token_is_not_logged(apiserver, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    apiserver.create("nodes", {"metadata": {"name": "n1"}})
    kubeconfig(tmp_path / "config", apiserver.url)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "config"))
    client = load_api_client()
    assert client is not None and client.configuration.host == apiserver.url
    nodes = kubernetes.client.CoreV1Api(client).list_node()
    assert [n.metadata.name for n in nodes.items] == ["n1"]
    assert TOKEN not in caplog.text


def test_default_kubeconfig_location(tmp_path):
    (tmp_path / "home" / ".kube").mkdir(parents=True)
    kubeconfig(tmp_path / "home" / ".kube" / "config", "http://127.0.0.1:1")
    assert load_api_client().configuration.host == "http://127.0.0.1:1"


def test_broken_kubeconfig_is_an_error_not_off_cluster(tmp_path, monkeypatch):
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Config", "current-context": "missing",
                                    "users": [{"name": "u", "user": {"token": TOKEN}}]}))
    monkeypatch.setenv("KUBECONFIG", str(path))
    with pytest.raises(ConfigError) as info:
        load_api_client()
    assert str(path) in str(info.value) and "KUBECONFIG" in str(info.value)
    assert TOKEN not in str(info.value)


def test_in_cluster_service_account_wins(tmp_path, monkeypatch):
    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text(TOKEN)
    ca.write_text("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n")
    monkeypatch.setattr(kubernetes.config.incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(kubernetes.config.incluster_config, "SERVICE_CERT_FILENAME", str(ca))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    kubeconfig(tmp_path / "config", "http://127.0.0.1:1")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "config"))
    assert in_cluster()
    client = load_api_client()
    assert client.configuration.host == "https://10.0.0.1:443"
