"""A fetch's progress: byte and file counts from the workers, at most 5 reports a second to the caller, and at most
one a second to the progress file that processes waiting on the model's fetch lock read (engine.py `_acquire`),
only while one says it waits (`want_progress`): a daemon's fetches have no such waiter, and rewrote the file 5
times a second for nobody."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from weightcache.progress import Progress, RateMeter, progress_wanted, write_progress_file

FILE_EVERY_S = 1.0  # the progress file is rewritten at most this often (a waiter reads it every 0.25 s)


class Reporter:
    """Aggregates byte counts from workers; calls the callback at most 5x/s and rewrites the progress file at most
    once a second while another process waits for it."""

    def __init__(self, uri: str, path: Path, callback: Callable[[Progress], None] | None) -> None:
        self.uri, self.path, self.callback = uri, path, callback
        self._mu = threading.Lock()
        self.done = self.total = self.files_done = self.files_total = 0
        self._phase = "queued"
        self._rate = RateMeter()
        self._last = 0.0
        self._file_at = -FILE_EVERY_S  # when the progress file was last written, or looked to be wanted

    def start(self, total: int, files: int, *, already: int, files_already: int) -> None:
        with self._mu:
            self.total, self.files_total = total, files
            self.done, self.files_done = already, files_already
            self._phase = "downloading"
        self._emit(force=True)

    def add(self, nbytes: int, nfiles: int) -> None:
        with self._mu:
            self.done += nbytes
            self.files_done += nfiles
            if time.monotonic() - self._last < 0.2:  # most calls (one per small file): nothing to emit
                return
        self._emit()

    def phase(self, phase: str, message: str = "") -> None:
        with self._mu:
            self._phase = phase
            if phase == "done":
                self.done, self.files_done = self.total, self.files_total
        self._emit(force=True, message=message)

    def _emit(self, *, force: bool = False, message: str = "") -> None:
        now = time.monotonic()
        with self._mu:
            if not force and now - self._last < 0.2:
                return
            self._last = now
            rate = self._rate.update(self.done, now)
            eta = (self.total - self.done) / rate if rate > 0 else None
            p = Progress(self.uri, self._phase, self.done, self.total, self.files_done, self.files_total, rate, eta,
                         message)
        if self._phase not in ("done", "failed") and now - self._file_at >= FILE_EVERY_S:
            self._file_at = now
            if progress_wanted(self.path):
                with suppress(OSError):  # progress is advisory; a full disk must not fail the fetch
                    write_progress_file(self.path, p)
        if self.callback is not None:
            self.callback(p)
