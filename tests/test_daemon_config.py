"""Daemon settings: YAML file < environment < flags, every field validated with an error that says what to write."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from weightcache import defaults
from weightcache.daemon.config import Settings, apply_live, load_settings, parse_settings
from weightcache.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "deploy" / "daemonset" / "configmap.yaml"


@pytest.mark.parametrize(("text", "expected"), [("500Gi", 500 * 2**30), (4096, 4096), ("1.5T", 1_500_000_000_000)])
def test_sizes_are_kubernetes_quantities(text: object, expected: int) -> None:
    assert parse_settings({"diskBudget": text}).store.disk_budget == expected


@pytest.mark.parametrize("text", ["lots", "5 GB", "-1Gi", True, "1m"])
def test_bad_sizes_name_the_field(text: object) -> None:
    with pytest.raises(ConfigError, match="diskBudget"):
        parse_settings({"diskBudget": text})


def test_file_then_env_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({
        "root": "/srv/file-root", "diskBudget": "100Gi", "memoryBudget": "8Gi", "concurrency": 4, "logFormat": "json",
        "endpoints": {"s3": {"endpointUrl": "http://minio:9000"},
                      "s3://special": {"endpointUrl": "https://special.example"}},
        "models": [{"source": "s3://models/llama/", "tier": "memory", "include": ["*.safetensors"]}],
    }))
    env = {"WEIGHTCACHE_ROOT": "/srv/env-root", "WEIGHTCACHE_DISK_BUDGET": "200Gi", "NODE_NAME": "gpu-1"}
    s = load_settings(path, env=env, flags={"root": "/srv/flag-root", "socket": None})
    assert s.store.root == Path("/srv/flag-root")  # flag beats env beats file
    assert s.store.disk_budget == 200 * 2**30  # env beats file
    assert (s.fetch.concurrency, s.log.format, s.cluster.node_name) == (4, "json", "gpu-1")
    assert s.api.socket == defaults.SOCKET
    (model,) = s.models.warm
    assert (model.ref.uri, model.ref.include, model.tier, model.pin) == ("s3://models/llama/", ("*.safetensors",),
                                                                         "memory", True)
    from weightcache.uri import parse_ref
    assert s.fetch.endpoint_for(parse_ref("s3://special/x/")) == "https://special.example"
    assert s.fetch.endpoint_for(parse_ref("s3://models/x/")) == "http://minio:9000"
    assert s.fetch.endpoint_for(parse_ref("gs://models/x/")) is None
    assert s.config_path == path


def test_config_path_from_env(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("memoryBudget: 8Gi\n")
    assert load_settings(None, env={"WEIGHTCACHE_CONFIG": str(path)}).memory.budget == 8 * 2**30


def test_defaults_and_allow_undeclared_auto() -> None:
    s = load_settings(None, env={})
    assert s == Settings()
    assert s.models.undeclared_allowed(cluster=False) is True and s.models.undeclared_allowed(cluster=True) is False
    assert parse_settings({"allowUndeclaredModels": "true"}).models.undeclared_allowed(cluster=True) is True


@pytest.mark.parametrize(("raw", "message"), [
    ({"diskBudgte": "1Gi"}, "unknown field 'diskBudgte'; did you mean 'diskBudget'"),
    ({"root": "relative/path"}, "root: expected an absolute path"),
    ({"concurrency": 0}, "concurrency: expected a whole number >= 1"),
    ({"models": [{"source": "s3://models/x/", "tier": "gpu"}]}, r"models\[0\].tier: expected one of disk, memory"),
    ({"models": [{"source": "s3://Bad_Bucket/x/"}]}, r"models\[0\].source: invalid model reference"),
    ({"models": [{"src": "s3://models/x/"}]}, r"models\[0\]: expected a mapping with at least source"),
    ({"models": [{"source": "s3://models/x/"}, {"source": "s3://models/x"}]}, r"models\[1\] repeats models\[0\]"),
    ({"tcp": {"port": 9477}}, "tcp.tokenFile: the TCP listener needs a bearer token file"),
    ({"endpoints": {"s3": {"endpointUrl": "http://key:secret@minio:9000"}}}, "credentials do not belong"),
    ({"logFormat": "xml"}, "logFormat: expected one of text, json"),
    ({"csiEndpoint": "/csi/csi.sock"}, "csiEndpoint: expected unix:///"),
    ({"models": [{"source": "s3://models/x/", "tier": "memory"}]}, r"models\[0\].tier: memory needs the memory tier"),
    ({"metricsListen": "127.0.0.1:9\u00b2"}, "metricsListen: expected HOST:PORT"),  # '²'.isdigit() is True
])
def test_invalid_settings_name_the_field(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_settings(raw)


def test_credentials_never_reach_the_error_message() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_settings({"endpoints": {"s3": {"endpointUrl": "http://key:hunter2@minio:9000"}}})
    assert "hunter2" not in str(caught.value)


def test_unreadable_or_non_mapping_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(tmp_path / "missing.yaml", env={})
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_settings(tmp_path / "list.yaml", env={})
    (tmp_path / "bad.yaml").write_text("root: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_settings(tmp_path / "bad.yaml", env={})


def test_live_fields_apply_and_restart_fields_wait() -> None:
    running = parse_settings({"root": "/a", "diskBudget": "1Gi"})
    new = parse_settings({"root": "/b", "diskBudget": "2Gi", "models": [{"source": "s3://models/x/"}]})
    merged, pending = apply_live(running, new)
    assert pending == {"root"}
    assert merged.store.root == Path("/a") and merged.store.disk_budget == 2 * 2**30 and len(merged.models.warm) == 1


def test_the_shipped_example_config_is_valid() -> None:
    configmap = yaml.safe_load(EXAMPLE.read_text())
    s = parse_settings(yaml.safe_load(configmap["data"]["config.yaml"]))
    assert s.models.warm == () and s.store.disk_budget  # no default model: no bucket fetched on every node


def test_the_docs_and_the_chart_schema_are_made_from_the_settings_definition(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/config.md's tables and values.schema.json's `config` are what scripts/gen_config.py makes from the
    settings groups: a key added, renamed or retyped in the code without regenerating them fails here."""
    script = ROOT / "scripts" / "gen_config.py"
    done = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    from weightcache.daemon.config import ENV, KEYS

    doc = (ROOT / "docs" / "config.md").read_text()
    assert [k for k in KEYS if f"| `{k}` |" not in doc] == [] and [e for e in ENV if f"`{e}`" not in doc] == []
    sys.path.insert(0, str(ROOT / "scripts"))
    import gen_config

    drifted = tmp_path / "config.md"  # a hand edit of a generated row is drift too
    drifted.write_text(doc.replace("| `diskBudget` | `WEIGHTCACHE_DISK_BUDGET` |", "| `diskBudget` | |"))
    monkeypatch.setattr(gen_config, "DOC", drifted)
    assert gen_config.main(["--check"]) == 1


def test_peer_ban_seconds_reaches_the_peer_set(tmp_path: Path) -> None:
    from weightcache.daemon.app import _peer_set

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"peerBanSeconds": 30, "peers": ["http://10.0.0.2:9479"],
                                    "peerTokenFile": str(tmp_path / "token")}))
    s = load_settings(path, env={})
    assert s.peers.ban_seconds == 30
    assert _peer_set(s, b"x" * 16).stats.ban_s == 30
    path.write_text(yaml.safe_dump({"peerBanSeconds": "soon"}))
    with pytest.raises(ConfigError, match="peerBanSeconds"):
        load_settings(path, env={})


def test_engine_cache_budgets_reach_the_engine_cache_limits() -> None:
    limits = parse_settings({"engineCacheBudget": "2Gi", "engineCacheNamespaceBudget": "512Mi"}).store.engine_limits
    assert (limits.node_bytes, limits.namespace_bytes) == (2 << 30, 512 << 20)
    assert Settings().store.engine_limits.max_bytes == 4 << 30  # the per-cache bound is not a setting
