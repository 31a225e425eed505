"""The CLI keeps the same free-space floor as the daemon: --min-free-bytes / --min-free-percent, else the daemon's
WEIGHTCACHE_MIN_FREE_BYTES / _PERCENT, else the defaults; both read them through weightcache/store/floor.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.command import weightcache
from tests.fixtures_store import make_models
from weightcache.daemon.config import load_settings
from weightcache.errors import ConfigError
from weightcache.store.floor import ENV_BYTES, ENV_PERCENT, floor_from
from weightcache.store.store import disk_free


def prefetch(tmp_path: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    model = make_models(tmp_path / "src", "m")["m"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTCACHE_")}
    return weightcache("prefetch", f"file://{model}/", "--root", str(tmp_path / "root"), "-q", *flags,
                       env={**clean, **(env or {})})


@pytest.mark.e2e
def test_the_daemons_env_floor_refuses_a_direct_prefetch(tmp_path: Path) -> None:
    beyond = str(disk_free(tmp_path)[1] + (1 << 30))  # more than the disk holds: nothing fits above this floor
    done = prefetch(tmp_path, env={ENV_BYTES: beyond})
    assert done.returncode == 5, done.stderr  # InsufficientSpaceError
    assert not list((tmp_path / "root" / "snapshots").glob("*"))


@pytest.mark.e2e
def test_a_flag_wins_over_the_env(tmp_path: Path) -> None:
    beyond = str(disk_free(tmp_path)[1] + (1 << 30))
    done = prefetch(tmp_path, "--min-free-bytes", "0", "--min-free-percent", "0", env={ENV_BYTES: beyond})
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).is_dir()
    done = prefetch(tmp_path, "--min-free-bytes", beyond)
    assert done.returncode == 5, done.stderr


@pytest.mark.e2e
@pytest.mark.parametrize(("env", "name"), [({ENV_BYTES: "64m"}, ENV_BYTES), ({ENV_PERCENT: "95"}, ENV_PERCENT),
                                           ({ENV_PERCENT: "nan"}, ENV_PERCENT)])
def test_a_bad_env_value_is_exit_2_naming_the_variable(tmp_path: Path, env: dict[str, str], name: str) -> None:
    done = prefetch(tmp_path, env=env)
    assert done.returncode == 2 and name in done.stderr, done.stderr


@pytest.mark.e2e
def test_a_bad_flag_is_a_usage_error(tmp_path: Path) -> None:
    done = prefetch(tmp_path, "--min-free-percent", "120")
    assert done.returncode == 2 and "between 0 and 90" in done.stderr


def test_daemon_config_and_cli_read_the_env_alike() -> None:
    env = {ENV_BYTES: "1Gi", ENV_PERCENT: "20"}
    settings = load_settings(None, env=env, flags={})
    assert (settings.store.min_free_bytes, settings.store.min_free_percent) == floor_from(env) == (1 << 30, 20.0)
    assert floor_from({}) == (None, None)  # set nowhere: the store's own (limits.json), else the defaults
    for bad in ({ENV_PERCENT: "91"}, {ENV_BYTES: "-1"}):
        with pytest.raises(ConfigError):
            floor_from(bad)
        with pytest.raises(ConfigError):
            load_settings(None, env=bad, flags={})


async def test_the_daemons_floor_and_budget_are_kept_for_every_command(short_dir: Path, model_copy: Path) -> None:
    """Hardening IV: the floor and budget are the store's (limits.json): written by the daemon at start and on a
    config change, read by a command that sets none (a direct prefetch, gc, evict, a store's recovery)."""
    from dataclasses import replace

    from tests.fixtures_daemon import start_daemon
    from weightcache.store import Store

    config = {"diskBudget": "1Gi", "minFreeBytes": "1Mi", "minFreePercent": 0}
    d = await start_daemon(short_dir, model_copy, config=config)
    try:
        kept = Store(d.root, evict_to_floor=False)
        assert (kept.budget_bytes, kept.min_free_bytes, kept.min_free_percent) == (1 << 30, 1 << 20, 0.0)
        assert kept.limits.set_by == "daemon"
        s = d.daemon.settings  # the budget dropped, the floor raised: live
        await d.daemon.apply(replace(s, store=replace(s.store, disk_budget=None, min_free_bytes=2 << 20)))
        again = Store(d.root, evict_to_floor=False)
        assert (again.budget_bytes, again.min_free_bytes) == (None, 2 << 20)
    finally:
        await d.daemon.stop()
