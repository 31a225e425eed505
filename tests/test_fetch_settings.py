"""One settings reader for every fetch (weightcache/settings.py): the direct CLI, the daemon and the standalone CSI
server read WEIGHTCACHE_* and the config file the same way; one node name; a cold fetch through the daemon's
queue asks the store twice (the queue's lookup, the engine's re-check under its lock)."""

from __future__ import annotations

import logging
import re
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.command import run_cli
from tests.grants import granted
from tests.sample import make_model
from weightcache import defaults, fetch, settings
from weightcache.daemon.config import Settings, load_settings
from weightcache.daemon.metrics import Metrics
from weightcache.daemon.node import MeteredFetcher
from weightcache.errors import ConfigError
from weightcache.fetch_queue import FetchQueue
from weightcache.settings import FetchSettings, load_fetch_settings, node_name
from weightcache.store import Snapshot, Store
from weightcache.uri import ModelRef, parse_ref


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The arguments of every Fetcher built (the real one still runs)."""
    seen: list[dict[str, Any]] = []
    real = fetch.Fetcher.__init__

    def spy(self: fetch.Fetcher, store: Store, **kw: Any) -> None:
        seen.append(kw)
        real(self, store, **kw)

    monkeypatch.setattr(fetch.Fetcher, "__init__", spy)
    return seen


def test_the_direct_cli_prefetch_reads_the_daemons_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       built: list[dict[str, Any]],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    make_model(tmp_path / "m", layers=1, hidden=16, vocab=32, shards=1)
    monkeypatch.setenv("WEIGHTCACHE_CONCURRENCY", "3")
    monkeypatch.setenv("WEIGHTCACHE_READ_TIMEOUT", "7")
    monkeypatch.delenv("WEIGHTCACHE_CONFIG", raising=False)
    rc, _, err = run_cli(capsys, "prefetch", f"file://{tmp_path / 'm'}/", "--root", str(tmp_path / "store"), "-q",
                         "--connect-timeout", "2")
    assert rc == 0, err
    assert [(b["concurrency"], b["read_timeout"], b["connect_timeout"]) for b in built] == [(3, 7.0, 2.0)]
    assert Store(tmp_path / "store").list()  # it fetched


def test_flags_beat_env_and_env_beats_the_file(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("concurrency: 5\nchunkSize: 1Mi\nreadTimeout: 9\nroot: /var/lib/x\nmodels: []\n"
                      "endpoints: {'s3://bkt': {endpointUrl: 'http://minio:9000'}}\n")
    env = {"WEIGHTCACHE_CONFIG": str(config), "WEIGHTCACHE_CONCURRENCY": "4"}
    got = load_fetch_settings(env=env, flags={"readTimeout": 2.5, "chunkSize": None})
    assert (got.concurrency, got.chunk_size, got.read_timeout) == (4, 1 << 20, 2.5)
    assert got.endpoint_for(parse_ref("s3://bkt/m/")) == "http://minio:9000"
    assert got.endpoint_for(parse_ref("s3://other/m/")) is None
    # the daemon's reader sees the same fetch settings from the same file and env
    assert load_settings(env=env, flags={"readTimeout": 2.5}).fetch == got


def test_an_endpoint_flag_overrides_the_most_specific_entry_for_the_references_scheme(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("endpoints: {'s3://bkt': {endpointUrl: 'http://minio:9000'}, s3: {endpointUrl: 'http://s3:1'}}\n")

    class Args:
        endpoint_url = "http://other:9000"

    got = load_fetch_settings(config, env={}, flags=settings.flags_from(Args()))
    for uri in ("s3://bkt/m/", "s3://elsewhere/m/"):
        assert got.endpoint_for(parse_ref(uri)) == "http://other:9000", uri  # bucket entry or none: the flag wins
    assert got.endpoints == (("s3://bkt", "http://minio:9000"), ("s3", "http://s3:1"))
    without = load_fetch_settings(config, env={}, flags=settings.flags_from(object()))
    assert without.endpoint_for(parse_ref("s3://bkt/m/")) == "http://minio:9000"
    assert without.endpoint_for(parse_ref("gs://bkt/m/")) is None
    # the flag's key is no config field: a file that writes it is not read as the flag
    config.write_text("'--endpoint-url': http://planted:1\n")
    assert load_fetch_settings(config, env={}).endpoint_for(parse_ref("s3://bkt/m/")) is None


@pytest.mark.parametrize(("uri", "where"), [("gs://bkt/m/", "STORAGE_EMULATOR_HOST"),
                                            ("az://container/m/", "AZURE_STORAGE_CONNECTION_STRING"),
                                            ("hf://org/m", "HF_ENDPOINT"), ("https://host/m/", "reference itself")])
def test_an_endpoint_flag_for_another_scheme_than_s3_is_refused_not_dropped(uri: str, where: str) -> None:
    """Only the S3 source takes an endpoint URL. Before, `prefetch gs://... --endpoint-url http://web:8080
    --no-daemon` ignored the flag and fetched from STORAGE_EMULATOR_HOST's server (exit 0)."""
    class Args:
        endpoint_url = "http://other:9000"

    got = load_fetch_settings(env={}, flags=settings.flags_from(Args()))
    with pytest.raises(ConfigError, match=f"applies to s3:// only.*{where}"):
        got.endpoint_for(parse_ref(uri))


