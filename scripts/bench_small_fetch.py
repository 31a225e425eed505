"""Benchmark: where a small model's cold fetch spends its time inside a warm process (as in the node daemon: no
interpreter start, imports or client built), phase by phase, and what each of a few variants changes.

Ceph radosgw on 127.0.0.1 (tests_objstores/servers.py) holds a model of --size-gb in one shard, uploaded as
`aws s3 cp` would (multipart from 8 MiB, so the shard is checked by the MD5 of its part MD5s). One Fetcher with
the daemon's settings (load_fetch_settings) and a ClientPool as the daemon's (its botocore client kept between
fetches) fetches it once to warm botocore, then --runs times per variant, interleaved (a new order each run),
each into a new store: wall and process CPU seconds of `Fetcher.ensure`, when
the last byte arrived, when the in-order hashing ended, and the GETs made.

    .venv/bin/python scripts/bench_small_fetch.py [--size-gb 0.088] [--runs 9] [--variants default,no-md5,range-8]

Variants: `default`; `no-md5` (the multipart ETag's MD5 left out: what that check costs, for measurement only);
`drop-behind` (the hashed bytes dropped from the page cache behind the frontier, as a fetch under
download.DROP_BEHIND_MIN did before); `in-order-md5` (the part MD5s taken at the in-order frontier only, beside
sha256, as before each part took the pieces that continue it as they arrived: `CompositeMD5.update_at`);
`range-N` (ranges of N MiB instead of range_size's).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.bench_prefetch import make_model, upload
from tests_objstores.servers import ceph_rgw


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=0.088)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--variants", default="default,no-md5")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    with tempfile.TemporaryDirectory(prefix="wc-small-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        make_model(work / "model", args.size_gb, 1)
        files = sorted(p.name for p in (work / "model").iterdir())
        rgw = stack.enter_context(ceph_rgw(work / "ceph"))
        upload(rgw.endpoint_url, rgw.access_key, rgw.secret_key, work / "model", files)
        os.environ.update(AWS_ENDPOINT_URL=rgw.endpoint_url, AWS_ACCESS_KEY_ID=rgw.access_key,
                          AWS_SECRET_ACCESS_KEY=rgw.secret_key, AWS_DEFAULT_REGION="us-east-1")
        rows = run(work, variants, args.runs)
    print(f"\n{'variant':<10} {'wall s':>7} {'CPU s':>6} {'last byte s':>11} {'hashed s':>8} {'GETs':>5}   walls")
    for variant, got in rows.items():
        def med(i: int, got: list[tuple[float, ...]] = got) -> float:
            return statistics.median(r[i] for r in got)
        print(f"{variant:<10} {med(0):>7.3f} {med(1):>6.3f} {med(2):>11.3f} {med(3):>8.3f} {med(4):>5.0f}   "
              + " ".join(f"{r[0]:.2f}" for r in got))
    print(f"Medians of {args.runs} interleaved runs; times from the start of Fetcher.ensure.")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    return 0


def run(work: Path, variants: list[str], runs: int) -> dict[str, list[tuple[float, ...]]]:
    import weightcache.download as download
    import weightcache.fetch.engine as engine
    import weightcache.fetch.transfer as transfer
    import weightcache.sources.s3 as s3
    from weightcache.access import ADMIN, Authority
    from weightcache.checksums import InOrder
    from weightcache.settings import load_fetch_settings
    from weightcache.sources.base import ClientPool
    from weightcache.store import Store
    from weightcache.uri import parse_ref

    seen = {"byte": 0.0, "hashed": 0.0, "gets": 0}
    variant = {"name": "default"}
    # instrumentation of this process only: when bytes arrive, when hashing ends, how many GETs, and the variants
    arrived, feed, open_range = transfer._Round.arrived, download.PartialFile._feed, s3.S3Source._open_range
    range_size, open_parts = engine.Fetcher._range_size, engine.open_parts

    def on_arrived(self: Any, n: int) -> None:
        seen["byte"] = time.perf_counter()
        arrived(self, n)

    def on_feed(self: Any, data: memoryview) -> None:
        feed(self, data)
        seen["hashed"] = time.perf_counter()

    def on_get(self: Any, *a: Any) -> Any:
        seen["gets"] += 1
        return open_range(self, *a)

    def sized(self: Any, todo: Any, *, streaming: bool) -> int:
        name = variant["name"]
        return int(name.split("-")[1]) << 20 if name.startswith("range-") else range_size(self, todo,
                                                                                          streaming=streaming)

    def parts(*a: Any, **k: Any) -> int:
        resumed = open_parts(*a, **k)
        for item in a[2]:
            part = item.partial
            if variant["name"] == "drop-behind":  # as every fetch nobody streamed did before DROP_BEHIND_MIN
                part._drop_behind = part.journalled
            if variant["name"] == "no-md5":
                part.source_check = part._source_check = None
            elif variant["name"] == "in-order-md5" and part._source_check is not None:
                factory = part._source_check
                part._source_check = lambda factory=factory: InOrder(factory())
                part.source_check = part._source_check()
        return resumed

    transfer._Round.arrived, download.PartialFile._feed, s3.S3Source._open_range = on_arrived, on_feed, on_get
    engine.Fetcher._range_size, engine.open_parts = sized, parts

    ref = parse_ref("s3://bench/model/")
    grant = Authority().authorize(ref, ADMIN)
    fetcher = load_fetch_settings().with_peers(None, clients=ClientPool()).fetcher(Store(work / "warm"), ref)
    fetcher.ensure(grant)  # botocore's client built and kept, as in a daemon that fetched before
    rows: dict[str, list[tuple[float, ...]]] = {v: [] for v in variants}
    for n in range(runs):
        for name in random.Random(n).sample(variants, len(variants)):
            root = work / "store"
            shutil.rmtree(root, ignore_errors=True)
            fetcher.store = fetcher._planner.store = Store(root)
            variant["name"], seen["gets"] = name, 0
            time.sleep(0.5)
            usage, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            fetcher.ensure(grant)
            wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
            cpu = after.ru_utime - usage.ru_utime + after.ru_stime - usage.ru_stime
            rows[name].append((wall, cpu, seen["byte"] - start, seen["hashed"] - start, seen["gets"]))
            print(f"  run {n + 1}: {name}: {wall:.3f} s", flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
