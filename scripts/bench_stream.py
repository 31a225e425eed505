#!/usr/bin/env python3
"""Time to every tensor in CPU memory, from S3: weightcache streaming (TensorStream: each shard loaded as soon as
it is verified and durable, the cache filled as a side effect), weightcache prefetch then load, and Run:ai's
`SafetensorsStreamer` straight from S3 (which verifies and keeps nothing).

    .venv/bin/python scripts/bench_stream.py [--size-gb 1.5] [--shards 4] [--runs 3] [--only ROW,...] [--dir DIR]
        [--baseline DIR|REV]

--baseline adds a streaming row of another checkout or git revision (a `git worktree` made and removed here),
interleaved with this one's.

The origin is an S3 endpoint of this script's own on 127.0.0.1 (ListObjectsV2, HEAD, ranged GET by sendfile(2)
from files in the page cache), so it serves at memory speed where moto copies the whole object for every ranged
GET (docs/fetch.md). Its objects carry a full-object CRC32, as S3 gives new uploads a full-object checksum, so
weightcache checks it beside sha256 (Run:ai checks nothing). The model (safetensors shards with an index and a
config) is made here. Each trial is a fresh process, rows interleaved in a new order every run; the store is new
for every weightcache trial. A tensor counts once one byte of each of its 4 KiB pages was read (as bench_load's
"touch"). Prints medians: seconds, GB/s, CPU s/GB (the process's user + system time, all its threads), and
the ratio of Run:ai's time to the row's (above 1: faster than Run:ai), with the load average. The checks row
is what weightcache verifies and Run:ai does not: sha256 and the CRC32 (the project's own hasher) of the same
files, a MiB at a time from memory, in a process of its own; "like for like" prints each weightcache row's CPU
over Run:ai's plus that row's (issue 37's target: at most 1.1).
Needs `pip install runai-model-streamer runai-model-streamer-s3` (the bench extra).
"""

from __future__ import annotations

import argparse
import base64
import email.utils
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

PY = sys.executable
ROOT = Path(__file__).resolve().parent.parent
BUCKET = "bench"
PREFIX = "model/"
ROWS = {
    "weightcache stream (cache filled)": "stream",
    "weightcache prefetch, then load": "prefetch_load",
    "Run:ai SafetensorsStreamer from S3": "runai",
    "disk floor: dd write + fsync of the model's bytes": "dd",
    "checks Run:ai skips: sha256 + CRC32 of the same bytes": "checks",
}
LIKE_FOR_LIKE = 1.1  # issue 37's target: a stream's CPU per GB at most this times Run:ai's plus the checks row's
BASELINE_ROW = "weightcache stream, baseline"


