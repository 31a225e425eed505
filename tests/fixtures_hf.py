"""A real, tiny Hugging Face model directory made in the test: a Llama (transformers' own classes, random weights)
and a word-level fast tokenizer, written with save_pretrained exactly as the hub would serve them.

    reference = make_tiny_llama(path)            # config.json, model.safetensors, tokenizer.json, ...
    assert generate(model, tokenizer) == reference

Building one imports torch and transformers in the test process (~5 CPU seconds): `tiny_llama` builds it once per
test run for every xdist worker and copies it. Loading through the hub takes a fresh interpreter (the offline
switches are read at import): `hub_loader` is one child per worker that imports transformers once and loads each
repo it is asked for, as `AutoModelForCausalLM.from_pretrained("org/name")` does with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

PROMPT = "the cache serves the model"
WORDS = ("the", "cache", "serves", "model", "weights", "from", "disk", "to", "every", "pod", "on", "a", "node", "fast",
         "and", "safe")


def make_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", "[BOS]", "[EOS]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", bos_token="[BOS]",
                                   eos_token="[EOS]")


def generate(model: Any, tokenizer: Any, device: str = "cpu") -> list[int]:
    inputs = tokenizer(PROMPT, return_tensors="pt").to(device)
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return [int(i) for i in out[0]]


def make_tiny_llama(directory: Path) -> list[int]:
    """Write the model and tokenizer into `directory`; returns what greedy generation of PROMPT gives."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tokenizer = make_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return generate(model, tokenizer)


def tiny_llama(factory: pytest.TempPathFactory, directory: Path) -> list[int]:
    """make_tiny_llama(directory), built once per run under a lock in the run's temp dir (shared by the xdist workers:
    the parent of each worker's own) and copied; the same seed gives the same files and tokens every time."""
    root = factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent
    built = root / "tiny-llama"
    with open(root / "tiny-llama.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (built / "reference.json").is_file():
            shutil.rmtree(built, ignore_errors=True)
            reference = make_tiny_llama(built / "model")
            (built / "reference.json").write_text(json.dumps(reference))  # last: it marks the build whole
    shutil.copytree(built / "model", directory)
    tokens: list[int] = json.loads((built / "reference.json").read_text())
    return tokens


_SERVE = textwrap.dedent("""
    import gc, json, sys
    import huggingface_hub, transformers
    sys.path.insert(0, sys.argv[1])
    from tests.fixtures_hf import generate

    def load(repo, cache):
        path = huggingface_hub.snapshot_download(repo, cache_dir=cache)
        model = transformers.AutoModelForCausalLM.from_pretrained(repo, cache_dir=cache)
        tokenizer = transformers.AutoTokenizer.from_pretrained(repo, cache_dir=cache)
        return {"path": path, "tokens": generate(model, tokenizer)}

    for line in sys.stdin:
        asked = json.loads(line)
        try:
            answer = load(asked["repo"], asked["cache"])
        except Exception as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        gc.collect()  # the model's mappings of the files go before the answer: the test may unmount them next
        print("ANSWER " + json.dumps(answer), flush=True)
""")


class HubLoader:
    """A child with real transformers and huggingface_hub, offline, that loads `repo` from a hub cache directory."""

    def __init__(self, home: Path) -> None:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "HF_HUB_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_CACHE": str(home / "no-cache")}
        self._stderr: IO[str] = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed by close()
        self._child = subprocess.Popen([sys.executable, "-c", _SERVE, str(Path(__file__).resolve().parents[1])],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                       text=True, env=env, cwd=home)

    def load(self, cache: Path, repo: str) -> dict[str, Any]:
        """{"path": the snapshot directory the hub resolved, "tokens": greedy generation of PROMPT}."""
        assert self._child.stdin and self._child.stdout
        self._child.stdin.write(json.dumps({"repo": repo, "cache": str(cache)}) + "\n")
        self._child.stdin.flush()
        for line in self._child.stdout:
            if line.startswith("ANSWER "):
                answer: dict[str, Any] = json.loads(line[len("ANSWER "):])
                assert "error" not in answer, answer["error"]
                return answer
        self._stderr.seek(0)
        raise AssertionError(f"the hub loader exited {self._child.wait()}: {self._stderr.read()[-3000:]}")

    def close(self) -> None:
        if self._child.stdin:
            self._child.stdin.close()
        self._child.wait(timeout=30)
        self._stderr.close()


@pytest.fixture(scope="session")
def hub_loader(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubLoader]:
    loader = HubLoader(tmp_path_factory.mktemp("hub-home"))
    yield loader
    loader.close()
