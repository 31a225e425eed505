"""Held copies that are whole on disk but must not be handed out now: the device taints' source (no I/O).

A snapshot being evicted, re-verified or found damaged keeps its devices in the slice, tainted
`weightcache.io/unavailable=<state>` (docs/dra.md, "Device taints"), until whole again. Whoever evicts or verifies
marks it here (`states.marking(sid, VERIFYING)`); the slice publisher reads `snapshot()` and puts `version` in
its change token, so a mark is published at the next tick without a store change. One registry per daemon, handed
down as an object (`Node.device_states`): its API, its reconcile and the publisher share it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

EVICTING, VERIFYING, DAMAGED = "evicting", "verifying", "damaged"
KINDS = (EVICTING, VERIFYING, DAMAGED)


@dataclass(frozen=True)
class DeviceState:
    state: str  # one of KINDS
    since: str  # RFC 3339, seconds: the taint's timeAdded (stable, so an unchanged slice is never rewritten)


class DeviceStates:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[str, DeviceState] = {}
        self.version = 0

    def mark(self, snapshot_id: str, state: str) -> None:
        if state not in KINDS:
            raise ValueError(f"device state {state!r} is not one of {', '.join(KINDS)}")
        with self._lock:
            if (old := self._states.get(snapshot_id)) is not None and old.state == state:
                return
            self._states[snapshot_id] = DeviceState(state, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            self.version += 1

    def clear(self, snapshot_id: str) -> None:
        with self._lock:
            if self._states.pop(snapshot_id, None) is not None:
                self.version += 1

    @contextlib.contextmanager
    def marking(self, snapshot_id: str, state: str) -> Iterator[None]:
        """Marked for the block (a verify, an eviction); cleared after unless the block marked it otherwise (a
        verify that found damage marks DAMAGED inside the block: that stays until repaired or evicted)."""
        self.mark(snapshot_id, state)
        try:
            yield
        finally:
            with self._lock:
                current = self._states.get(snapshot_id)
            if current is not None and current.state == state:
                self.clear(snapshot_id)

    def snapshot(self) -> Mapping[str, DeviceState]:
        with self._lock:
            return dict(self._states)

