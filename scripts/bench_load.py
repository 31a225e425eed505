#!/usr/bin/env python3
"""Load the same multi-shard model every way a pod could and print GB/s, time to first tensor and memory.

    sudo .venv/bin/python scripts/bench_load.py --size-gb 2 --runs 3 [--baseline DIR|REV] [--busy N]

--busy N keeps N processes spinning during the trials (a node whose CPUs are taken). --baseline adds
weightcache.loader rows of another checkout or git revision (a `git worktree` made and removed
here), interleaved with this one's.

Every trial runs in a fresh process (so peak RSS is its own), after the same idle time; methods are interleaved
run by run and the table shows medians. "cold" trials start `--settle` seconds after
`echo 3 > /proc/sys/vm/drop_caches` (root);
"memory tier" trials start from the same drop while a separate process (the daemon's role) holds the model in a
MemoryTier (promoted once, on a separate copy of the files, so its locked pages do not warm the cold trials).
Every method touches every tensor (one byte per 4 KiB page, or a sync on cuda), so lazy mappings
pay for their reads. Rows: the fio sequential-read ceiling of the same bytes (buffered, and O_DIRECT), raw mmap +
touch, safetensors.torch.load_file, Run:ai Model Streamer (`runai_model_streamer.SafetensorsStreamer`) and
fastsafetensors (CPU mode, `nogds=True`) when installed, weightcache.loader; on a GPU also a plain pinned H2D copy
(the PCIe ceiling) and loads to cuda. Each row also gives CPU seconds per GB (getrusage of the trial's process,
every thread, user + system); the load average is printed at the start and the end. Before the timed runs every
loader's tensors are compared with safetensors.load_file's (sha256 of each tensor's bytes, dtype and shape).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# ---- the model --------------------------------------------------------------------------------------------


def make_model(directory: Path, size_gb: float, shards: int) -> list[Path]:
    """Float16 shards of random data with an index (reused when present with the same size)."""
    import numpy as np
    from safetensors.numpy import save_file

    stamp = directory / "bench.json"
    want = {"size_gb": size_gb, "shards": shards}
    files = [directory / f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    if stamp.exists() and json.loads(stamp.read_text()) == want and all(f.exists() for f in files):
        return files
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per_shard = int(size_gb * 1e9) // shards
    rows, width = 16, 4096
    per_tensor = rows * width * 2 * 64  # 8 MiB tensors
    weight_map = {}
    for i, f in enumerate(files):
        arrays = {}
        for j in range(max(1, per_shard // per_tensor)):
            name = f"model.layers.{i}.block.{j}.weight"
            arrays[name] = rng.integers(0, 1 << 16, size=(rows * 64, width), dtype=np.uint16).view(np.float16)
            weight_map[name] = f.name
        save_file(arrays, str(f), metadata={"format": "pt"})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    stamp.write_text(json.dumps(want))
    return files


# ---- one trial, in a child process ----------------------------------------------------------------------------


def touch(t) -> None:
    """Read one byte per 4 KiB page; a cuda tensor is complete once the stream is synchronized."""
    import torch
    if not t.is_cuda and t.numel():
        int(t.reshape(-1).view(torch.uint8)[::4096].sum())


def trial(method: str, directory: Path, drop: bool, settle: float) -> dict[str, float]:
    """Time one load. A warm-up load of a one-tensor file the same way comes first, so library code that the
    page-cache drop evicted is not counted against the method. Its tensor has the model's dtype and shape: with a
    small float32 one, the touch's float16 kernels were still on the disk, and the 17 major faults that read them
    back (both loaders alike, the same pages) decided the memory-tier rows on a busy disk."""
    import torch
    from safetensors.torch import save_file
    if method != "h2d_ceiling":
        with tempfile.TemporaryDirectory() as tmp:
            save_file({"w": torch.zeros((1024, 4096), dtype=torch.float16)}, f"{tmp}/model.safetensors")
            _load(method, Path(tmp), [Path(tmp, "model.safetensors")], lambda: None)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu0, minflt0, majflt0 = usage.ru_utime + usage.ru_stime, usage.ru_minflt, usage.ru_majflt
    files = sorted(directory.glob("*.safetensors"))
    first: list[float] = []
    if drop:
        drop_caches()
        time.sleep(settle)  # the same settle time after every drop (this VM hands freed memory back to its host)
    start = time.perf_counter()

    def got() -> None:
        if not first:
            first.append(time.perf_counter() - start)

    if method == "h2d_ceiling":
        total = sum(f.stat().st_size for f in files)
        src = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(total, dtype=torch.uint8, device="cuda")
        dst.copy_(src, non_blocking=True)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
    else:
        _load(method, directory, files, got)
    if method.endswith("_cuda") or method == "h2d_ceiling":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime - cpu0
    faults = {"minflt": usage.ru_minflt - minflt0, "majflt": usage.ru_majflt - majflt0}
    got()
    anon = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("RssAnon:"))
    return {"seconds": seconds, "ttft": first[0], "cpu_s": cpu, **faults,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "anon_mb": anon / 1024}


def digests(method: str, directory: Path) -> dict[str, str]:
    """sha256 of each tensor's bytes (with its dtype and shape) as `method` hands it out: the equality check."""
    import hashlib

    import torch
    out: dict[str, str] = {}

    def each(name: str, t: torch.Tensor) -> None:  # at once: a streamer may reuse its buffer for the next tensor
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out[name] = hashlib.sha256(f"{t.dtype} {tuple(t.shape)} ".encode() + data).hexdigest()

    _load(method, directory, sorted(directory.glob("*.safetensors")), lambda: None, each)
    return out


