"""Progress of a fetch: one value, its one-line description, its one wire form, and the file that shares it.

    engine (fetch/report.py) ─▶ Progress ─▶ FetchQueue (as is) ─┬─▶ CSI FetchPendingError: describe()
                                                         ├─▶ API NDJSON / 202: to_wire() ─▶ client ─▶ CLI: from_wire()
                                                         └─▶ progress file: to_wire() / from_wire()

`to_wire` is the only encoding (the API's lines, the CLI's JSON lines, the progress file) and `from_wire` the only
decoding; a wire dict carries `text` (describe(), for people) beside the fields, and every text in it is redacted.
The process that holds a model's fetch lock writes `partial/<model-key>.progress` (tmp + rename, at most once a
second) while any other process waiting on the same model (a second CLI, the CSI plugin) says it waits
(`partial/<model-key>.progress.wanted`, `want_progress`); that process reads it to show progress.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypedDict

from weightcache.redact import redact
from weightcache.units import fmt_bytes


class ProgressWire(TypedDict):
    """The JSON form of a Progress (`Progress.to_wire`): the API's `{"progress": ...}` lines and 202 answers, the
    CLI's JSON lines (with `"event": "progress"`), the progress file."""

    uri: str
    phase: str
    bytes_done: int
    bytes_total: int
    files_done: int
    files_total: int
    rate: float
    eta: float | None
    message: str  # the engine's note (a failure's reason, a queued fetch's place)
    kept: bool
    text: str  # describe(): "fetching s3://...: 37% (12.3 GiB of 33 GiB), ETA 40s"


@dataclass(frozen=True)
class Progress:
    uri: str
    phase: str  # "queued" | "listing" | "downloading" | "publishing" | "done" | "failed"
    bytes_done: int
    bytes_total: int
    files_done: int
    files_total: int
    rate: float  # bytes/s over the recent window
    eta: float | None  # seconds
    message: str = ""
    kept: bool = False  # the fetch goes on if this caller leaves (another one wants it); set by the daemon's API

    @classmethod
    def waiting(cls, uri: str, phase: str = "queued", message: str = "") -> Progress:
        """A fetch with nothing counted yet: queued (`message`: its place), or listing its source."""
        return cls(uri, phase, 0, 0, 0, 0, 0.0, None, message)

    def describe(self) -> str:
        """`fetching s3://models/llama/: 37% (12.3 GiB of 33 GiB), ETA 40s`"""
        if self.phase in ("queued", "listing"):  # a queued fetch's message is its place: "behind 2 downloads"
            return f"fetching {self.uri}: {self.phase}" + (f" {self.message}" if self.message else "")
        pct = 100.0 * self.bytes_done / self.bytes_total if self.bytes_total else 100.0
        text = f"fetching {self.uri}: {pct:.0f}% ({fmt_bytes(self.bytes_done)} of {fmt_bytes(self.bytes_total)})"
        if self.eta is not None and self.phase == "downloading":
            text += f", ETA {_duration(self.eta)}"
        elif self.phase not in ("downloading",):
            text += f", {self.phase}"
        return text

    def to_wire(self) -> ProgressWire:
        """The one JSON form; texts redacted (a failure's note may quote a source's URL)."""
        return {"uri": redact(self.uri), "phase": self.phase, "bytes_done": self.bytes_done,
                "bytes_total": self.bytes_total, "files_done": self.files_done, "files_total": self.files_total,
                "rate": self.rate, "eta": self.eta, "message": redact(self.message), "kept": self.kept,
                "text": redact(self.describe())}

    @classmethod
    def from_wire(cls, data: dict[str, Any] | ProgressWire) -> Progress:
        """The value back from its JSON form (`text` is derived, so it is dropped; unknown keys too)."""
        if not isinstance(data, dict):
            raise TypeError(f"a progress is a JSON object, not {type(data).__name__}")
        values: dict[str, Any] = {k: v for k, v in data.items() if k in _FIELDS}
        return cls(**values)


_FIELDS = frozenset(f.name for f in fields(Progress))


def _duration(seconds: float) -> str:
    s = int(seconds + 0.5)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


class RateMeter:
    """Bytes/s over a sliding window of a few seconds, for ETA."""

    def __init__(self, window: float = 3.0) -> None:
        self.window = window
        self.samples: list[tuple[float, int]] = []

    def update(self, total_done: int, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self.samples.append((now, total_done))
        while len(self.samples) > 2 and now - self.samples[0][0] > self.window:
            self.samples.pop(0)
        (t0, b0), (t1, b1) = self.samples[0], self.samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0


def write_progress_file(path: Path, progress: Progress) -> None:
    """tmp + rename without fsync: progress is advisory and rewritten a few times a second."""
    from weightcache.store import tmp_name  # the store package only where a fetch writes progress: not at CLI start

    tmp = tmp_name(path)
    try:
        tmp.write_text(json.dumps(progress.to_wire()))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def want_progress(path: Path) -> None:
    """Say that a process waits on the fetch that writes the progress file `path` (engine.py `_acquire`): the
    fetch writes it only then (`progress_wanted`). A marker file beside it; a fetch's end removes both."""
    with contextlib.suppress(OSError):  # progress is advisory; a link planted as the marker is not followed
        os.close(os.open(_wanted(path), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))


def progress_wanted(path: Path) -> bool:
    return os.path.lexists(_wanted(path))


def drop_progress_files(path: Path) -> None:
    path.unlink(missing_ok=True)
    _wanted(path).unlink(missing_ok=True)


def _wanted(path: Path) -> Path:
    return path.with_name(path.name + ".wanted")


def read_progress_file(path: Path) -> Progress | None:
    try:
        return Progress.from_wire(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
