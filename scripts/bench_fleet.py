"""Benchmark: fleet fill (nodes fetch from each other) beside N independent fetches, for N = 2, 4, 8 nodes.

One origin: the embedded S3 server (moto, its own process) behind tests/faultproxy.py, which counts every ranged
GET (origin bytes are read there, where they leave the origin) and throttles each origin connection to
--origin-mbps (a remote bucket, not loopback; per connection, so N independent fetches are not slowed by sharing
an origin limit as a real bucket prefix would: the wall-time ratio understates fleet fill). Each node is a Fetcher
with its own store root and a real peer server on 127.0.0.1 (tests/peers_fleet.py), all in this process.

Rows, per N:
  independent   N nodes fetch at once from the origin, no peers (what every node does without fleet fill)
  fleet         one node fetches, then the other N-1 at once with every node as a peer
  at once       all N nodes fetch at once with every node as a peer (a fleet scaling out together)

Columns: origin bytes as a multiple of the model, wall seconds until every node has the snapshot (median of
--runs), ratio = independent wall / this row's wall, and "vs one" = this row's wall / one node's wall alone
(the target for "at once": <= 1.3), and CPU s/GB: this process's CPU seconds (every node's fetcher and peer
server, and the origin proxy) per GB the nodes filled; in the "fleet" row only the other N-1 nodes' fill from
their peers is counted, not the first node's from the origin. Each run uses fresh roots.

    .venv/bin/python scripts/bench_fleet.py [--size-mb 64] [--nodes 2,4,8] [--runs 1] [--origin-mbps 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import boto3
from botocore.config import Config

from scripts.bench_prefetch import Moto
from tests.faultproxy import FaultProxy
from tests.grants import admin
from tests.peers_fleet import Fleet, FleetNode, origin_bytes
from weightcache.uri import parse_ref

TOKEN = b"bench-fleet-token-0123456789abcdef"
REF = parse_ref("s3://fleet/model/")
OPTIONS = {"chunk_size": 4 << 20, "concurrency": 8}


def upload(url: str, size: int, sha256: bool = True) -> None:
    """Two shards and a config; `sha256=False`: plain put_object as most buckets are filled (the store adds its
    CRC32, the ETag is the MD5), so peers are asked by the origin's identity, not by digest."""
    extra = {"ChecksumAlgorithm": "SHA256"} if sha256 else {}
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    s3 = boto3.client("s3", endpoint_url=url, config=Config(s3={"addressing_style": "path"}))
    s3.create_bucket(Bucket="fleet")
    shard = size // 2
    for i in range(2):
        s3.put_object(Bucket="fleet", Key=f"model/model-{i:05d}.safetensors.bin", Body=os.urandom(shard), **extra)
    s3.put_object(Bucket="fleet", Key="model/config.json", Body=b'{"bench": true}', **extra)


def fetch_all(nodes: list[FleetNode], proxy: FaultProxy) -> None:
    def one(node: FleetNode) -> None:
        node.fetcher(endpoint_url=proxy.endpoint_url, **OPTIONS).ensure(admin(REF))

    with ThreadPoolExecutor(len(nodes)) as pool:
        for f in [pool.submit(one, n) for n in nodes]:
            f.result()


def run(mode: str, n: int, proxy: FaultProxy) -> tuple[int, float, float]:
    """(origin bytes, wall seconds, CPU seconds per GB filled) of one run of `mode` with `n` nodes, fresh roots."""
    proxy.requests.clear()
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp, Fleet(Path(tmp), TOKEN) as fleet:
        if mode == "independent":
            nodes = [fleet.node(f"n{i}") for i in range(n)]
            started, cpu = time.perf_counter(), time.process_time()
            fetch_all(nodes, proxy)
        elif mode == "at once":
            nodes = [fleet.node(f"n{i}") for i in range(n)]
            for node in nodes:
                fleet.connect(node, [o.url for o in nodes if o is not node])
            started, cpu = time.perf_counter(), time.process_time()
            fetch_all(nodes, proxy)
        else:
            seed = fleet.node("n0")
            others = [fleet.node(f"n{i}") for i in range(1, n)]
            for node in others:  # every node lists every other one
                fleet.connect(node, [o.url for o in [seed, *others] if o is not node])
            started = time.perf_counter()
            fetch_all([seed], proxy)
            cpu = time.process_time()  # the peer fill only
            fetch_all(others, proxy)
            nodes = others
        cpu_s = time.process_time() - cpu
        filled = sum(sum(f.stats["origin_bytes"] + f.stats["peer_bytes"] for f in node.fetchers) for node in nodes)
        return origin_bytes(proxy, "/fleet/model/"), time.perf_counter() - started, cpu_s / max(filled, 1) * 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=64)
    parser.add_argument("--nodes", default="2,4,8")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--origin-mbps", type=float, default=10.0, help="per origin connection, MB/s")
    parser.add_argument("--no-sha256", action="store_true",
                        help="a bucket filled with plain put_object (no SHA-256 checksum): peers by origin identity")
    args = parser.parse_args()
    size = args.size_mb << 20
    moto = Moto()
    try:
        upload(moto.url, size, sha256=not args.no_sha256)
        model = size + len(b'{"bench": true}')
        with FaultProxy(moto.url) as proxy:
            proxy.add("throttle", method="GET", path="/fleet/model/", ranged_only=True,
                      rate=int(args.origin_mbps * 1e6), count=-1)
            print(f"{'no SHA-256 checksums (plain put_object)' if args.no_sha256 else 'SHA-256 checksums'}: "
                  f"model {model / 2**20:.0f} MiB, origin throttled to {args.origin_mbps:.0f} MB/s per connection, "
                  f"{OPTIONS['concurrency']} connections per fetch, median of {args.runs} run(s)")
            one = statistics.median(run("independent", 1, proxy)[1] for _ in range(args.runs))
            print(f"one node alone: {one:.2f} s")
            print(f"{'N':>3} {'mode':<12} {'origin bytes':>13} {'wall s':>8} {'ratio':>6} {'vs one':>7} "
                  f"{'CPU s/GB':>8}")
            for n in [int(x) for x in args.nodes.split(",")]:
                rows = {}
                for mode in ("independent", "fleet", "at once"):
                    results = [run(mode, n, proxy) for _ in range(args.runs)]
                    rows[mode] = (statistics.median(r[0] for r in results), statistics.median(r[1] for r in results),
                                  statistics.median(r[2] for r in results))
                for mode, (sent, wall, cpu_gb) in rows.items():
                    ratio = rows["independent"][1] / wall if wall else 0.0
                    print(f"{n:>3} {mode:<12} {sent / model:>12.2f}x {wall:>8.2f} {ratio:>6.2f} {wall / one:>7.2f} "
                          f"{cpu_gb:>8.2f}")
    finally:
        moto.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