def _load(method: str, directory: Path, files: list[Path], got: Callable[[], None],
          each: Callable[[str, object], None] | None = None) -> None:
    """Load every tensor of `files` the way `method` does; `each(name, tensor)` sees each (default: touch it)."""
    cuda = method.endswith("_cuda")
    if each is None:
        each = lambda _name, t: touch(t)  # noqa: E731
    if method.startswith("mmap"):
        import numpy as np
        for f in files:
            with open(f, "rb") as fh:
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            int(np.frombuffer(mm, np.uint8)[::4096].sum())
            got()
    elif method.startswith("safetensors"):
        from safetensors.torch import load_file
        for f in files:
            for name, t in load_file(f, device="cuda" if cuda else "cpu").items():
                each(name, t)
                got()
    elif method.startswith("runai"):
        from runai_model_streamer import SafetensorsStreamer
        with SafetensorsStreamer() as streamer:
            streamer.stream_files([str(f) for f in files], device="cuda" if cuda else "cpu")
            for name, t in streamer.get_tensors():
                each(name, t)
                got()
    elif method.startswith("fastsafetensors"):
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup
        loader = SafeTensorsFileLoader(SingleGroup(), "cuda:0" if cuda else "cpu", nogds=True)
        try:
            loader.add_filenames({0: [str(f) for f in files]})
            buffers = loader.copy_files_to_device()
            try:
                for name in buffers.key_to_rank_lidx:
                    each(name, buffers.get_tensor(name))
                    got()
            finally:
                buffers.close()
        finally:
            loader.close()
    elif method.startswith(("weightcache", "baseline")):
        from weightcache.loader import iter_tensors
        for name, t in iter_tensors(directory, device="cuda" if cuda else "cpu"):
            each(name, t)
            got()
    else:
        raise SystemExit(f"unknown method {method}")


# ---- the parent: conditions, interleaving, table ---------------------------------------------------------------


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")  # the page cache only: dentries and inodes stay


def warm(directory: Path) -> None:
    for f in directory.glob("*.safetensors"):
        with open(f, "rb") as fh:
            while fh.read(16 << 20):
                pass


def fio(directory: Path, direct: bool) -> dict[str, float] | None:
    """fio's sequential read of the same files, one after another (the disk ceiling)."""
    seconds = 0.0
    for f in sorted(directory.glob("*.safetensors")):
        args = ["fio", "--name=seq", f"--filename={f}", "--rw=read", "--bs=1M", "--readonly", "--output-format=json"]
        args += ["--direct=1", "--ioengine=libaio", "--iodepth=16"] if direct else ["--direct=0", "--ioengine=psync"]
        try:
            out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return None
        seconds += json.loads(out)["jobs"][0]["read"]["runtime"] / 1000
    nan = float("nan")
    return {"seconds": seconds, "ttft": nan, "cpu_s": nan, "peak_rss_mb": nan, "anon_mb": nan, "minflt": nan,
            "majflt": nan}


