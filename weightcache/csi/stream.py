"""Filling one streaming volume's view while its model downloads (docs/streaming-pods.md).

A streaming publish (volume attribute `stream: "true"`, no cached snapshot) mounts `streams/<volume id>/` read-only
on the target at once and hands a `StreamFill` to the model's one fetch as a file subscriber (weightcache/
fetch_queue.py). Each file the volume's grant allows is linked into the view once it is verified and durable; the
state file (`.weightcache/state`) lists the files the view will hold as soon as the listing is known, then says
`complete` (every file of the published snapshot linked) or `failed` (with the error text the CLI prints).

The fill is told of files on the fetch engine's thread and completed on the plugin's pool: one lock orders both,
and `close` (unpublish) makes every later call a no-op, so nothing is linked into a view being removed.
"""

from __future__ import annotations

import logging
import threading

from weightcache.access import Grant
from weightcache.errors import WeightcacheError
from weightcache.fetch import DurableFile
from weightcache.redact import redact
from weightcache.store import Snapshot, StreamViews
from weightcache.vocabulary import STREAM_COMPLETE, STREAM_DIR, STREAM_FAILED, STREAM_FETCHING

logger = logging.getLogger(__name__)


class StreamFill:
    """The view of volume `volume_id`, filled with the files `grant` allows."""

    def __init__(self, views: StreamViews, volume_id: str, grant: Grant) -> None:
        self.volume_id, self.grant = volume_id, grant
        self._views = views
        self._lock = threading.Lock()
        self._closed = False
        self._failed = False
        self._planned: list[str] | None = None
        self._linked: dict[str, int] = {}  # relpath -> size

    def on_file(self, durable: DurableFile) -> None:
        """The fetch queue's file subscriber (the engine's thread): link the file, list the plan on the first."""
        entry = durable.entry
        with self._lock:
            if self._closed or self._failed:
                return
            try:
                if self._planned is None:
                    self._planned = sorted(p for p in durable.planned if self._shown(p))
                    self._views.write_state(self.volume_id, STREAM_FETCHING, self._planned)
                if self._shown(entry.path):  # a file of the same fetch the grant leaves out: never
                    self._link(entry.path, entry.sha256, entry.size)
            except (OSError, WeightcacheError) as exc:
                self._fail_locked(exc)

    def complete(self, snapshot: Snapshot) -> bool:
        """The snapshot is published: link what is not linked yet, state `complete`. False when the view was
        closed or has failed meanwhile (then nothing changes)."""
        with self._lock:
            if self._closed or self._failed:
                return False
            try:
                files = [f for f in snapshot.files if self._shown(f.path)]
                for f in files:
                    self._link(f.path, f.sha256, f.size)
                self._views.write_state(self.volume_id, STREAM_COMPLETE, [f.path for f in files])
            except (OSError, WeightcacheError) as exc:
                self._fail_locked(exc)
                return False
            return True

    def fail(self, exc: BaseException) -> None:
        """The fetch failed: the state says so with its error text; the view keeps what it has."""
        with self._lock:
            if not self._closed and not self._failed:
                self._fail_locked(exc)

    def close(self) -> None:
        """Unpublish: from now on nothing is linked or written."""
        with self._lock:
            self._closed = True

    def usage(self) -> tuple[int, int]:
        """(bytes, files) linked so far."""
        with self._lock:
            return sum(self._linked.values()), len(self._linked)

    def _shown(self, relpath: str) -> bool:
        """In the view: the grant selects it, and it is not under the view's own `.weightcache/` (a model's file
        there is left out, so a source cannot plant a state of its own)."""
        return self.grant.ref.matches(relpath) and relpath.split("/", 1)[0] != STREAM_DIR

    def _link(self, relpath: str, sha256: str, size: int) -> None:
        if relpath not in self._linked:
            self._views.link(self.volume_id, relpath, sha256)
            self._linked[relpath] = size

    def _fail_locked(self, exc: BaseException) -> None:
        self._failed = True
        logger.warning("streaming volume %s of %s failed: %s", self.volume_id, self.grant.ref, exc)
        fail_view(self._views, self.volume_id, exc, self._planned)


def fail_view(views: StreamViews, volume_id: str, exc: BaseException, planned: list[str] | None = None) -> None:
    """State `failed` with the words the CLI would print for `exc`: a WeightcacheError's or an OSError's (redacted
    again: it reaches a pod), an unexpected error's type only (its text may hold anything)."""
    text = redact(str(exc)) if isinstance(exc, WeightcacheError | OSError) else \
        f"internal error ({type(exc).__name__}); see the weightcache daemon's log on the node"
    text += "; delete the pod to try again (its volume is then published anew)"
    try:
        views.write_state(volume_id, STREAM_FAILED, planned, error=text)
    except OSError as write_exc:  # the pod's loader then times out instead, naming the stall
        logger.error("could not write the failed state of streaming volume %s: %s", volume_id, write_exc)
