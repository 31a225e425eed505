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
4. The CUDA path inside vLLM, when this interpreter has vLLM (a CUDA build) and the weightcache-vllm plugin: a tiny
   Llama (tests_engines/make_tiny_llama.py) served by `--load-format weightcache` and by vLLM's own safetensors
   loader (tests_engines/engine_run.py, one process each): the same greedy tokens, the plugin ran (no fallback),
   engine-up seconds of each. Without vLLM it says so and skips (the machine lent has no network: bring the
   image). `--vllm-only` runs just this step (e.g. on vLLM's CPU build, to try the script before a GPU is lent).
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import json
import mmap
import os
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


def vllm_check(work: Path) -> bool:
    """Step 4: True when both loads ran and gave the same tokens (or vLLM is absent: nothing to check)."""
    if importlib.util.find_spec("vllm") is None:
        print("4. vLLM: not installed in this interpreter; skipped (pip install vllm, then weightcache-vllm and "
              "weightcache-loader with --no-deps)")
        return True
    plugins = {e.name for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    if "weightcache" not in plugins:
        print("4. vLLM: the weightcache-vllm plugin is not installed (pip install --no-deps -e "
              "packages/weightcache-vllm -e packages/weightcache-loader)")
        return False
    engines = ROOT / "tests_engines"
    model = work / "tiny-llama"
    subprocess.run([sys.executable, str(engines / "make_tiny_llama.py"), str(model)], check=True)
    runs = {}
    for load_format in ("safetensors", "weightcache"):
        report = work / f"report-{load_format}.jsonl"
        report.unlink(missing_ok=True)
        env = {**os.environ, "WEIGHTCACHE_VLLM_REPORT": str(report), "VLLM_CPU_KVCACHE_SPACE": "1"}
        done = subprocess.run([sys.executable, str(engines / "engine_run.py"), str(model), load_format], cwd=engines,
                              env=env, capture_output=True, text=True, timeout=900)
        line = next((x for x in done.stdout.splitlines() if x.startswith("WEIGHTCACHE_ENGINE_RESULT ")), None)
        if line is None:
            print(f"4. vLLM --load-format {load_format} failed (exit {done.returncode}): {done.stderr[-1500:]}")
            return False
        runs[load_format] = json.loads(line.split(" ", 1)[1])
        runs[load_format]["reports"] = [json.loads(x) for x in report.read_text().splitlines()] \
            if report.exists() else []
    ours, theirs = runs["weightcache"], runs["safetensors"]
    ran = bool(ours["reports"]) and not any(r.get("fallback") for r in ours["reports"])
    same = ours["tokens"] == theirs["tokens"]
    loads = ", ".join(f"{r.get('seconds')} s" for r in ours["reports"])
    version = next((d.version for d in importlib.metadata.distributions()
                    if (d.metadata["Name"] or "").lower() in ("vllm", "vllm-cpu")), "?")  # CPU builds: vllm-cpu
    print(f"4. vLLM {version}: same greedy tokens: {same}; plugin loaded it (no "
          f"fallback): {ran}; engine up {ours['engine_up_s']} s (weightcache) vs {theirs['engine_up_s']} s "
          f"(safetensors); load {loads} per process")
    return same and ran


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/weightcache-gpu-check"))
    ap.add_argument("--vllm-only", action="store_true", help="only step 4 (vLLM's load format), on any device")
    args = ap.parse_args()
    if args.vllm_only:
        return 0 if vllm_check(args.dir) else 1
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
    vllm_ok = vllm_check(args.dir)
    return 0 if tests.returncode == 0 and vllm_ok else 1


if __name__ == "__main__":
    sys.exit(main())
