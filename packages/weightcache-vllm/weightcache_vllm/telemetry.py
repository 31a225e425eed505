"""What this pod's engine did at start, for the node: the report file at the root of its engine-cache volume.

The node's CSI plugin reads `$WEIGHTCACHE_ENGINE_CACHE/.weightcache-report` while the pod runs and when it ends
(weightcache/engine_report.py draws the format) and turns it into Events on the pod and the node's metrics
(docs/telemetry.md). A pod that mounts no engine-cache volume may have a report volume instead
(`weightcache.io/telemetry: "true"`): `$WEIGHTCACHE_REPORT_DIR` names it, and wins; its report holds the stages
alone (the compile result is about an engine-cache volume). Without either variable nothing is written; the log
lines stay.

- **weights_loaded**: the `weightcache` loader has handed the model its last tensor (vllm_loader.load_weights).
- **compile result**: what vLLM read and wrote in its cache root (`VLLM_CACHE_ROOT`, the volume) for this start.
  The files under it are listed when the weights are loaded (vLLM compiles after that, in its warm-up or
  profile run) and again when vLLM logs the end of a compile or a cache load; files it added mean it compiled,
  and inductor's FX-graph cache counters say whether it read compiled graphs back. With the cache handed over
  (the volume held compiled files at start):

      nothing written, graphs read back     hit
      written, nothing read back            incompatible: the cache was made with other compile settings
      written, some read back               miss (part of it was usable)
      written, nothing was handed over      miss (the first pod of its key compiles: no surprise)

  The compile key is vLLM's own cache key less the traced code's hash (which only the vLLM version changes):
  `sha256(str([env_hash, config_hash, compiler_hash]))`, computed with vLLM's own functions exactly as
  vllm/compilation/backends.py computes the directory name `torch_compile_cache/<hash>`.
- **engine_ready / first_token**: the stat logger `weightcache_vllm.stat_logger.WeightcacheStages` (entry point
  `vllm.stat_logger_plugins`, loaded by `vllm serve` in its front-end process): vLLM calls
  `log_engine_initialized` once the engine is up, and `record` with each step's stats, the first of which with
  generated tokens is the first token. (vLLM's offline `LLM` loads no stat logger: there the pod's startup probe's
  ready file tells engine_ready to the node.)

Every write replaces the file whole (a temporary file and a rename), merging what this process knows with what
the file holds, so the worker's and the front end's parts meet in one report.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from weightcache.vocabulary import (
    COMPILE_HIT,
    COMPILE_INCOMPATIBLE,
    COMPILE_MISS,
    ENGINE_CACHE_READY,
    ENGINE_REPORT,
    REPORT_DIR_ENV,
    STAGE_WEIGHTS_LOADED,
)

log = logging.getLogger("vllm.plugins.weightcache_vllm.telemetry")
VOLUME_ENV = "WEIGHTCACHE_ENGINE_CACHE"  # the engine-cache volume's mount (the webhook sets it)
CACHE_ROOT_ENV = "VLLM_CACHE_ROOT"
NOT_COMPILED = {"modelinfos"}  # top-level directories of the cache root that hold no compile output
MAX_FILES = 20_000  # the node hands over no more (engine_cache's bound): a listing stops there
# vLLM's log lines that end a compile or a cache load, in the process that compiled: on CPU its warm-up
# (vllm/v1/worker/cpu_model_runner.py), on GPU each graph's load or compile (vllm/compilation/backends.py)
COMPILE_DONE = ("Warming up done", "Directly load the compiled graph", "Compiling a graph for compile range")
_lock = threading.Lock()


def report_path() -> Path | None:
    volume = os.environ.get(REPORT_DIR_ENV) or os.environ.get(VOLUME_ENV)
    return Path(volume) / ENGINE_REPORT if volume and os.path.isdir(volume) else None


def update(stages: dict[str, float] | None = None, compile: dict[str, Any] | None = None) -> None:
    """Merge into the report and replace it whole; a failure is logged, never raised (telemetry must not stop an
    engine)."""
    path = report_path()
    if path is None:
        return
    with _lock:
        try:
            try:
                doc = json.loads(path.read_bytes())
            except (OSError, ValueError):
                doc = {}
            if not isinstance(doc, dict) or doc.get("version") != 1:
                doc = {"version": 1}
            doc["stages"] = {**(doc.get("stages") if isinstance(doc.get("stages"), dict) else {}), **(stages or {})}
            if compile is not None:
                doc["compile"] = compile
            tmp = path.with_name(f"{ENGINE_REPORT}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("weightcache: the engine report %s was not written: %s", path, exc)


def stage(name: str, at: float | None = None) -> None:
    update({name: time.time() if at is None else at})


def compile_key(vllm_config: Any) -> str:
    """vLLM's compile-cache factors for this config, less the traced code (vllm/compilation/backends.py)."""
    import vllm.envs as envs
    from vllm.compilation.backends import make_compiler
    from vllm.config.utils import hash_factors

    env_hash = hash_factors(envs.compile_factors())
    config_hash = vllm_config.compute_hash()
    compiler_hash = make_compiler(vllm_config.compilation_config).compute_hash(vllm_config)
    return hashlib.sha256(str([env_hash, config_hash, compiler_hash]).encode()).hexdigest()[:16]


