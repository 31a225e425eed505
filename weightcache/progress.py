"""Progress of a fetch: a value, its one-line description, and the file that shares it across processes.

The process that holds a model's fetch lock writes `partial/<model-key>.progress` (tmp + rename, a few times a
second); any other process waiting on the same model (a second CLI, the CSI plugin) reads it to show progress.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from weightcache.store import tmp_name
from weightcache.units import fmt_bytes


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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Progress:
        fields = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in fields})


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
    tmp = tmp_name(path)
    try:
        tmp.write_text(json.dumps(progress.to_json()))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def read_progress_file(path: Path) -> Progress | None:
    try:
        return Progress.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
