"""Named, guarded background tasks: a task that fails is logged by name at once, never lost in a GC warning.

`Tasks.spawn` keeps a strong reference (asyncio holds only weak ones) and `stop` cancels and awaits them all.
A failed task still raises to whoever awaits it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from weightcache.errors import WeightcacheError

log = logging.getLogger(__name__)
T = TypeVar("T")


class Tasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, name: str, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def names(self) -> list[str]:
        return sorted(t.get_name() for t in self._tasks)

    async def stop(self, *, grace: float = 0.0) -> None:
        """Give the tasks `grace` seconds to end on their own, then cancel the rest and wait for them."""
        tasks = list(self._tasks)
        if tasks and grace > 0:
            await asyncio.wait(tasks, timeout=grace)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()  # also marks it retrieved
        if isinstance(exc, WeightcacheError):
            log.error("%s failed: %s", task.get_name(), exc)
        elif exc is not None:
            log.error("%s failed", task.get_name(), exc_info=exc)
