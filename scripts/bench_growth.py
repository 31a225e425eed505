#!/usr/bin/env python3
"""CPU per GB of a fetch as the model grows: is it flat? One http fetch per size from nginx on 127.0.0.1.

    .venv/bin/python scripts/bench_growth.py [--sizes 1,4,8,16] [--runs 1] [--dir DIR] [--baseline DIR]

Each fetch runs in a fresh process and is timed there after its imports (the interpreter's start is a fixed cost,
not a per-GB one), with getrusage (user and system CPU, minor faults), the cyclic GC's collections and their time
per generation (gc.callbacks), and the direct reclaim the kernel charged to it (/proc/vmstat pgsteal_direct).
The model and the store of each size are deleted before the next (a 16 GB row needs 33 GB free on --dir's disk:
the origin's copy, the store's, and the 1 GiB free-space floor the fetch is given here; the store's default, 10 %
of the disk, refused an 8 GB fetch on the shared development disk). Sizes are interleaved run by run; the load
average is printed with each row (other tenants move CPU s/GB more than size does on a shared machine).
`--baseline DIR`: another checkout's weightcache (a `git worktree`) fetches each model too, right after this one's,
into a store of its own (rows marked "base").

    .venv/bin/python scripts/bench_growth.py --bare [--sizes 1,4,8] [--runs 2]

The write path alone, no network and no hash: a loop writing each size from one 1 MiB buffer with `pwrite`,
writeback started every 8 MiB as the fetch does, the pages kept (as before) or dropped 32 MiB behind
(download.drop_cached, as a fetch nobody streams does now), interleaved; system CPU s/GB per row.
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
store = Store(root, min_free_bytes=1 << 30, min_free_percent=0)
gc.callbacks.append(watch)
s0, r0, t0 = steal(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
Fetcher(store).ensure(grant)
seconds, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"seconds": seconds, "user": r1.ru_utime - r0.ru_utime, "sys": r1.ru_stime - r0.ru_stime,
                  "minflt": r1.ru_minflt - r0.ru_minflt, "reclaimed_mb": (steal() - s0) * 4096 / 1e6,
                  "gc": [gen[g][0] for g in range(3)], "gc_s": sum(v[1] for v in gen.values())}))
"""


BARE = """
import os, resource, sys
from weightcache import download
path, size, drop = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "drop"
buf = memoryview(bytearray(os.urandom(download.PIECE)))
r0 = resource.getrusage(resource.RUSAGE_SELF)
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
os.posix_fallocate(fd, 0, size)
for pos in range(0, size, len(buf)):
    os.pwrite(fd, buf, pos)
    end = pos + len(buf)
    if end % download.WRITEBACK_STEP == 0:
        download._start_writeback(fd, end - download.WRITEBACK_STEP, download.WRITEBACK_STEP)
        if drop and end >= download.DROP_LAG + download.WRITEBACK_STEP:
            download.drop_cached(fd, end - download.DROP_LAG - download.WRITEBACK_STEP, download.WRITEBACK_STEP)
os.fsync(fd)
os.close(fd)
r1 = resource.getrusage(resource.RUSAGE_SELF)
print(r1.ru_stime - r0.ru_stime, r1.ru_utime - r0.ru_utime)
"""


def bare(sizes: list[float], runs: int, where: str | None) -> None:
    """The write loop alone (BARE), pages kept and dropped behind, interleaved."""
    print(f"{'GB':>6} {'run':>3} {'pages':>5} {'sys s/GB':>8} {'user s/GB':>9} {'load':>5}")
    for run in range(runs):
        for gb in sizes if run % 2 == 0 else reversed(sizes):
            for mode in ("keep", "drop") if run % 2 == 0 else ("drop", "keep"):
                fd, path = tempfile.mkstemp(prefix="wc-growth-", dir=where)
                os.close(fd)
                size = int(gb * 1e9) // (1 << 20) * (1 << 20)
                try:
                    out = subprocess.run([sys.executable, "-c", BARE, path, str(size), mode], cwd=ROOT, check=True,
                                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
                finally:
                    os.unlink(path)
                system, user = (float(x) for x in out.stdout.split())
                print(f"{size / 1e9:6.2f} {run + 1:>3} {mode:>5} {system / size * 1e9:8.2f} {user / size * 1e9:9.2f} "
                      f"{os.getloadavg()[0]:5.1f}", flush=True)


def main() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_prefetch import Nginx, make_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,4", help="model sizes in GB, comma-separated")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--baseline", default=None, help="another checkout whose weightcache fetches each model too")
    ap.add_argument("--bare", action="store_true", help="the write loop alone, pages kept and dropped behind")
    args = ap.parse_args()
    if args.bare:
        print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
        bare([float(s) for s in args.sizes.split(",")], args.runs, args.dir)
        return
    codes = [("", ROOT), *([("base", Path(args.baseline).resolve())] if args.baseline else [])]
    sizes = [float(s) for s in args.sizes.split(",")]
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    print(f"{'GB':>6} {'run':>3} {'code':>4} {'GB/s':>6} {'CPU s/GB':>8} {'user':>6} {'sys':>6} {'minflt/GB':>9} "
          f"{'reclaim MB':>10} {'GC gen0/1/2':>11} {'GC s':>6} {'load':>5}")
    for run in range(args.runs):
        for gb in sizes if run % 2 == 0 else reversed(sizes):
            work = Path(tempfile.mkdtemp(prefix="wc-growth-", dir=args.dir))
            free = shutil.disk_usage(work).free
            if free < (2 * gb + 1.1) * 1e9:
                shutil.rmtree(work, ignore_errors=True)
                print(f"{gb:6.2f} {run + 1:>3} skipped: {free / 1e9:.1f} GB free on {work.parent}, the row needs "
                      f"{2 * gb + 1.1:.1f}", flush=True)
                continue
            outs = []
            try:
                size = make_model(work / "origin" / "model", gb, max(1, round(gb * 2)))
                nginx = Nginx(work / "origin", work)
                try:
                    for name, code in codes if run % 2 == 0 else codes[::-1]:
                        outs.append((name, subprocess.run(
                            [sys.executable, "-c", CHILD, f"{nginx.url}/model/", str(work / f"root{name}")],
                            cwd=code, env={**os.environ, "PYTHONPATH": str(code)}, capture_output=True, text=True)))
                        subprocess.run(["chmod", "-R", "u+w", str(work / f"root{name}")], check=False)
                        shutil.rmtree(work / f"root{name}", ignore_errors=True)
                finally:
                    nginx.stop()
            finally:
                subprocess.run(["chmod", "-R", "u+w", str(work)], check=False)
                shutil.rmtree(work, ignore_errors=True)
            for name, out in outs:
                if out.returncode != 0:
                    print(f"{gb:6.2f} {run + 1:>3} {name:>4} failed: {out.stderr.strip().splitlines()[-1:]}",
                          flush=True)
                    continue
                r = json.loads(out.stdout.strip().splitlines()[-1])
                g = size / 1e9
                print(f"{g:6.2f} {run + 1:>3} {name:>4} {g / r['seconds']:6.2f} {(r['user'] + r['sys']) / g:8.2f} "
                      f"{r['user'] / g:6.2f} {r['sys'] / g:6.2f} {r['minflt'] / g:9.0f} {r['reclaimed_mb']:10.0f} "
                      f"{'/'.join(map(str, r['gc'])):>11} {r['gc_s']:6.3f} {os.getloadavg()[0]:5.1f}", flush=True)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