class Holder:
    """The daemon's part for memory-tier trials: a process that keeps the model locked in a MemoryTier."""

    CODE = ("import sys; from pathlib import Path; from weightcache.memory import MemoryTier; "
            "from weightcache.store.types import Snapshot; p = Path(sys.argv[1]); "
            "t = MemoryTier(sum(f.stat().st_size for f in p.iterdir()) + (64 << 20)); "
            "t.promote(Snapshot('bench', p, 'file://bench/', None, 0)); print('held', flush=True); sys.stdin.read()")

    def __init__(self, directory: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", self.CODE, str(directory)], cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "held":
            raise SystemExit("the memory tier could not hold the model (run as root, or with CAP_IPC_LOCK)")

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


# method -> (label, condition)
CPU_METHODS = {
    "fio_buffered": ("fio seq read, buffered (psync 1M)", "cold"),
    "fio_direct": ("fio seq read, O_DIRECT (libaio qd16)", "cold"),
    "safetensors_cold": ("safetensors.torch.load_file + touch", "cold"),
    "runai_cold": ("Run:ai Model Streamer + touch", "cold"),
    "fastsafetensors_cold": ("fastsafetensors (cpu, nogds) + touch", "cold"),
    "weightcache_cold": ("weightcache.loader, disk tier", "cold"),
    "mmap_warm": ("raw mmap + touch", "warm"),
    "safetensors_warm": ("safetensors.torch.load_file + touch", "warm"),
    "runai_warm": ("Run:ai Model Streamer + touch", "warm"),
    "fastsafetensors_warm": ("fastsafetensors (cpu, nogds) + touch", "warm"),
    "weightcache_warm": ("weightcache.loader, disk tier", "warm"),
    "baseline_cold": ("weightcache.loader, baseline", "cold"),
    "baseline_warm": ("weightcache.loader, baseline", "warm"),
    "safetensors_memory": ("safetensors.torch.load_file + touch", "memory tier"),
    "weightcache_memory": ("weightcache.loader, memory tier", "memory tier"),
}
CUDA_METHODS = {
    "h2d_ceiling": ("pinned H2D copy (PCIe ceiling)", "warm"),
    "safetensors_memory_cuda": ("safetensors load_file(device=cuda)", "memory tier"),
    "runai_memory_cuda": ("Run:ai Model Streamer -> cuda", "memory tier"),
    "weightcache_memory_cuda": ("weightcache.loader -> cuda", "memory tier"),
    "weightcache_cold_cuda": ("weightcache.loader -> cuda, disk tier", "cold"),
}


def run_one(method: str, condition: str, directory: Path, idle: float, settle: float,
            baseline: str | None = None) -> dict[str, float] | None:
    if condition == "warm":
        warm(directory)
    time.sleep(idle)  # the same idle time before every trial (this VM hands freed memory back to its host)
    if method.startswith("fio"):
        drop_caches()
        time.sleep(settle)
        return fio(directory, direct=method == "fio_direct")
    cmd = [sys.executable, __file__, "--trial", method, "--dir", str(directory), "--settle", str(settle)]
    if method.startswith("baseline") and baseline:
        cmd += ["--code", baseline]
    proc = subprocess.run(cmd + (["--drop"] if condition != "warm" else []), cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"  {method}: failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def memory_copy(directory: Path) -> Path:
    """A separate copy of the model for memory-tier trials: its locked pages must not warm the cold trials."""
    copy = directory.with_name(directory.name + "-memory")
    copy.mkdir(exist_ok=True)
    for f in directory.iterdir():
        if not (copy / f.name).exists() or (copy / f.name).stat().st_size != f.stat().st_size:
            shutil.copyfile(f, copy / f.name)
    return copy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--idle", type=float, default=2.0, help="seconds of idle before each trial")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds between a page-cache drop and the clock")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "weightcache-bench-model")
    ap.add_argument("--only", default="", help="comma-separated methods (default: all that apply)")
    ap.add_argument("--trial", help=argparse.SUPPRESS)
    ap.add_argument("--drop", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--digest", help=argparse.SUPPRESS)
    ap.add_argument("--baseline", default=None, help="another checkout or a git revision: its loader's rows too")
    ap.add_argument("--busy", type=int, default=0, help="processes that spin on a CPU each during the trials (a "
                                                        "busy node: the loaders' threads compete with them)")
    ap.add_argument("--code", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.code:  # a baseline trial: that checkout's weightcache before this one's
        sys.path.insert(0, args.code)
    if args.digest:
        print(json.dumps(digests(args.digest, args.dir)))
        return
    if args.trial:
        print(json.dumps(trial(args.trial, args.dir, args.drop, args.settle)))
        return
    if os.geteuid() != 0:
        raise SystemExit("run as root: cold trials drop the page cache and the memory tier locks pages")
    import torch
    methods = dict(CPU_METHODS)
    if torch.cuda.is_available():
        methods.update(CUDA_METHODS)
    if args.only:
        methods = {m: methods[m] for m in args.only.split(",")}
    if args.baseline:
        if not (Path(args.baseline) / "weightcache" / "__init__.py").is_file():
            from bench_prefetch import worktree  # scripts/ is this script's path

            args.baseline = worktree(args.baseline, ap)
    else:
        methods = {m: v for m, v in methods.items() if not m.startswith("baseline")}
    try:
        import runai_model_streamer  # noqa: F401
    except ImportError:
        print("runai-model-streamer not installed: skipping its rows (pip install runai-model-streamer)")
        methods = {m: v for m, v in methods.items() if not m.startswith("runai")}
    try:
        import fastsafetensors  # noqa: F401
    except ImportError:
        print("fastsafetensors not installed: skipping its rows (pip install fastsafetensors)")
        methods = {m: v for m, v in methods.items() if not m.startswith("fastsafetensors")}
    if any(m.startswith("fio") for m in methods):
        from bench_prefetch import install_tools

        install_tools({"fio": "fio"})
        if shutil.which("fio") is None:
            print("fio not installed: skipping the ceiling rows (apt-get install fio)")
            methods = {m: v for m, v in methods.items() if not m.startswith("fio")}
    files = make_model(args.dir, args.size_gb, args.shards)
    total = sum(f.stat().st_size for f in files)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"model: {len(files)} shards, {total / 1e9:.2f} GB in {args.dir}; {args.runs} runs, interleaved, "
          f"{args.idle:g} s idle before each trial, {args.settle:g} s settle after each drop; device: {device}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    check_equal(args.dir, sorted({m.split("_")[0] for m in methods} & {"safetensors", "runai", "fastsafetensors",
                                                                        "weightcache"}))
    results: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    holder = None
    if any(condition == "memory tier" for _, condition in methods.values()):
        # Like the daemon: promote once, long before pods load (promote touches every page it locks, so the
        # first load does not pay the hypervisor's first-touch faults: docs/loader.md).
        memory_dir = memory_copy(args.dir)
        holder = Holder(memory_dir)
        time.sleep(10)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    if spinners:
        print(f"{len(spinners)} spinning processes beside the trials")
    try:
        for run in range(args.runs):
            for method, (_, condition) in methods.items():
                directory = memory_dir if condition == "memory tier" else args.dir
                r = run_one(method, condition, directory, args.idle, args.settle, args.baseline)
                if r is not None:
                    results[method].append(r)
                    print(f"  run {run + 1} {method}: {total / r['seconds'] / 1e9:.2f} GB/s", file=sys.stderr)
    finally:
        for p in spinners:
            p.kill()
        if holder is not None:
            holder.close()
    print_table(methods, results, total)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")


