"""Time the safetensors header check on 100 MB headers, the largest the format allows (one run, median of 3).

    .venv/bin/python scripts/bench_header_check.py [--mb 100]

Shapes of header a hostile or just huge file can have: many small tensors, one tensor with a very long shape,
long tensor names, a big __metadata__ map. Each row: header bytes, seconds, MB/s, peak RSS growth, and beside
them the seconds of the standard library's json.loads alone on the same header (the floor for any check built
on it: the rest is the check's own work) and of safetensors' own Rust parser (safe_open) with the ratio.
The target (issue 9): every row under 2 s for 100 MB.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import resource
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from weightcache.errors import SafetensorsHeaderError
from weightcache.safetensors_check import check_file


def many_tensors(size: int) -> tuple[bytes, int]:
    n = size // 74  # bytes per entry
    header = {f"t{i:08d}": {"dtype": "I8", "shape": [1], "data_offsets": [i, i + 1]} for i in range(n)}
    return json.dumps(header, separators=(",", ":")).encode(), n


def long_shape(size: int) -> tuple[bytes, int]:
    header = {"w": {"dtype": "I8", "shape": [1] * (size // 2), "data_offsets": [0, 1]}}
    return json.dumps(header, separators=(",", ":")).encode(), 1


def long_names(size: int) -> tuple[bytes, int]:
    n = 100
    header = {f"{i:03d}" + "n" * (size // n): {"dtype": "I8", "shape": [1], "data_offsets": [i, i + 1]}
              for i in range(n)}
    return json.dumps(header, separators=(",", ":")).encode(), n


def big_metadata(size: int) -> tuple[bytes, int]:
    meta = {f"k{i}": "v" * 40 for i in range(size // 54)}
    header = {"__metadata__": meta, "w": {"dtype": "I8", "shape": [1], "data_offsets": [0, 1]}}
    return json.dumps(header, separators=(",", ":")).encode(), 1


CASES: dict[str, Callable[[int], tuple[bytes, int]]] = {
    "many tensors": many_tensors, "long shape": long_shape, "long names": long_names, "big metadata": big_metadata,
}


def median_seconds(run: Callable[[], object]) -> float:
    """Median of 3 runs of `run`, collections off as the check has them; what it returns is freed after the clock
    stops, and an exception counts as the end of the run (a refusal)."""
    times = []
    for _ in range(3):
        gc.disable()
        try:
            start = time.perf_counter()
            try:
                kept = run()
            except Exception:  # a refusal ends the run like a result
                kept = None
            times.append(time.perf_counter() - start)
            del kept
        finally:
            gc.enable()
    return statistics.median(times)


def safetensors_seconds(path: Path) -> float | None:
    """The reference implementation (safetensors' Rust parser, via safe_open), None when it is not installed."""
    try:
        from safetensors import safe_open
    except ImportError:
        return None

    def run() -> None:
        with safe_open(str(path), framework="numpy"):
            pass

    return median_seconds(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=100.0, help="header size in MB (default 100, the maximum)")
    args = parser.parse_args()
    size = int(args.mb * 1e6)
    print(f"{'header':<14} {'bytes':>12} {'seconds':>8} {'MB/s':>8} {'RSS +MB':>8} {'json s':>7} "
          f"{'rust s':>7} {'x rust':>6}  result")
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in CASES.items():
            raw, data = make(int(size * 0.97))  # the generators overshoot a little; 100 MB is the hard limit
            path = Path(tmp) / "x.safetensors"
            path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data))
            times, result = [], "ok"
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            for _ in range(3):
                start = time.perf_counter()
                try:
                    check_file(path)
                except SafetensorsHeaderError as exc:
                    result = f"refused: {str(exc)[:60]}"
                times.append(time.perf_counter() - start)
            grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
            secs = statistics.median(times)
            parse = median_seconds(functools.partial(json.loads, raw))
            del raw
            rust = safetensors_seconds(path)
            n = path.stat().st_size
            rust_cols = f"{rust:>7.2f} {secs / rust:>6.2f}" if rust else f"{'-':>7} {'-':>6}"
            print(f"{name:<14} {n:>12,} {secs:>8.2f} {n / secs / 1e6:>8.0f} {grown:>8.0f} {parse:>7.2f} "
                  f"{rust_cols}  {result}")
    print("json s: the standard library's json.loads alone (the floor of a check built on it); rust s: safetensors' "
          "own parser (safe_open), which a user of the format would otherwise run; x rust: ours / theirs. "
          "Medians of 3.")


if __name__ == "__main__":
    main()
