"""Compile-cache truth (docs/engine-caches.md, "Hit, miss or incompatible"): a real vLLM CPU start with compilation
on tells, in the engine report the node reads (weightcache_vllm.telemetry), whether the compile cache its volume
was handed was hit, missed or incompatible, from what vLLM read and wrote there.

Three starts of the tiny Llama, each in its own process, each with its own volume (VLLM_CACHE_ROOT =
WEIGHTCACHE_ENGINE_CACHE, inductor's cache under it): an empty one (a miss: it compiles), a copy of what the first
wrote (what the node hands the next pod: a hit, nothing compiled), and the same copy with one inductor option
changed (incompatible: vLLM compiles again beside the cache it was handed). Each report is then read by the
node's own code (tests_engines/node_side.py report: what the CSI plugin runs at NodeGetVolumeStats of the volume),
which must tell the pod the same result as an Event and a metric. Minutes on 2 shared cores: the two compiles
dominate.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

import pytest

HERE = Path(__file__).parent
TIMEOUT = 1200  # a compiling start took 8 minutes on the 2-core VM under a load of 10
REPORT = ".weightcache-report"  # weightcache.vocabulary.ENGINE_REPORT
OTHER_OPTION = {"inductor_compile_config": {"unroll_reductions_threshold": 9}}  # inductor's default is 8
ENGINE = "vllm-0.32.0-cpu"  # the engine-cache name a pod of this tier's vLLM carries


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_vllm_load_format import _model  # type: ignore[import-not-found]  # the tier's one tiny Llama

    return _model(tmp_path_factory)


def node_told(volume: Path, first: float) -> dict:
    """What the node tells of the report in `volume` (Events, stage and compile observations), for a pod whose
    first publish was at `first`: the daemon's classes, in the main venv."""
    python = os.environ.get("WEIGHTCACHE_NODE_PYTHON")
    if not python:
        pytest.skip("WEIGHTCACHE_NODE_PYTHON (the main venv's python) is unset: run scripts/test_engines.sh")
    out = subprocess.run([python, str(HERE / "node_side.py"), "report", str(volume), ENGINE, repr(first)],
                         cwd=HERE.parent, env={**os.environ, "PYTHONPATH": str(HERE.parent)}, capture_output=True,
                         text=True, check=True, timeout=120)
    return json.loads(out.stdout.splitlines()[-1])


def start(model: Path, volume: Path, compilation: dict[str, object]) -> dict:
    volume.mkdir(exist_ok=True)
    first = time.time()  # the pod's first publish comes before its engine starts
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": str(HERE), "VLLM_USE_AOT_COMPILE": "0", "VLLM_CACHE_ROOT": str(volume),
           "WEIGHTCACHE_ENGINE_CACHE": str(volume), "TORCHINDUCTOR_CACHE_DIR": str(volume / "inductor"),
           "TRITON_CACHE_DIR": str(volume / "triton")}
    proc = subprocess.run([sys.executable, str(HERE / "compile_run.py"), str(model), json.dumps(compilation)],
                          env=env, capture_output=True, text=True, timeout=TIMEOUT)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"engine failed ({proc.returncode}):\n{log[-6000:]}"
    line = [x for x in proc.stdout.splitlines() if x.startswith("WEIGHTCACHE_ENGINE_RESULT ")][-1]
    result = json.loads(line.split(" ", 1)[1])
    result["report"] = json.loads((volume / REPORT).read_text())
    result["log"] = log
    result["node"] = node_told(volume, first)
    print(f"[{volume.name}] up {result['engine_up_s']} s, compile {result['report'].get('compile')}")
    return result


def handed_over(volume: Path, to: Path) -> Path:
    """What the node hands the next pod: the first pod's cache, without its report."""
    shutil.copytree(volume, to, ignore=shutil.ignore_patterns(REPORT))
    return to


def test_the_stat_logger_plugin_is_installed() -> None:
    (ep,) = [ep for ep in entry_points(group="vllm.stat_logger_plugins") if ep.name == "weightcache"]
    from vllm.v1.metrics.loggers import StatLoggerBase

    assert issubclass(ep.load(), StatLoggerBase)


def test_the_openai_server_reports_engine_ready_and_first_token(model: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`vllm serve` loads the plugin's stat logger in its front end: engine ready once vLLM says the engine is up,
    first token at the first step that generated one; the worker's loader adds weights_loaded, in that order. Into
    the pod's report volume (weightcache.io/telemetry, no engine cache): the stages alone, no compile result."""
    from make_tiny_llama import PROMPT  # type: ignore[import-not-found]
    from test_vllm_load_format import serve_one_completion  # type: ignore[import-not-found]

    volume = tmp_path / "report"
    volume.mkdir()
    monkeypatch.setenv("WEIGHTCACHE_REPORT_DIR", str(volume))  # what the webhook sets for the pod
    monkeypatch.delenv("WEIGHTCACHE_ENGINE_CACHE", raising=False)
    started = time.time()
    tokens, log = serve_one_completion(model, tmp_path / "server.jsonl", PROMPT)
    written = json.loads((volume / REPORT).read_text())
    stages = written["stages"]
    assert "compile" not in written
    assert set(stages) == {"weights_loaded", "engine_ready", "first_token"}, log[-3000:]
    assert started < stages["weights_loaded"] <= stages["engine_ready"] <= stages["first_token"] < time.time()
    assert tokens


def test_a_hit_and_a_forced_miss_are_reported_as_such(model: Path, tmp_path: Path) -> None:
    cold = start(model, tmp_path / "cold", {})
    compiled = cold["report"]["compile"]
    assert compiled["result"] == "miss" and compiled["written"] > 0 and compiled["handed"] == []
    assert set(cold["report"]["stages"]) == {"weights_loaded"}  # offline: no stat logger, no probe
    assert "weightcache: compile cache miss" in cold["log"]
    assert cold["node"]["compile"] == [[ENGINE, "miss"]] and cold["node"]["stages"][0][0] == "weights_loaded"
    assert [e[:2] for e in cold["node"]["events"]] == [["WeightsLoaded", "Normal"], ["EngineCacheMiss", "Normal"]]

    warm = start(model, handed_over(tmp_path / "cold", tmp_path / "warm"), {})
    assert warm["report"]["compile"]["result"] == "hit", warm["log"][-4000:]
    assert warm["report"]["compile"]["written"] == 0 and warm["report"]["compile"]["key"] == compiled["key"]
    assert warm["tokens"] == cold["tokens"]
    assert warm["node"]["compile"] == [[ENGINE, "hit"]]
    assert ["EngineCacheHit", "Normal"] in [e[:2] for e in warm["node"]["events"]]

    other = start(model, handed_over(tmp_path / "cold", tmp_path / "other"), OTHER_OPTION)
    changed = other["report"]["compile"]
    assert changed["result"] == "incompatible" and changed["written"] > 0, other["log"][-4000:]
    assert changed["key"] != compiled["key"]  # the compile key sees the option, as vLLM's own cache key does
    assert other["node"]["compile"] == [[ENGINE, "incompatible"]]
    (told,) = [e for e in other["node"]["events"] if e[0] == "EngineCacheIncompatible"]
    assert told[1] == "Warning" and f"name it {ENGINE}-{changed['key']}" in told[2]
