#!/usr/bin/env python3
"""One short check for a machine with a GPU: does the loader's CUDA path work, and how fast is it.

    sudo .venv/bin/python scripts/gpu_check.py --size-gb 2        # about 2 minutes; exit 1 if a check fails

1. cudaHostRegister(cudaHostRegisterReadOnly) on a read-only MAP_SHARED mapping of a disk file (what the memory
   tier's "mlock" mode hands pods) and of a /dev/shm file (its "tmpfs" mode): which one a pod can page-lock in place.
2. The CUDA tests of tests/test_loader.py (bit-exact against safetensors, every dtype, register and bounce paths).
3. Speed with the model held by a MemoryTier (locked in RAM), in-process, medians of 3 after a warm-up:
   plain pinned H2D copy (the PCIe ceiling), safetensors.torch.load_file(device="cuda"), and the loader with
   host_register None (auto) / True (in place) / False (bounce buffers).
   Targets: >= 0.85x the ceiling, >= 2x safetensors.
"""

from __future__ import annotations

import argparse
import functools
import mmap
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from safetensors.torch import load_file, save_file  # noqa: E402

from weightcache.errors import MemoryTierError  # noqa: E402
from weightcache.loader import _clear_cuda_error, iter_tensors  # noqa: E402
from weightcache.memory import MemoryTier  # noqa: E402
from weightcache.store.types import Snapshot  # noqa: E402


def make_model(directory: Path, size_gb: float, shards: int = 4) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    per_tensor = 32 << 20
    count = max(1, int(size_gb * 1e9) // per_tensor // shards)
    gen = torch.Generator().manual_seed(0)
    for s in range(shards):
        tensors = {f"layers.{s}.{i}.weight": torch.randint(0, 256, (per_tensor,), dtype=torch.uint8, generator=gen)
                   .view(torch.bfloat16).view(4096, -1) for i in range(count)}
        save_file(tensors, str(directory / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"))
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def try_register(path: Path) -> str:
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = torch.frombuffer(mm, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    results = []
    for flags, label in ((8, "ReadOnly"), (0, "Default")):
        err = int(cudart.cudaHostRegister(base.data_ptr(), base.numel(), flags))
        if err == 0:
            cudart.cudaHostUnregister(base.data_ptr())
        else:
            _clear_cuda_error()
        results.append(f"{label}: {'ok' if err == 0 else f'cudaError {err}'}")
    return ", ".join(results)


def timed(fn: Callable[[], object], runs: int = 3) -> float:
    fn()  # warm-up (CUDA context, allocator, code pages)
    out = []
    for _ in range(runs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
        del result
        torch.cuda.empty_cache()
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/weightcache-gpu-check"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device visible to torch; install a CUDA build of torch and run this on a GPU machine")
        return 1
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    total = make_model(args.dir, args.size_gb)
    shard = sorted(args.dir.glob("*.safetensors"))[0]
    print(f"1. cudaHostRegister on a disk file mapping: {try_register(shard)}")
    shm = Path(tempfile.mkdtemp(dir="/dev/shm")) if Path("/dev/shm").is_dir() else None
    if shm is not None:
        shutil.copy(shard, shm / shard.name)
        print(f"   cudaHostRegister on a /dev/shm mapping:   {try_register(shm / shard.name)}")
        shutil.rmtree(shm)

    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests/test_loader.py"], cwd=ROOT,
                           capture_output=True, text=True)
    print(f"2. CUDA tests: {tests.stdout.strip().splitlines()[-1] if tests.stdout.strip() else tests.stderr[-500:]}")

    tier = MemoryTier(total + (256 << 20))
    try:
        tier.promote(Snapshot("gpu-check", args.dir, "file://gpu-check/", None, total))
        held = "held by the memory tier (mlock)"
    except MemoryTierError as exc:
        held = f"NOT locked ({exc}); page cache only"
    src = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(total, dtype=torch.uint8, device="cuda")
    files = sorted(args.dir.glob("*.safetensors"))
    rows = {
        "pinned H2D copy (ceiling)": timed(functools.partial(dst.copy_, src, non_blocking=True)),
        "safetensors load_file(device=cuda)": timed(lambda: [load_file(f, device="cuda") for f in files]),
        "loader, auto": timed(lambda: dict(iter_tensors(args.dir, device="cuda"))),
        "loader, register in place": timed(lambda: dict(iter_tensors(args.dir, device="cuda", host_register=True))),
        "loader, bounce buffers": timed(lambda: dict(iter_tensors(args.dir, device="cuda", host_register=False))),
    }
    del src, dst
    tier.close()
    print(f"3. {total / 1e9:.2f} GB, {held}, medians of 3 back-to-back runs")
    ceiling, st = total / rows["pinned H2D copy (ceiling)"], total / rows["safetensors load_file(device=cuda)"]
    print(f"   {'method':38s} {'GB/s':>7s} {'x ceiling':>9s} {'x safetensors':>13s}")
    for label, seconds in rows.items():
        rate = total / seconds
        print(f"   {label:38s} {rate / 1e9:7.2f} {rate / ceiling:9.2f} {rate / st:13.2f}")
    return 0 if tests.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
