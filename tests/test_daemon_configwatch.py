"""Live config reload with real files: a plain file edited in place, and the real ConfigMap `..data` symlink swap."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml

from tests.fixtures_daemon import RunningDaemon, eventually, start_daemon
from weightcache.daemon.config import Settings
from weightcache.daemon.configwatch import ConfigWatcher
from weightcache.daemon.reconcile import PIN_OWNER
from weightcache.errors import ConfigError


class ConfigMapDir:
    """The layout kubelet builds for a ConfigMap volume, updated the way kubelet updates it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.versions = 0
        path.mkdir(parents=True, exist_ok=True)

    def publish(self, text: str) -> None:
        self.versions += 1
        data = self.path / f"..2026_12_02_16_00_00.{self.versions:09d}"
        data.mkdir()
        (data / "config.yaml").write_text(text)
        if not (self.path / "config.yaml").is_symlink():
            (self.path / "..data").symlink_to(data.name)
            (self.path / "config.yaml").symlink_to("..data/config.yaml")
            return
        tmp = self.path / "..data_tmp"
        tmp.symlink_to(data.name)
        os.rename(tmp, self.path / "..data")  # the atomic swap; config.yaml itself never changes


@pytest.fixture
async def watched(tmp_path: Path) -> AsyncIterator[tuple[ConfigMapDir, ConfigWatcher, asyncio.Queue]]:
    cm = ConfigMapDir(tmp_path / "cm")
    cm.publish("diskBudget: 1Gi\n")
    changes: asyncio.Queue[Settings | ConfigError] = asyncio.Queue()

    async def on_change(settings: Settings) -> None:
        changes.put_nowait(settings)

    watcher = ConfigWatcher(cm.path / "config.yaml", on_change, env={}, on_rejected=changes.put_nowait)
    await watcher.start()
    task = asyncio.create_task(watcher.run())
    try:
        yield cm, watcher, changes
    finally:
        task.cancel()
        watcher.stop()


async def test_configmap_symlink_swap_is_applied(watched: tuple[ConfigMapDir, ConfigWatcher, asyncio.Queue]) -> None:
    cm, _, changes = watched
    cm.publish("diskBudget: 2Gi\nmodels: [{source: 's3://models/llama/'}]\n")
    settings = await asyncio.wait_for(changes.get(), 10)
    assert settings.store.disk_budget == 2 * 2**30 and settings.models.warm[0].ref.uri == "s3://models/llama/"


async def test_invalid_config_is_refused_then_a_fixed_one_applies(
        watched: tuple[ConfigMapDir, ConfigWatcher, asyncio.Queue]) -> None:
    cm, _, changes = watched
    cm.publish("diskBudget: 3Gi\nconcurency: 4\n")
    refused = await asyncio.wait_for(changes.get(), 10)
    assert isinstance(refused, ConfigError) and "did you mean 'concurrency'" in str(refused)
    cm.publish("diskBudget: 3Gi\nconcurrency: 4\n")
    settings = await asyncio.wait_for(changes.get(), 10)
    assert settings.fetch.concurrency == 4


async def test_an_unchanged_file_is_not_reapplied(watched: tuple[ConfigMapDir, ConfigWatcher, asyncio.Queue]) -> None:
    cm, watcher, changes = watched
    cm.publish("diskBudget: 1Gi\n")  # same bytes, new version directory
    cm.publish("diskBudget: 5Gi\n")
    settings = await asyncio.wait_for(changes.get(), 10)
    assert settings.store.disk_budget == 5 * 2**30  # the first swap changed nothing, so nothing else was queued
    assert changes.empty() and not await watcher.reload()


async def test_daemon_applies_an_edited_file_live_and_keeps_running_config_on_a_bad_edit(
        short_dir: Path, model_copy: Path) -> None:
    d = await start_daemon(short_dir, model_copy, config={"diskBudget": "1Gi"})
    path = short_dir / "config.yaml"
    try:
        # An in-place edit (not a rename): the model is added, fetched and pinned by the reconcile loop.
        with path.open("w") as f:
            f.write(yaml.safe_dump({"diskBudget": "2Gi", "models": [{"source": d.model_uri}]}))

        def pinned() -> list[str]:
            return [i.snapshot.id for i in d.daemon.node.store.list()
                    if PIN_OWNER in d.daemon.node.store.pins(i.snapshot.id)]
        (snap_id,) = await eventually(pinned, what="the config model to be fetched and pinned")
        assert d.daemon.settings.store.disk_budget == 2 * 2**30 == d.daemon.node.store.budget_bytes

        path.write_text("diskBudget: [not a size]\n")
        await eventually(lambda: _reloads(d, "rejected") == 1, what="the bad edit to be refused")
        assert d.daemon.settings.store.disk_budget == 2 * 2**30 and len(d.daemon.settings.models.warm) == 1

        path.write_text(yaml.safe_dump({"diskBudget": "2Gi", "models": []}))
        await eventually(lambda: not pinned(), what="the removed model to be unpinned")
        assert d.daemon.node.store.get(snap_id)  # unpinned, not deleted: it is still a cache
    finally:
        await d.daemon.stop()


def _reloads(d: RunningDaemon, result: str) -> float:
    registry = d.daemon.node.metrics.registry
    return registry.get_sample_value("weightcache_config_reloads_total", {"result": result}) or 0.0
