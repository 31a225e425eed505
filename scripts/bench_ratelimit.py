"""Benchmark: a bandwidth-limited fetch holds its limit (weightcache/ratelimit.py, the daemon's `bytesPerSecond`).

One origin: the embedded S3 server (moto, its own process) with a model of two shards uploaded with SHA-256
checksums. Each run fetches it into a fresh store root with 8 workers sharing the process's buckets, and the
limit is the only thing between the origin and the node (moto on loopback serves several times faster).

Rows (the limit is --limit-mib MiB/s in each):
  node origin      bytesPerSecond.origin
  source bucket    bytesPerSecond."s3://rate" (no node limit)
  source scheme    bytesPerSecond.s3
  node 2x, source  origin at twice the limit, the bucket at the limit: the tighter one holds
  peers            a second node fetches from the first with bytesPerSecond.peers at the limit and the origin
                   at 1/32 of it: peer bytes are paced by the peer bucket only, not by the origin's
  live halved      the origin limit halved mid-fetch (a reload: `configure` again); the expected rate is the
                   time-weighted mean of the two limits

Columns: `rate/limit`, the transfer's rate (model bytes over the engine's downloading phase, from its first
request to its last byte, as its progress reports them) / the limit: expected within 10 %, a little above 1.0
from the bucket's 0.1 s burst; `e2e/limit`, the same over the whole `ensure` (listing, HEADs, publish and syncfs
included: about a second on a loaded 2-core machine, which no limiter can give back); MiB/s of the transfer;
where the bytes came from; CPU seconds per GB of this process (fetch workers, and for `peers` the serving node
too; moto not counted; compare the unlimited line) and the 1-minute load average after the row. Medians of
--runs.

    .venv/bin/python scripts/bench_ratelimit.py [--size-mib 96] [--limit-mib 32] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_fleet import TOKEN, upload
from scripts.bench_prefetch import Moto
from tests.grants import admin
from tests.peers_fleet import Fleet
from weightcache.fetch import Fetcher
from weightcache.progress import Progress
from weightcache.ratelimit import BandwidthLimits
from weightcache.store import Store
from weightcache.uri import parse_ref

LIMITS = BandwidthLimits()  # the limits every fetch of this benchmark is handed, as a daemon hands its own

REF = parse_ref("s3://fleet/model/")  # bench_fleet.upload's bucket and prefix
OPTIONS = {"chunk_size": 4 << 20, "concurrency": 8}


@dataclass
class Run:
    wall: float
    transfer: float  # seconds of the downloading phase
    began: float  # seconds into ensure when it began
    cpu: float
    origin: int
    peer: int
    expected: float  # bytes/s the limits allow over this run


def cpu_now() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class Phases:
    """The engine's progress callback: when its downloading phase began and ended."""

    def __init__(self) -> None:
        self.began = self.ended = 0.0

    def __call__(self, p: Progress) -> None:
        now = time.perf_counter()
        if p.phase == "downloading" and not self.began:
            self.began = now
        elif p.phase != "downloading" and self.began and not self.ended:
            self.ended = now

    def seconds(self) -> float:
        return self.ended - self.began


def limited(endpoint: str, limits: Mapping[str, int], expected: float,
            during: Callable[[float], None] | None = None) -> Run:
    """One fetch into a fresh root under `limits` (origin, peers, source keys); `during(started)` runs beside it."""
    rest = dict(limits)
    with tempfile.TemporaryDirectory(prefix="bench-rate-") as tmp:
        fetcher = Fetcher(Store(Path(tmp)), endpoint_url=endpoint, limits=LIMITS, **OPTIONS)  # type: ignore[arg-type]
        LIMITS.configure(origin=rest.pop("origin", 0), peers=rest.pop("peers", 0), sources=rest)
        cpu, started = cpu_now(), time.perf_counter()
        side = threading.Thread(target=during, args=(started,)) if during else None
        if side:
            side.start()
        phases = Phases()
        fetcher.ensure(admin(REF), progress=phases)
        wall = time.perf_counter() - started
        if side:
            side.join()
        run = Run(wall, phases.seconds(), phases.began - started, cpu_now() - cpu, fetcher.stats["origin_bytes"],
                  fetcher.stats["peer_bytes"], expected)
    LIMITS.configure()
    return run


