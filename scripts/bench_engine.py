#!/usr/bin/env python3
"""Loads inside vLLM: the plugin (`--load-format weightcache`) against vLLM's default loader on the same files.

    sudo .venv/bin/python scripts/bench_engine.py [--size-gb 1.5] [--runs 3] [--only warm,cold,memory]

A float32 Llama of random weights (tests_engines/make_tiny_llama.py at hidden 2048, vocab 32000, as many layers as
fill --size-gb; shards of at most 500 MB and their index, a word-level tokenizer), made once, is prefetched with
the real `weightcache prefetch` into a store; each trial is a fresh vLLM (CPU build, the
engines venv of scripts/test_engines.sh: $WEIGHTCACHE_ENGINES_VENV or .venv-engines) started offline on the
snapshot by scripts/engine_start.py (eager, dtype float32: no compile, no dtype conversion, so the start is the
weights plus vLLM's own fixed costs), one greedy token generated. Conditions:
  warm    the snapshot's pages in the page cache (read once before the runs)
  cold    `echo 1 > /proc/sys/vm/drop_caches` (root) right before the engine starts
  memory  the snapshot of a second store held by the memory tier in mlock mode (tests_engines/node_side.py: the
          daemon's MemoryTier, promoted once before the runs; a separate copy, so its locked pages do not warm
          the cold trials), the page cache dropped before each start as for cold
Per trial: "load s", vLLM's own "Loading weights took" line for the default loader and the plugin's
"weightcache: loaded N tensors ... in S s" for ours (both the time inside `load_weights`); "up s", LLM() to its
return (weights, profile, KV cache); CPU s, user + system of the engine's whole process tree (getrusage of
the reaped children). Loaders alternate order run by run, conditions interleaved; medians; ratio = default / plugin
(> 1: the plugin is faster). Every trial's first token must be the same for both loaders. The load average is
printed at the start and the end: on a shared machine it moves the rows more than their gaps.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.bench_load import drop_caches  # noqa: E402

START_RESULT = "WEIGHTCACHE_ENGINE_START "  # scripts/engine_start.py's line
_DEFAULT_LOAD = re.compile(r"Loading weights took ([0-9.]+) seconds")
_OUR_LOAD = re.compile(r"weightcache: loaded \d+ tensors \([0-9.]+ MB\) from \S+ in ([0-9.]+)s")
LOADERS = {"weightcache": "plugin (--load-format weightcache)", "auto": "vLLM default loader"}


def engines_python() -> str:
    venv = Path(os.environ.get("WEIGHTCACHE_ENGINES_VENV") or ROOT / ".venv-engines")
    python = venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no engines venv at {venv}: run scripts/test_engines.sh once (it makes it)")
    return str(python)


def model_shape(size_gb: float) -> dict[str, int]:
    """hidden 2048, vocab 32000, as many layers (attention 4 h^2, MLP 3 x h x 2h float32: 168 MB) as fill size_gb."""
    hidden, vocab = 2048, 32000
    per_layer = (4 + 6) * hidden * hidden * 4
    layers = max(1, round((size_gb * 1e9 - 2 * vocab * hidden * 4) / per_layer))
    return {"layers": layers, "hidden": hidden, "vocab": vocab}


def prefetch(src: Path, root: Path) -> Path:
    out = subprocess.run([str(ROOT / ".venv" / "bin" / "weightcache"), "prefetch", f"file://{src}/", "--root",
                          str(root), "--no-daemon", "-q"], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def read_all(directory: Path) -> None:
    for f in directory.iterdir():
        with open(f, "rb") as fh:
            while fh.read(16 << 20):
                pass


def trial(python: str, model: Path, load_format: str, report: Path) -> dict[str, float]:
    report.unlink(missing_ok=True)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "WEIGHTCACHE_VLLM_REPORT": str(report)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([python, str(ROOT / "scripts" / "engine_start.py"), str(model), "--load-format",
                          load_format], env=env, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    log = out.stdout + out.stderr
    line = next((x for x in log.splitlines() if x.startswith(START_RESULT)), None)
    if out.returncode or line is None:
        raise SystemExit(f"vLLM ({load_format}) failed (exit {out.returncode}):\n{log[-4000:]}")
    result = json.loads(line[len(START_RESULT):])
    found = (_OUR_LOAD if load_format == "weightcache" else _DEFAULT_LOAD).search(log)
    if found is None:
        raise SystemExit(f"vLLM ({load_format}) printed no load time:\n{log[-4000:]}")
    if load_format == "weightcache" and not report.exists():
        raise SystemExit("the plugin did not run (no report): is weightcache-vllm installed in the engines venv?")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"load_s": float(found.group(1)), "up_s": result["engine_up_s"], "cpu_s": cpu,
            "token": result["tokens"][0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.5)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", default="warm,cold,memory")
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/weightcache-bench-engine"))
    args = ap.parse_args()
    conditions = args.only.split(",")
    if ("cold" in conditions or "memory" in conditions) and os.geteuid() != 0:
        raise SystemExit("cold and memory trials drop the page cache: run as root (or --only warm)")
    python = engines_python()
    shape = model_shape(args.size_gb)
    src = args.dir / f"src-{shape['layers']}x{shape['hidden']}"
    if not (src / "tokenizer.json").exists():
        shutil.rmtree(args.dir, ignore_errors=True)
        subprocess.run([python, str(ROOT / "tests_engines" / "make_tiny_llama.py"), str(src),
                        *(f"--{k}={v}" for k, v in shape.items()), "--shard-bytes=500000000"], check=True)
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    shards = len(list(src.glob("*.safetensors")))
    snapshot = prefetch(src, args.dir / "store")
    holder = None
    if "memory" in conditions:
        prefetch(src, args.dir / "store-memory")
        holder = subprocess.Popen([str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "tests_engines" / "node_side.py"),
                                   "hold", str(args.dir / "store-memory"), f"file://{src}/", "mlock"],
                                  cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert holder.stdout is not None
        line = holder.stdout.readline()
        if not line:
            raise SystemExit("the memory tier could not hold the model (root, or CAP_IPC_LOCK, and RAM for it)")
        memory_path = Path(json.loads(line)["path"])
    version = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    print(f"model: {size / 1e9:.2f} GB float32, {shape['layers']} layers, {shards} shards + index; vLLM "
          f"{version.stdout.strip()}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        for run in range(args.runs):
            for condition in conditions:
                order = list(LOADERS) if run % 2 == 0 else list(reversed(LOADERS))
                for load_format in order:
                    model = memory_path if condition == "memory" else snapshot
                    if condition == "warm":
                        read_all(model)
                    else:
                        drop_caches()
                    r = trial(python, model, load_format, args.dir / "report.jsonl")
                    results.setdefault((condition, load_format), []).append(r)
                    print(f"  run {run + 1} {condition:<6} {load_format:<11} load {r['load_s']:6.2f} s  up "
                          f"{r['up_s']:6.2f} s  CPU {r['cpu_s']:6.2f} s  (load average {os.getloadavg()[0]:.1f})",
                          flush=True)
    finally:
        if holder is not None:
            assert holder.stdin is not None
            holder.stdin.close()
            holder.wait()
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    tokens = {r["token"] for rs in results.values() for r in rs}
    if len(tokens) != 1:
        raise SystemExit(f"the loaders' first tokens differ: {sorted(tokens)}")

    def med(condition: str, load_format: str, key: str) -> float:
        return statistics.median(r[key] for r in results[(condition, load_format)])

    print("\n| condition | loader | load s (vLLM's line) | GB/s | engine up s | CPU s | load runs (s) "
          "| ratio load / up |")
    print("|---|---|---|---|---|---|---|---|")
    for condition in conditions:
        for load_format, name in LOADERS.items():
            load, up = med(condition, load_format, "load_s"), med(condition, load_format, "up_s")
            runs = " ".join(f"{r['load_s']:.2f}" for r in results[(condition, load_format)])
            ratio = (f"{med(condition, 'auto', 'load_s') / load:.2f}x / {med(condition, 'auto', 'up_s') / up:.2f}x"
                     if load_format == "weightcache" and load else "1.00x / 1.00x")
            print(f"| {condition} | {name} | {load:.2f} | {size / 1e9 / load if load else float('inf'):.2f} | "
                  f"{up:.2f} | {med(condition, load_format, 'cpu_s'):.1f} | {runs} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