def check_equal(directory: Path, loaders: list[str]) -> None:
    """Every loader hands out the same tensors as safetensors.load_file: same names, dtypes, shapes and bytes."""
    got: dict[str, dict[str, str]] = {}
    for loader in ["safetensors", *(x for x in loaders if x != "safetensors")]:
        proc = subprocess.run([sys.executable, __file__, "--digest", loader, "--dir", str(directory)], cwd=ROOT,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"equality check: {loader} failed: {proc.stderr.strip().splitlines()[-1:]}")
        got[loader] = json.loads(proc.stdout.strip().splitlines()[-1])
    ref = got["safetensors"]
    for loader, tensors in got.items():
        if tensors != ref:
            wrong = sorted(k for k in ref.keys() | tensors.keys() if ref.get(k) != tensors.get(k))
            raise SystemExit(f"equality check: {loader} differs from safetensors.load_file in {len(wrong)} "
                             f"tensors, e.g. {wrong[:3]}")
    print(f"tensor equality: {len(ref)} tensors, identical bytes, dtypes and shapes from {', '.join(got)}")


def print_table(methods: dict[str, tuple[str, str]], results: dict[str, list[dict[str, float]]], total: int) -> None:
    def med(m: str, key: str) -> float:
        return statistics.median(r[key] for r in results[m]) if results.get(m) else float("nan")

    gbps = {m: total / med(m, "seconds") / 1e9 for m in methods}
    print(f"\n{'method':40s} {'condition':12s} {'GB/s':>7s} {'CPU s/GB':>8s} {'first tensor s':>14s} "
          f"{'peak RSS MB':>12s} {'anon MB':>8s} {'faults min/maj':>14s}  runs (GB/s)")
    for m, (label, condition) in methods.items():
        runs = " ".join(f"{total / r['seconds'] / 1e9:.2f}" for r in results[m])
        faults = f"{med(m, 'minflt'):.0f}/{med(m, 'majflt'):.0f}"
        print(f"{label:40s} {condition:12s} {gbps[m]:7.2f} {med(m, 'cpu_s') / (total / 1e9):8.2f} "
              f"{med(m, 'ttft'):14.3f} {med(m, 'peak_rss_mb'):12.0f} {med(m, 'anon_mb'):8.0f} {faults:>14s}  {runs}")
    ceiling = max(gbps.get("fio_buffered", 0), gbps.get("fio_direct", 0))
    ratios: list[tuple[str, str, str, float]] = [
        ("memory tier vs safetensors cold", "weightcache_memory", "safetensors_cold", 20),
        ("memory tier vs safetensors, same locked pages", "weightcache_memory", "safetensors_memory", 1),
        ("disk cold vs fio ceiling (max of both)", "weightcache_cold", "", 0.9),
        ("disk cold vs Run:ai cold", "weightcache_cold", "runai_cold", 2),
        ("disk cold vs safetensors cold", "weightcache_cold", "safetensors_cold", 2),
        ("disk warm vs raw mmap + touch", "weightcache_warm", "mmap_warm", 1 / 1.2),
        ("disk warm vs safetensors warm", "weightcache_warm", "safetensors_warm", 1),
        ("disk warm vs Run:ai warm", "weightcache_warm", "runai_warm", 1),
        ("disk warm vs baseline warm", "weightcache_warm", "baseline_warm", 1),
        ("disk cold vs baseline cold", "weightcache_cold", "baseline_cold", 1),
        ("memory tier -> cuda vs pinned H2D", "weightcache_memory_cuda", "h2d_ceiling", 0.85),
        ("memory tier -> cuda vs safetensors cuda", "weightcache_memory_cuda", "safetensors_memory_cuda", 2),
    ]
    print(f"\n{'ratio':46s} {'measured':>9s} {'target':>8s}")
    for label, ours, theirs, target in ratios:
        if ours not in gbps or (theirs and theirs not in gbps) or not (theirs or ceiling):
            continue  # a row not run (--only, no CUDA, fio not installed)
        ratio = gbps[ours] / (gbps[theirs] if theirs else ceiling)
        print(f"{label:46s} {ratio:8.2f}x {'>=':>3s}{target:5.2f}x  {'ok' if ratio >= target else 'MISSED'}")


if __name__ == "__main__":
    main()