def from_peer(endpoint: str, rate: int) -> Run:
    """A node fetches from a peer holding the model: peers at `rate`, the origin at rate/32."""
    with tempfile.TemporaryDirectory(prefix="bench-rate-peer-") as tmp, Fleet(Path(tmp), TOKEN) as fleet:
        seed = fleet.node("seed")
        LIMITS.configure()
        seed.fetcher(endpoint_url=endpoint, **OPTIONS).ensure(admin(REF))
        node = fleet.node("node", peers=[seed.url])
        node.peers.limits = LIMITS  # the node's peer bucket
        fetcher = node.fetcher(endpoint_url=endpoint, limits=LIMITS, **OPTIONS)
        LIMITS.configure(origin=rate // 32, peers=rate)
        cpu, started, phases = cpu_now(), time.perf_counter(), Phases()
        fetcher.ensure(admin(REF), progress=phases)
        wall = time.perf_counter() - started
        run = Run(wall, phases.seconds(), phases.began - started, cpu_now() - cpu, fetcher.stats["origin_bytes"],
                  fetcher.stats["peer_bytes"], rate)
    LIMITS.configure()
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=96)
    parser.add_argument("--limit-mib", type=float, default=32.0)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    rate = int(args.limit_mib * (1 << 20))
    moto = Moto()
    try:
        upload(moto.url, args.size_mib << 20, sha256=True)
        model = (args.size_mib << 20) // 2 * 2 + len(b'{"bench": true}')
        url = moto.url
        half_at = model / rate / 2  # seconds into the live row when the limit is halved

        def halve(started: float) -> None:
            time.sleep(max(0.0, started + half_at - time.perf_counter()))
            LIMITS.configure(origin=rate // 2)

        live = (half_at, rate)  # the halving comes half_at into ensure: each run's expected rate from its phases
        rows: dict[str, Callable[[], Run]] = {
            "node origin": lambda: limited(url, {"origin": rate}, rate),
            "source bucket": lambda: limited(url, {"s3://fleet": rate}, rate),
            "source scheme": lambda: limited(url, {"s3": rate}, rate),
            "node 2x, source": lambda: limited(url, {"origin": 2 * rate, "s3://fleet": rate}, rate),
            "peers": lambda: from_peer(url, rate),
            "live halved": lambda: limited(url, {"origin": rate}, -1, halve),
        }
        unlimited = limited(url, {}, 0)
        unlimited_cpu = unlimited.cpu / (model / 1e9)
        print(f"model {model / 2**20:.0f} MiB from moto S3 on loopback, {OPTIONS['concurrency']} workers, "
              f"{OPTIONS['chunk_size'] >> 20} MiB chunks; limit {args.limit_mib:g} MiB/s; median of {args.runs} "
              f"run(s); {os.cpu_count()} CPUs")
        print(f"unlimited: transfer {model / unlimited.transfer / 2**20:.0f} MiB/s, ensure {unlimited.wall:.2f} s, "
              f"{unlimited_cpu:.2f} CPU s/GB")
        print(f"{'row':<16} {'rate/limit':>10} {'e2e/limit':>9} {'MiB/s':>7} {'xfer s':>7} {'origin MiB':>10} "
              f"{'peer MiB':>9} {'CPU s/GB':>9} {'load1':>6}")
        worst = 0.0
        for name, fn in rows.items():
            runs = [fn() for _ in range(args.runs)]
            for r in runs:
                if r.expected < 0:  # live: `rate` until the halving, rate/2 after, over the transfer
                    at = max(0.0, min(r.transfer, live[0] - r.began))
                    r.expected = (live[1] * at + live[1] / 2 * (r.transfer - at)) / r.transfer
            ratio = statistics.median(model / r.transfer / r.expected for r in runs)
            e2e = statistics.median(model / r.wall / r.expected for r in runs)
            transfer = statistics.median(r.transfer for r in runs)
            cpu = statistics.median(r.cpu / (model / 1e9) for r in runs)
            origin = statistics.median(r.origin for r in runs) / 2**20
            peer = statistics.median(r.peer for r in runs) / 2**20
            worst = max(worst, abs(ratio - 1))
            print(f"{name:<16} {ratio:>10.3f} {e2e:>9.3f} {model / transfer / 2**20:>7.1f} {transfer:>7.2f} "
                  f"{origin:>10.1f} {peer:>9.1f} {cpu:>9.2f} {os.getloadavg()[0]:>6.2f}")
        print(f"worst deviation from the limit: {worst * 100:.1f} % ({'within' if worst <= 0.10 else 'OVER'} 10 %)")
        return 0 if worst <= 0.10 else 1
    finally:
        moto.stop()


if __name__ == "__main__":
    sys.exit(main())
