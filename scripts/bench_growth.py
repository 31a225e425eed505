#!/usr/bin/env python3
"""CPU per GB of a fetch as the model grows: is it flat? One http fetch per size from nginx on 127.0.0.1.

    .venv/bin/python scripts/bench_growth.py [--sizes 1,4,8] [--runs 1] [--dir DIR]

Each fetch runs in a fresh process and is timed there after its imports (the interpreter's start is a fixed cost,
not a per-GB one), with getrusage (user and system CPU, minor faults), the cyclic GC's collections and their time
per generation (gc.callbacks), and the direct reclaim the kernel charged to it (/proc/vmstat pgsteal_direct).
The model and the store of each size are deleted before the next (a 16 GB row needs 32 GB free on --dir's disk).
Sizes are interleaved run by run; the load average is printed with each row (other tenants move CPU s/GB more
than size does on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import gc, json, os, resource, sys, time
from weightcache.access import ADMIN, Authority
from weightcache.fetch import Fetcher
from weightcache.store import Store
from weightcache.uri import parse_ref
url, root = sys.argv[1], sys.argv[2]
gen = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
began = [0.0]
def watch(phase, info):
    if phase == "start":
        began[0] = time.perf_counter()
    else:
        gen[info["generation"]][0] += 1
        gen[info["generation"]][1] += time.perf_counter() - began[0]
def steal():
    return sum(int(line.split()[1]) for line in open("/proc/vmstat") if line.startswith("pgsteal_direct"))
grant = Authority().authorize(parse_ref(url), ADMIN)
gc.callbacks.append(watch)
s0, r0, t0 = steal(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
Fetcher(Store(root)).ensure(grant)
seconds, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"seconds": seconds, "user": r1.ru_utime - r0.ru_utime, "sys": r1.ru_stime - r0.ru_stime,
                  "minflt": r1.ru_minflt - r0.ru_minflt, "reclaimed_mb": (steal() - s0) * 4096 / 1e6,
                  "gc": [gen[g][0] for g in range(3)], "gc_s": sum(v[1] for v in gen.values())}))
"""


def main() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_prefetch import Nginx, make_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,4", help="model sizes in GB, comma-separated")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    args = ap.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    print(f"{'GB':>6} {'run':>3} {'GB/s':>6} {'CPU s/GB':>8} {'user':>6} {'sys':>6} {'minflt/GB':>9} "
          f"{'reclaim MB':>10} {'GC gen0/1/2':>11} {'GC s':>6} {'load':>5}")
    for run in range(args.runs):
        for gb in sizes if run % 2 == 0 else reversed(sizes):
            work = Path(tempfile.mkdtemp(prefix="wc-growth-", dir=args.dir))
            try:
                size = make_model(work / "origin" / "model", gb, max(1, round(gb * 2)))
                nginx = Nginx(work / "origin", work)
                try:
                    out = subprocess.run([sys.executable, "-c", CHILD, f"{nginx.url}/model/", str(work / "root")],
                                         cwd=ROOT, capture_output=True, text=True)
                finally:
                    nginx.stop()
            finally:
                subprocess.run(["chmod", "-R", "u+w", str(work)], check=False)
                shutil.rmtree(work, ignore_errors=True)
            if out.returncode != 0:
                print(f"{gb:6.2f} {run + 1:>3} failed: {out.stderr.strip().splitlines()[-1:]}", flush=True)
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            g = size / 1e9
            print(f"{g:6.2f} {run + 1:>3} {g / r['seconds']:6.2f} {(r['user'] + r['sys']) / g:8.2f} "
                  f"{r['user'] / g:6.2f} {r['sys'] / g:6.2f} {r['minflt'] / g:9.0f} {r['reclaimed_mb']:10.0f} "
                  f"{'/'.join(map(str, r['gc'])):>11} {r['gc_s']:6.3f} {os.getloadavg()[0]:5.1f}", flush=True)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
