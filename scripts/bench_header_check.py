"""Time the safetensors header check on 100 MB headers, the largest the format allows (one run, medians of 3).

    .venv/bin/python scripts/bench_header_check.py [--mb 100]

Shapes of header a hostile or just huge file can have: many small tensors (with transformers' {"format": "pt"}
metadata, as real files have), one tensor with a very long shape, long tensor names, a big __metadata__ map; and
two refusals: many tensors with the last one wrong, and many tensors with one name repeated (the decode keeps
pairs, so the repeat is seen). The check has one road (safetensors_check.py: one standard-library json decode, one
pass; headers of CHILD_MIN_BYTES or more in one child process with a memory limit and a timeout). Each row: header
bytes, seconds of the check the fetch engine runs (check_file), MB/s, the longest another thread of the checking
process waited meanwhile, its peak RSS growth and the child's (measured in a fresh process per row), seconds with
the tensor table built (parse_header, the loader's call), the seconds of the standard library's json.loads alone
(the floor of this check) and of safetensors' own Rust parser (safe_open) with the ratio.
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
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from weightcache.errors import SafetensorsHeaderError
from weightcache.safetensors_check import check_file, parse_header


def many_tensors(size: int) -> tuple[bytes, int]:
    n = size // 74  # bytes per entry
    # the metadata transformers writes (so the typed road also takes "__metadata__" out, as on real files)
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    header.update({f"t{i:08d}": {"dtype": "I8", "shape": [1], "data_offsets": [i, i + 1]} for i in range(n)})
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


def last_wrong(size: int) -> tuple[bytes, int]:
    raw, n = many_tensors(size)
    return raw[:raw.rindex(b'"I8"')] + b'"I16"' + raw[raw.rindex(b'"I8"') + 4:], n


def key_repeated(size: int) -> tuple[bytes, int]:
    raw, n = many_tensors(size)
    return raw[:-1] + b',"t00000000":{"dtype":"I8","shape":[1],"data_offsets":[0,1]}}', n


CASES: dict[str, Callable[[int], tuple[bytes, int]]] = {
    "many tensors": many_tensors, "long shape": long_shape, "long names": long_names, "big metadata": big_metadata,
    "last wrong": last_wrong, "key repeated": key_repeated,
}


def median_seconds(run: Callable[[], object]) -> float:
    """Median of 3 runs of `run`, collections off as the check has them; what it returns is freed before the clock
    stops (the check frees its tree too), and an exception counts as the end of the run (a refusal)."""
    times = []
    for _ in range(3):
        gc.disable()
        try:
            start = time.perf_counter()
            try:
                kept = run()
            except Exception:  # a refusal ends the run like a result
                kept = None
            del kept
            times.append(time.perf_counter() - start)
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


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM: unlike ru_maxrss, not inherited across exec from the parent)."""
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) / 1024


def child(path: str) -> None:
    """In a fresh process: the check three times; prints seconds (median), peak RSS growth in MB, the result, the
    longest this process's other thread waited for the GIL meanwhile (ms) and the largest worker's peak RSS."""
    before = peak_rss_mb()
    times, result, stalls = [], "ok", []
    for _ in range(3):
        done = threading.Event()
        ticker = threading.Thread(target=lambda d=done: stalls.append(longest_wait(d)))
        ticker.start()
        start = time.perf_counter()
        try:
            check_file(path)
        except SafetensorsHeaderError as exc:
            result = f"refused: {str(exc).split('invalid safetensors file: ')[-1][:50]}"
        times.append(time.perf_counter() - start)
        done.set()
        ticker.join()
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps([statistics.median(times), peak_rss_mb() - before, result, max(stalls) * 1000, workers]))


def longest_wait(done: threading.Event) -> float:
    """The longest a thread that wants to run every millisecond waited, until `done` (a CSI Probe's view)."""
    longest, last = 0.0, time.perf_counter()
    while not done.wait(0.001):
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    return longest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=100.0, help="header size in MB (default 100, the maximum)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    size = int(args.mb * 1e6)
    print(f"{'header':<13} {'bytes':>11} {'check s':>7} {'MB/s':>5} {'stall ms':>8} {'RSS +MB':>7} {'workers':>7} "
          f"{'table s':>7} {'json s':>6} {'rust s':>6} {'x rust':>6}  result", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in CASES.items():
            raw, data = make(int(size * 0.97))  # the generators overshoot a little; 100 MB is the hard limit
            path = Path(tmp) / "x.safetensors"
            path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data))
            n = path.stat().st_size
            out = subprocess.run([sys.executable, __file__, "--child", str(path)], check=True, capture_output=True,
                                 text=True).stdout
            secs, grown, result, stall, workers = json.loads(out)
            table = median_seconds(functools.partial(parse_header, path, n)) if result == "ok" else None
            parse = median_seconds(functools.partial(json.loads, raw))
            del raw
            rust = safetensors_seconds(path)
            rust_cols = f"{rust:>6.2f} {secs / rust:>6.2f}" if rust else f"{'-':>6} {'-':>6}"
            table_col = f"{table:>7.2f}" if table is not None else f"{'-':>7}"
            print(f"{name:<13} {n:>11,} {secs:>7.2f} {n / secs / 1e6:>5.0f} {stall:>8.0f} {grown:>7.0f} "
                  f"{workers:>7.0f} {table_col} {parse:>6.2f} {rust_cols}  {result}", flush=True)
    print("check s: check_file (the fetch engine's check: headers of CHILD_MIN_BYTES or more in one child); "
          "stall ms: the longest another thread of the checking process waited meanwhile (what a CSI Probe in the "
          "daemon would); RSS +MB: the checking process's peak growth; workers: the largest child's peak RSS; "
          "table s: parse_header (the loader's, tensor table built); json s: the standard library's json.loads "
          "alone (the floor of the check's one decode); rust s: safetensors' own parser (safe_open), which a user of "
          "the format would otherwise run; x rust: check s / rust s. Medians of 3.")


if __name__ == "__main__":
    main()
