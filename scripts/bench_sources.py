"""Benchmark: the sources' ranged-read paths against the tools a user would otherwise pick.

One nginx on 127.0.0.1 serves a file from tmpfs (so the origin is never the disk). Each contender pulls the
whole file with the same parallelism and chunk size and writes it to tmpfs, interleaved round-robin, each after
the same idle pause; the table shows the median of --runs, in GB/s, the ratio to aria2c, and the CPU seconds
the client spent (user+sys of this process, or of the aria2c child), which a busy machine disturbs less.

  http: weightcache HttpSource (urllib3, readinto)     vs fsspec HTTPFileSystem.cat_file   vs aria2c -x N -s N
  s3:   weightcache S3Source (urllib3 readinto)         vs the same with body.read() copies vs boto3 download_file
        (nginx stands in for the S3 endpoint: path-style GET /bucket/key with Range and If-Match is plain HTTP,
        so this measures the client, which moto, a Python server, would hide.)

    .venv/bin/python scripts/bench_sources.py [--size-mb 1024] [--runs 3] [--idle 2] [--threads 16] [--chunk-mb 16]

Needs nginx and aria2 (apt-get install nginx-light aria2).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import fsspec
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

import weightcache.sources.s3 as s3_module
from weightcache.sources import ObjectInfo, open_source
from weightcache.sources.base import Source
from weightcache.uri import parse_ref

NGINX_CONF = """
worker_processes 2; daemon off; pid {work}/nginx.pid; error_log {work}/error.log; user root;
events {{ worker_connections 1024; }}
http {{
  access_log off; sendfile on; tcp_nopush on; keepalive_requests 100000;
  client_body_temp_path {work}/cb; proxy_temp_path {work}/px; fastcgi_temp_path {work}/fc;
  uwsgi_temp_path {work}/uw; scgi_temp_path {work}/sc;
  server {{ listen 127.0.0.1:{port}; root {root}; autoindex on; }}
}}
"""


def start_nginx(root: Path, work: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:  # nginx takes no port 0: borrow a free one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = work / "nginx.conf"
    conf.write_text(NGINX_CONF.format(work=work, port=port, root=root))
    proc = subprocess.Popen(["nginx", "-c", str(conf)], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:  # ready when it accepts
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"nginx did not start; see {work}/error.log") from None
            time.sleep(0.02)


def parallel_ranges(size: int, chunk: int, threads: int, out: Path, read: Callable[[int, memoryview], None]) -> None:
    """The fetch engine's pattern: N threads, each reads a chunk into its own buffer and pwrites it."""
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    local = threading.local()

    def one(pos: int) -> None:
        buf = getattr(local, "buf", None) or bytearray(chunk)
        local.buf = buf
        view = memoryview(buf)[:min(chunk, size - pos)]
        read(pos, view)
        os.pwrite(fd, view, pos)

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(0, size, chunk)))
    finally:
        os.close(fd)


def cpu_seconds() -> float:
    """User+sys CPU of this process and its finished children (aria2c)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def source_reader(source: Source, obj: ObjectInfo) -> Callable[[int, memoryview], None]:
    return lambda pos, view: source.read_into(obj, pos, view)


def copying_read_body_into(resp, view: memoryview) -> int:
    data = resp.read(len(view))
    view[:len(data)] = data
    return len(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--idle", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--chunk-mb", type=int, default=16)
    args = ap.parse_args()
    for tool in ("nginx", "aria2c"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is missing: apt-get install nginx-light aria2")
    size, chunk, n = args.size_mb << 20, args.chunk_mb << 20, args.threads
    for name, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(name, value)  # nginx ignores the signature

    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        work = Path(tmp)
        root, outdir = work / "www", work / "out"
        (root / "bucket" / "m").mkdir(parents=True)
        outdir.mkdir()
        blob = os.urandom(64 << 20)
        with open(root / "bucket" / "m" / "w.bin", "wb") as f:
            for pos in range(0, size, len(blob)):
                f.write(blob[:min(len(blob), size - pos)])
        nginx, url = start_nginx(root, work)
        try:
            http_src = open_source(parse_ref(f"{url}/bucket/m/"), pool_size=n)
            (http_obj,) = http_src.list()
            fs = fsspec.filesystem("http")
            s3_src = open_source(parse_ref("s3://bucket/m/"), endpoint_url=url, pool_size=n)
            s3_obj = ObjectInfo("m/w.bin", "w.bin", size, http_obj.etag, None, None)  # nginx lists no buckets
            boto = boto3.client("s3", endpoint_url=url, config=Config(s3={"addressing_style": "path"},
                                                                      max_pool_connections=n))
            out = outdir / "w.bin"

            def copying_s3() -> None:
                original = s3_module.read_body_into
                s3_module.read_body_into = copying_read_body_into
                try:
                    parallel_ranges(size, chunk, n, out, source_reader(s3_src, s3_obj))
                finally:
                    s3_module.read_body_into = original

            def fsspec_read(pos: int, view: memoryview) -> None:
                view[:] = fs.cat_file(http_obj.key, start=pos, end=pos + len(view))

            contenders: dict[str, Callable[[], object]] = {
                "aria2c": lambda: subprocess.run(
                    ["aria2c", "-q", "-x", str(n), "-s", str(n), "-k", f"{args.chunk_mb}M", "--file-allocation=none",
                     "--allow-overwrite=true", "-d", str(outdir), "-o", "w.bin", http_obj.key], check=True),
                "http: weightcache (urllib3 readinto)": lambda: parallel_ranges(
                    size, chunk, n, out, source_reader(http_src, http_obj)),
                "http: fsspec cat_file": lambda: parallel_ranges(size, chunk, n, out, fsspec_read),
                "s3: weightcache (readinto)": lambda: parallel_ranges(size, chunk, n, out,
                                                                      source_reader(s3_src, s3_obj)),
                "s3: weightcache with body.read() copies": copying_s3,
                "s3: boto3 download_file": lambda: boto.download_file(
                    "bucket", "m/w.bin", str(out), Config=TransferConfig(
                        multipart_threshold=chunk, multipart_chunksize=chunk, max_concurrency=n)),
            }
            times: dict[str, list[float]] = {name: [] for name in contenders}
            cpu: dict[str, list[float]] = {name: [] for name in contenders}
            for _ in range(args.runs):
                for name, run in contenders.items():
                    out.unlink(missing_ok=True)
                    time.sleep(args.idle)
                    start, cpu0 = time.perf_counter(), cpu_seconds()
                    run()
                    times[name].append(time.perf_counter() - start)
                    cpu[name].append(cpu_seconds() - cpu0)
                    if (outdir / "w.bin").stat().st_size != size:
                        raise SystemExit(f"{name} wrote a file of the wrong size")
        finally:
            nginx.terminate()
            nginx.wait()

    base = size / statistics.median(times["aria2c"]) / 1e9
    print(f"\n{args.size_mb} MiB from nginx on 127.0.0.1 (tmpfs), {n} connections, {args.chunk_mb} MiB ranges, "
          f"median of {args.runs}, {os.cpu_count()} CPUs\n")
    print(f"{'client':42} {'GB/s':>6} {'vs aria2c':>10} {'CPU s':>6}   runs (s)")
    for name, samples in times.items():
        rate = size / statistics.median(samples) / 1e9
        print(f"{name:42} {rate:6.2f} {rate / base:9.2f}x {statistics.median(cpu[name]):6.2f}   "
              f"{' '.join(f'{s:.2f}' for s in samples)}")


if __name__ == "__main__":
    main()