# ---- the origin -------------------------------------------------------------------------------------------------
class Origin:
    """A read-only S3 endpoint over a directory: enough of the protocol for boto3/botocore and the AWS C++ SDK."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.objects: dict[str, tuple[Path, int, str, str]] = {}  # key -> path, size, etag, crc32 (base64)
        for path in sorted(p for p in directory.rglob("*") if p.is_file()):
            data = path.read_bytes()
            crc = base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
            etag = hashlib.md5(data, usedforsecurity=False).hexdigest()
            self.objects[PREFIX + path.relative_to(directory).as_posix()] = (path, len(data), etag, crc)
        origin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._object(body=False)

            def _target(self) -> str:
                """The path: the AWS CRT client (Run:ai's) sends the absolute form, `GET http://host/...`."""
                return "/" + self.path.split("://", 1)[1].partition("/")[2] if "://" in self.path else self.path

            def do_GET(self) -> None:
                path, _, query = self._target().partition("?")
                if path.strip("/") == BUCKET:
                    self._list(query)
                else:
                    self._object(body=True)

            def _list(self, query: str) -> None:
                params = dict(p.partition("=")[::2] for p in query.split("&") if p)
                prefix = params.get("prefix", "").replace("%2F", "/")
                items = "".join(
                    f"<Contents><Key>{escape(k)}</Key><Size>{size}</Size><ETag>&quot;{etag}&quot;</ETag>"
                    f"<LastModified>2026-01-01T00:00:00.000Z</LastModified><StorageClass>STANDARD</StorageClass>"
                    f"<ChecksumAlgorithm>CRC32</ChecksumAlgorithm></Contents>"
                    for k, (_, size, etag, _) in origin.objects.items() if k.startswith(prefix))
                body = (f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult '
                        f'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>{BUCKET}</Name>'
                        f"<Prefix>{escape(prefix)}</Prefix><KeyCount>{len(origin.objects)}</KeyCount>"
                        f"<MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>{items}</ListBucketResult>").encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _object(self, *, body: bool) -> None:
                key = self._target().partition("?")[0].lstrip("/").removeprefix(BUCKET + "/")
                found = origin.objects.get(key)
                if found is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                path, size, etag, crc = found
                start, end, status = 0, size, 200
                if (rng := self.headers.get("Range", "")).startswith("bytes="):
                    a, _, b = rng[6:].partition("-")
                    start, end, status = int(a), min(size, int(b) + 1 if b else size), 206
                if (match := self.headers.get("If-Match")) and match.strip('"') != etag:
                    self.send_response(412)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(status)
                self.send_header("Content-Length", str(end - start))
                self.send_header("ETag", f'"{etag}"')
                self.send_header("Last-Modified", email.utils.formatdate(0, usegmt=True))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Type", "application/octet-stream")
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
                if self.headers.get("x-amz-checksum-mode", "").upper() == "ENABLED" and status == 200:
                    self.send_header("x-amz-checksum-crc32", crc)
                    self.send_header("x-amz-checksum-type", "FULL_OBJECT")
                self.end_headers()
                if body and end > start:
                    with open(path, "rb") as fh:
                        self.connection.sendfile(fh, start, end - start)  # kernel to socket: no copy here

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                if not isinstance(sys.exc_info()[1], ConnectionError):  # Run:ai drops connections it is done with
                    super().handle_error(request, client_address)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


# ---- the model --------------------------------------------------------------------------------------------------
def make_model(directory: Path, size: int, shards: int) -> None:
    """A Llama-shaped layout of random BF16 bytes: `shards` files with an index and a config."""
    import numpy as np
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per_shard, tensor = size // shards, 32 << 20
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        arrays = {}
        for t in range(max(1, per_shard // tensor)):
            key = f"model.layers.{s}.w{t}.weight"
            arrays[key] = np.frombuffer(rng.bytes(tensor), dtype=np.uint16).reshape(4096, -1)
            weight_map[key] = name
        save_file(arrays, str(directory / name), metadata={"format": "pt"})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))


# ---- one trial, in a fresh process ------------------------------------------------------------------------------
TRIAL = r"""
import json, os, resource, sys, time
sys.path.insert(0, sys.argv[4])
import torch
method, url, store_dir = sys.argv[1], sys.argv[2], sys.argv[3]
def touch(t):
    if t.numel():
        int(t.reshape(-1).view(torch.uint8)[::4096].sum())
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
n = nbytes = 0
if method == "checks":  # what weightcache verifies and Run:ai does not, alone: the origin's own files, in memory
    import hashlib
    from pathlib import Path
    from weightcache.checksums import new_hasher
    used = 0.0
    for p in sorted((Path(store_dir).parent / "model").iterdir()):
        data = memoryview(p.read_bytes())  # read outside the clock: the fetch hashes bytes it already holds
        c0 = cpu()
        sha, crc = hashlib.sha256(), new_hasher("crc32")
        for at in range(0, len(data), 1 << 20):  # a piece at a time, as the fetch feeds them (download._feed)
            sha.update(data[at:at + (1 << 20)]); crc.update(data[at:at + (1 << 20)])
        used += cpu() - c0
        n += 1; nbytes += len(data)
    print(json.dumps({"seconds": used, "cpu": used, "tensors": 0, "files": n, "bytes": nbytes}))
    sys.exit(0)
if method == "runai":
    from runai_model_streamer import SafetensorsStreamer
    import boto3
    keys = sorted(o["Key"] for o in boto3.client("s3", endpoint_url=url).list_objects_v2(
        Bucket="bench", Prefix="model/")["Contents"] if o["Key"].endswith(".safetensors"))
    t0, c0 = time.perf_counter(), cpu()
    with SafetensorsStreamer() as streamer:
        streamer.stream_files([f"s3://bench/{k}" for k in keys], device="cpu")
        for name, t in streamer.get_tensors():
            touch(t); n += 1; nbytes += t.numel() * t.element_size()
else:
    from weightcache.access import ADMIN, Authority
    from weightcache.fetch import Fetcher
    from weightcache.loader import iter_tensors
    from weightcache.store import Store
    from weightcache.stream_load import TensorStream
    from weightcache.uri import parse_ref
    import weightcache.sources.s3  # imported before the clock starts, as Run:ai's row imports its own and boto3
    grant = Authority().authorize(parse_ref("s3://bench/model/"), ADMIN)
    fetcher = Fetcher(Store(store_dir), endpoint_url=url)
    t0, c0 = time.perf_counter(), cpu()
    tensors = TensorStream(fetcher, grant) if method == "stream" else iter_tensors(fetcher.ensure(grant).path)
    for name, t in tensors:
        touch(t); n += 1; nbytes += t.numel() * t.element_size()
    if method == "stream":  # every tensor is in hand; the snapshot's publish (its syncfs) may still be running
        seconds, used = time.perf_counter() - t0, cpu() - c0
        tensors.wait()
        published = time.perf_counter() - t0
        print(json.dumps({"seconds": seconds, "cpu": used, "tensors": n, "bytes": nbytes, "published": published,
                          "cpu_published": cpu() - c0}))
        sys.exit(0)
print(json.dumps({"seconds": time.perf_counter() - t0, "cpu": cpu() - c0, "tensors": n, "bytes": nbytes}))
"""


def trial(method: str, url: str, work: Path, code: Path = ROOT) -> dict[str, float]:
    store = work / "store"
    shutil.rmtree(store, ignore_errors=True)
    if method == "dd":  # what filling the cache costs the disk alone: a streamed row cannot end before it
        size = sum(p.stat().st_size for p in (work / "model").iterdir())
        store.mkdir()
        before, t0 = os.times(), time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={store / 'zero'}", "bs=8M", f"count={-(-size // (8 << 20))}",
                        "conv=fsync"], check=True, capture_output=True)
        seconds, after = time.perf_counter() - t0, os.times()
        cpu = after.children_user + after.children_system - before.children_user - before.children_system
        return {"seconds": seconds, "cpu": cpu, "tensors": 0, "bytes": size}
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": url, "AWS_EC2_METADATA_DISABLED": "true",
           "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0", "AWS_CONFIG_FILE": os.devnull,
           "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    out = subprocess.run([PY, "-c", TRIAL, method, url, str(store), str(code)], env=env, capture_output=True,
                         text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"{method} failed:\n{out.stderr[-3000:]}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.5)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated substrings of row names")
    ap.add_argument("--dir", default=None, help="where the model, the origin's files and the store go")
    ap.add_argument("--baseline", default=None, help="another checkout or a git revision: its streaming row too")
    args = ap.parse_args()
    rows = {r: m for r, m in ROWS.items() if not args.only or any(s in r for s in args.only.split(","))}
    code = dict.fromkeys(rows, ROOT)
    if args.baseline:
        if not (Path(args.baseline) / "weightcache" / "__init__.py").is_file():
            from bench_prefetch import worktree  # scripts/ is this script's path

            args.baseline = worktree(args.baseline, ap)
        rows[BASELINE_ROW], code[BASELINE_ROW] = "stream", Path(args.baseline)
    work = Path(tempfile.mkdtemp(prefix="wc-bench-stream-", dir=args.dir))
    try:
        make_model(work / "model", int(args.size_gb * 1e9), args.shards)
        origin = Origin(work / "model")
        size = sum(s for _, s, _, _ in origin.objects.values())
        print(f"model: {size / 1e9:.2f} GB in {args.shards} shards; origin {origin.url}; "
              f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
        results: dict[str, list[dict[str, float]]] = {r: [] for r in rows}
        for run in range(args.runs):
            order = list(rows)
            random.shuffle(order)
            for row in order:
                got = trial(rows[row], origin.url, work, code[row])
                results[row].append(got)
                extra = f" (published at {got['published']:.2f} s)" if "published" in got else ""
                print(f"  run {run + 1} {row}: {got['seconds']:.2f} s, {got['cpu']:.2f} CPU s, {got['tensors']:.0f} "
                      f"tensors{extra}", flush=True)
        print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        med = {r: (statistics.median(x["seconds"] for x in v), statistics.median(x["cpu"] for x in v))
               for r, v in results.items()}
        gb = next(v for r, v in results.items() if rows[r] not in ("dd", "checks"))[0]["bytes"] / 1e9
        ref = next((med[r][0] for r in med if r.startswith("Run:ai")), None)
        print("\n| client | s to all tensors | GB/s | CPU s/GB | x Run:ai | runs (s) |\n|---|---|---|---|---|---|")
        for r, (secs, cpu) in med.items():
            ratio = f"{ref / secs:.2f}" if ref and rows[r] not in ("dd", "checks") else "-"
            runs = " ".join(f"{x['seconds']:.2f}" for x in results[r])
            print(f"| {r} | {secs:.2f} | {gb / secs:.2f} | {cpu / gb:.2f} | {ratio} | {runs} |")
        floor = next((med[r][0] for r in med if rows[r] == "dd"), None)
        if floor:
            print("x disk floor (the dd row's time over the row's; a row that fills the cache durably stays under "
                  "1.0): " + ", ".join(f"{r} {floor / med[r][0]:.2f}" for r in med if rows[r] not in ("dd", "checks")))
        runai = next((med[r][1] for r in med if rows[r] == "runai"), None)
        checks = next((med[r][1] for r in med if rows[r] == "checks"), None)
        if runai is not None and checks is not None:
            floor_cpu = runai + checks
            print(f"like for like: Run:ai {runai / gb:.2f} + its skipped checks {checks / gb:.2f} = "
                  f"{floor_cpu / gb:.2f} CPU s/GB; CPU x that (target <= {LIKE_FOR_LIKE}): " + ", ".join(
                      f"{r} {med[r][1] / floor_cpu:.2f}"
                      f"{' met' if med[r][1] <= LIKE_FOR_LIKE * floor_cpu else ' NOT met'}"
                      for r in med if rows[r] in ("stream", "prefetch_load")))
        for r, v in results.items():
            if "published" in v[0]:
                print(f"{r}: snapshot published at {statistics.median(x['published'] for x in v):.2f} s, "
                      f"{statistics.median(x['cpu_published'] for x in v) / gb:.2f} CPU s/GB by then (medians)")
        print(f"\nmedians of {args.runs}; {gb:.2f} GB of tensors")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
