"""The vLLM plugin's LoRA resolver (packages/weightcache-vllm/weightcache_vllm/lora_resolver.py, docs/adapters.md).

The file side on its own (what `adapter_path` takes and refuses), then for real on vLLM's CPU build: the OpenAI
server with --enable-lora serves adapter `a` given at start (--lora-modules) and adapter `b`, the same files put
into the adapter directory after the server started (weights first, adapter_config.json last, as the node links
them), with the same greedy tokens, which differ from the base model's; a name the directory lacks is a 404. The
directory is bind-mounted read-only where the test may mount (as the pod sees its adapter directory): what is made
in its source after the mount shows through it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.error
from pathlib import Path

import pytest
from test_vllm_load_format import _model, complete, engine_env, free_port, stop_server, wait_until_healthy
from weightcache_vllm.lora_resolver import ADAPTERS_PATH_ENV, adapter_path

HERE = Path(__file__).parent
RANK = 8


def make_lora(path: Path, base: Path, *, seed: int = 1) -> None:
    """A PEFT LoRA adapter for the tiny Llama, written as `peft.save_pretrained` writes one (rank 8, q_proj and
    v_proj of every layer), with B not zero (PEFT's init) so that it changes what the model says."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * (hidden // config["num_attention_heads"])
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for proj, out in (("q_proj", hidden), ("v_proj", kv)):
            prefix = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, hidden, generator=gen) * 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, RANK, generator=gen) * 0.5
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK, "lora_dropout": 0.0,
        "bias": "none", "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": str(base),
        "fan_in_fan_out": False, "modules_to_save": None}))


def test_the_file_side_takes_only_a_whole_adapter_named_by_one_component(tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    (root / "sql").mkdir(parents=True)
    assert adapter_path(str(root), "sql") is None, "no adapter_config.json yet: still being linked"
    (root / "sql" / "adapter_config.json").write_text("{}")
    assert adapter_path(str(root), "sql") == str(root / "sql")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "adapter_config.json").write_text("{}")
    os.symlink(tmp_path / "outside", root / "link")
    for name in ("link", "../outside", "sql/..", "..", ".hidden", "a/b", "", "x" * 300, "missing"):
        assert adapter_path(str(root), name) is None, name


def _mount_readonly(source: Path, target: Path) -> bool:
    target.mkdir(parents=True)
    done = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True).returncode == 0
    if done and subprocess.run(["mount", "-o", "remount,bind,ro", str(target)], capture_output=True).returncode:
        subprocess.run(["umount", str(target)], check=False)
        return False
    return done


def test_an_adapter_added_after_start_serves_as_one_given_at_start(tmp_path_factory: pytest.TempPathFactory,
                                                                   tmp_path: Path) -> None:
    sys.path.insert(0, str(HERE))
    from make_tiny_llama import PROMPT  # type: ignore[import-not-found]

    model = _model(tmp_path_factory)
    made = tmp_path / "made"
    make_lora(made / "a", model)
    source = tmp_path / "node"  # what the node fills
    shutil.copytree(made / "a", source / "a")
    pod_view = tmp_path / "pod" / "adapters"
    mounted = _mount_readonly(source, pod_view)
    directory = pod_view if mounted else source
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "4", "--seed", "0",
           "--enforce-eager", "--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "2",
           "--lora-modules", f"a={directory / 'a'}"]
    env = {**engine_env(tmp_path / "report.jsonl"), ADAPTERS_PATH_ENV: str(directory),
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_healthy(proc, port, log)
        base = complete(port, str(model), PROMPT)
        at_start = complete(port, "a", PROMPT)
        assert at_start != base, "the adapter changes what the model says"
        with pytest.raises(urllib.error.HTTPError) as missing:
            complete(port, "b", PROMPT)
        assert missing.value.code == 404
        (source / "b").mkdir()  # as the node links one in: weights first, adapter_config.json last
        shutil.copy(made / "a" / "adapter_model.safetensors", source / "b")
        shutil.copy(made / "a" / "adapter_config.json", source / "b")
        added = complete(port, "b", PROMPT)
        assert added == at_start, log.read_text()[-3000:]
        assert "Resolved and loaded LoRA adapter 'b'" in log.read_text()
    finally:
        stop_server(proc)
        if mounted:
            subprocess.run(["umount", str(pod_view)], check=False)