@pytest.mark.parametrize("key", ["gs", "az://container", "https"])
def test_an_endpoints_entry_for_another_scheme_than_s3_is_refused(key: str, tmp_path: Path) -> None:
    """A config's `endpoints` entry for gs:// or az:// was accepted and never used."""
    config = tmp_path / "config.yaml"
    config.write_text(f"endpoints: {{'{key}': {{endpointUrl: 'http://gcs:2'}}}}\n")
    with pytest.raises(ConfigError, match=f"endpoints.{key}: an endpoint URL applies to s3:// only"):
        load_fetch_settings(config, env={})


def test_an_endpoint_flag_with_credentials_is_refused_without_echoing_them() -> None:
    class Args:
        endpoint_url = "http://minio:hunter2@127.0.0.1:9000"

    with pytest.raises(ConfigError, match="--endpoint-url: credentials do not belong in the URL") as caught:
        load_fetch_settings(env={}, flags=settings.flags_from(Args()))
    assert "hunter2" not in str(caught.value)


def test_the_peer_set_travels_in_the_fetch_settings_to_every_fetcher(tmp_path: Path,
                                                                     built: list[dict[str, Any]]) -> None:
    peers: Any = object()  # a PeerSet stand-in: only handed on
    s = Settings(fetch=FetchSettings(concurrency=2))
    metered = MeteredFetcher(Store(tmp_path), s, Metrics(), peers)
    assert metered.peers is peers
    metered._fetcher(parse_ref("s3://bkt/m/"))
    assert built[0]["peers"] is peers and built[0]["concurrency"] == 2
    assert s.fetch.with_peers(peers) == s.fetch, "the peer set is no setting: it changes no comparison"


def test_no_module_builds_a_fetcher_but_the_settings() -> None:
    package = Path(fetch.__file__).parent.parent  # weightcache/
    sites = [f"{p.relative_to(package)}:{n}" for p in package.rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"(?<![A-Za-z_])Fetcher\(", line)]
    assert len(sites) == 1 and sites[0].startswith("settings.py:"), sites


def test_a_bad_fetch_setting_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="concurrency: expected a whole number >= 1"):
        load_fetch_settings(env={"WEIGHTCACHE_CONCURRENCY": "0"})


def test_the_daemon_builds_its_fetchers_from_the_same_settings(tmp_path: Path, built: list[dict[str, Any]]) -> None:
    s = Settings(fetch=FetchSettings(concurrency=6, read_timeout=4.0, proxies=(("s3", "http://127.0.0.1:65001"),)))
    MeteredFetcher(Store(tmp_path), s, Metrics())._fetcher(parse_ref("s3://bkt/m/"))
    assert built[0]["concurrency"] == 6 and built[0]["read_timeout"] == 4.0
    assert built[0]["proxy_url"] == "http://127.0.0.1:65001"
    assert s.fetch == FetchSettings(6, defaults.CHUNK_SIZE, defaults.CONNECT_TIMEOUT, 4.0, (),
                                    (("s3", "http://127.0.0.1:65001"),))


def test_node_name_setting_then_env_then_hostname_warned_once(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("NODE_NAME", "gpu-7")
    assert node_name("from-config") == "from-config"
    assert node_name(None) == "gpu-7"
    monkeypatch.delenv("NODE_NAME")
    monkeypatch.setattr(settings, "_warned_hostname", type(settings._warned_hostname)())
    with caplog.at_level(logging.WARNING, logger="weightcache.settings"):
        assert node_name() == node_name("") == socket.gethostname()
    assert [r.getMessage() for r in caplog.records].count(
        f"NODE_NAME is not set; using the host name {socket.gethostname()} as the node name") == 1


class CountingStore(Store):
    """A real store that counts how often it is asked for a reference's snapshot."""

    lookups = 0

    def lookup(self, ref: ModelRef) -> Snapshot | None:
        self.lookups += 1
        return super().lookup(ref)


async def test_a_cold_fetch_through_the_daemons_queue_asks_the_store_twice(tmp_path: Path) -> None:
    """What a cold CSI publish does (csi/node.py _ensure goes straight to the queue): the queue's lookup, then the
    engine's re-check under its fetch lock; a warm one asks once."""
    make_model(tmp_path / "m", layers=1, hidden=16, vocab=32, shards=1)
    store = CountingStore(tmp_path / "store")
    fetcher = MeteredFetcher(store, Settings(), Metrics())
    queue = FetchQueue(fetcher)
    grant = granted(f"file://{tmp_path / 'm'}/")
    try:
        cold = await queue.ensure(grant, keep=True)
        assert store.lookups == 2
        store.lookups = 0
        assert (await queue.ensure(grant)).id == cold.id
        assert store.lookups == 1
    finally:
        queue.close()
        fetcher.close()
