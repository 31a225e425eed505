"""Time the safetensors header check on 100 MB headers, the largest the format allows (one run, median of 3).

    .venv/bin/python scripts/bench_header_check.py [--mb 100]

Shapes of header a hostile or just huge file can have: many small tensors, one tensor with a very long shape,
long tensor names, a big __metadata__ map. Each row: header bytes, seconds, MB/s, peak RSS growth, and beside
them the seconds of the standard library's json.loads alone on the same header (the floor for any check built
on it: the rest is the check's own work). The target (issue 9): every row under 2 s for 100 MB.
"""

from __future__ import annotations

import argparse
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


def json_seconds(raw: bytes) -> float:
    """Median of 3 json.loads of the header alone, collections off as the check has them."""
    times = []
    for _ in range(3):
        gc.disable()
        try:
            start = time.perf_counter()
            parsed = json.loads(raw)
            times.append(time.perf_counter() - start)
            del parsed  # freed after the clock stops
        finally:
            gc.enable()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=100.0, help="header size in MB (default 100, the maximum)")
    args = parser.parse_args()
    size = int(args.mb * 1e6)
    print(f"{'header':<14} {'bytes':>12} {'seconds':>8} {'MB/s':>8} {'RSS +MB':>8} {'json s':>7}  result")
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in CASES.items():
            raw, data = make(int(size * 0.97))  # the generators overshoot a little; 100 MB is the hard limit
            path = Path(tmp) / "x.safetensors"
            path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data))
            parse = json_seconds(raw)
            del raw
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
            n = path.stat().st_size
            print(f"{name:<14} {n:>12,} {secs:>8.2f} {n / secs / 1e6:>8.0f} {grown:>8.0f} {parse:>7.2f}  {result}")


if __name__ == "__main__":
    main()