def _files(root: Path) -> set[str]:
    """The compiled files under the cache root (relative paths): not the node's and the pod's own markers, nor
    vLLM's `modelinfos/` (what it learnt inspecting the model class, written before any compile)."""
    found: set[str] = set()
    skip = {ENGINE_REPORT, ENGINE_CACHE_READY}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))
                       and not (dirpath == str(root) and d in NOT_COMPILED)]
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if rel not in skip and not rel.startswith(f"{ENGINE_REPORT}."):
                found.add(rel)
            if len(found) >= MAX_FILES:
                return found
    return found


def _fxgraph_hits() -> int:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["inductor"]["fxgraph_cache_hit"])


def _vllm_dirs(files: set[str]) -> list[str]:
    """The `torch_compile_cache/<hash>` directories among `files` (vLLM's own compile cache, VLLM_COMPILE)."""
    return sorted({f.split("/")[1] for f in files if f.startswith("torch_compile_cache/") and f.count("/") >= 2})


class CompileWatch(logging.Handler):
    """Installed on vLLM's logger in the process that loads the weights; decides the compile result at each of
    vLLM's end-of-compile lines (the last one wins)."""

    def __init__(self, root: Path, key: str) -> None:
        super().__init__(logging.INFO)
        self.root, self.key = root, key
        self.before = _files(root)
        self.hits_before = _fxgraph_hits()
        self.read_back = False  # vLLM said it loaded compiled graphs from its cache

    def emit(self, record: logging.LogRecord) -> None:
        message = str(record.msg)
        if not any(marker in message for marker in COMPILE_DONE):
            return
        self.read_back |= "Directly load the compiled graph" in message
        try:
            self.decide()
        except Exception as exc:  # never let telemetry break vLLM's logging
            log.warning("weightcache: compile result not decided: %s", exc)

    def decide(self) -> dict[str, Any]:
        after = _files(self.root)
        written = sorted(after - self.before)
        read = self.read_back or _fxgraph_hits() > self.hits_before
        handed = bool(self.before)
        if not written:
            result = COMPILE_HIT if read or handed else COMPILE_MISS
        elif not handed:
            result = COMPILE_MISS
        else:
            result = COMPILE_MISS if read else COMPILE_INCOMPATIBLE
        new_dirs = _vllm_dirs(set(written))
        outcome = {"result": result, "key": self.key, "dir": new_dirs[0] if new_dirs else "",
                   "handed": _vllm_dirs(self.before), "written": len(written)}
        log.info("weightcache: compile cache %s: %d files written, graphs read back: %s, handed over: %d files, "
                 "compile key %s", result, len(written), read, len(self.before), self.key)
        update(compile=outcome)
        return outcome


def weights_loaded(vllm_config: Any | None) -> None:
    """The loader's last tensor is in: record the stage, and watch what vLLM compiles next (once per process)."""
    stage(STAGE_WEIGHTS_LOADED)
    root, volume = os.environ.get(CACHE_ROOT_ENV), os.environ.get(VOLUME_ENV)
    if vllm_config is None or not root or not volume or not os.path.isdir(volume) or not os.path.isdir(root):
        return  # no engine-cache volume: no compile result to tell (a report volume's report has the stages)
    vllm_logger = logging.getLogger("vllm")
    if any(isinstance(h, CompileWatch) for h in vllm_logger.handlers):
        return
    try:
        key = compile_key(vllm_config)
    except Exception as exc:  # a vLLM whose internals moved: the result is still told, without the key
        log.warning("weightcache: no compile key (%s)", exc)
        key = ""
    vllm_logger.addHandler(CompileWatch(Path(root), key))
