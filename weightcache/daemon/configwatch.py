"""Live config reload: watchdog watches the config file's directory, not the file.

A ConfigMap volume never rewrites `config.yaml`; kubelet writes a new timestamped directory and swaps a symlink:

    /etc/weightcache/
      ..2026_12_02_16_00_00.123/config.yaml     the data, one directory per version
      ..data -> ..2026_12_02_16_00_00.123       swapped atomically (new link + rename over ..data)
      config.yaml -> ..data/config.yaml         never changes

so any event in the directory (a rename of `..data`, or an editor's write or rename of a plain file) schedules
a reload. A reload reads through the symlinks, parses and validates everything, and only then hands the new
Settings on; an invalid file is logged with its reason and the running settings stay.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from weightcache.daemon.config import Settings, load_settings
from weightcache.errors import ConfigError

log = logging.getLogger(__name__)

DEBOUNCE_S = 0.2  # kubelet's swap and an editor's save are several events; reload once after they settle


class ConfigWatcher:
    """`await start()`, then `on_change(settings)` runs on the loop after each valid change; `stop()` ends it."""

    def __init__(
        self,
        path: Path,
        on_change: Callable[[Settings], Awaitable[None]],
        *,
        env: Mapping[str, str] | None = None,
        flags: Mapping[str, Any] | None = None,
        on_rejected: Callable[[ConfigError], None] | None = None,
    ) -> None:
        self.path = path
        self._on_change = on_change
        self._on_rejected = on_rejected
        self._env, self._flags = env, flags
        self._digest = _digest(path)
        self._wake = asyncio.Event()
        self._observer: Any = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed while the observer was stopping
                loop.call_soon_threadsafe(self._wake.set)

        handler = _Handler(wake)
        self._observer = Observer()
        self._observer.schedule(handler, str(self.path.parent), recursive=False)
        await asyncio.to_thread(self._observer.start)

    async def run(self) -> None:
        """The watch loop; run it as a named task."""
        while True:
            await self._wake.wait()
            await asyncio.sleep(DEBOUNCE_S)
            self._wake.clear()
            await self.reload()

    async def reload(self) -> bool:
        """Re-read the file; True when new valid settings were handed on."""
        digest = await asyncio.to_thread(_digest, self.path)
        if digest == self._digest:
            return False
        try:
            settings = await asyncio.to_thread(load_settings, self.path, env=self._env, flags=self._flags)
        except ConfigError as exc:
            log.error("config %s refused, keeping the running config: %s", self.path, exc)
            self._digest = digest  # one log line per bad version, not one per event
            if self._on_rejected is not None:
                self._on_rejected(exc)
            return False
        self._digest = digest
        log.info("config %s changed; applying", self.path)
        await self._on_change(settings)
        return True

    def stop(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=5)
            self._observer = None


class _Handler(FileSystemEventHandler):
    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type not in ("opened", "closed_no_write"):  # reads (ours included) change nothing
            self._wake()


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
