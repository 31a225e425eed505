"""docs/loader.md's transformers recipe, run as written (device cpu) with real transformers on a tiny Llama built
here: the model and tokenizer load from a read-only directory and generate exactly what the original model does."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures_hf import generate, tiny_llama

# not pytest.importorskip: that imports transformers (2-3 CPU seconds) in every worker's collection; the tests here
# import it where they run
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
DOC = Path(__file__).resolve().parents[1] / "docs" / "loader.md"


def recipe() -> str:
    text = DOC.read_text()
    marker = text.index("<!-- tested: tests/test_loader_transformers.py -->")
    match = re.search(r"```python\n(.*?)```", text[marker:], re.S)
    assert match, "docs/loader.md: the tested recipe's code block is missing"
    code = match.group(1)
    assert 'device = "cuda"' in code
    return code.replace('device = "cuda"', 'device = "cpu"')


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    path = tmp_path_factory.mktemp("llama") / "model"
    reference = tiny_llama(tmp_path_factory, path)
    for f in path.iterdir():
        f.chmod(0o444)
    path.chmod(0o555)  # read-only like the volume (root ignores modes; the mount test covers a real ro mount)
    return path, reference


@pytest.mark.e2e
def test_the_documented_recipe_loads_and_generates(model_dir: tuple[Path, list[int]]) -> None:
    path, reference = model_dir
    scope: dict[str, object] = {"path": str(path)}
    exec(compile(recipe(), str(DOC), "exec"), scope)  # the doc's own code, on purpose
    model, tokenizer = scope["model"], scope["tokenizer"]
    output = [int(i) for i in scope["output"][0]]  # type: ignore[index]
    assert output[:2] == tokenizer("the cache")["input_ids"] and len(output) > 2  # type: ignore[operator]
    assert generate(model, tokenizer) == reference  # the same tokens as the model that was saved
    rotary = model.model.rotary_emb.inv_freq  # type: ignore[attr-defined]
    assert not rotary.is_meta and rotary.abs().sum() > 0  # computed, not left on meta


@pytest.mark.e2e
def test_the_old_meta_device_recipe_really_fails(model_dir: tuple[Path, list[int]]) -> None:
    """Why the doc does not build on meta itself: non-persistent buffers stay there (in a child: it may crash)."""
    code = f"""
import torch, transformers
from weightcache.loader import load_state_dict
path = {str(model_dir[0])!r}
config = transformers.AutoConfig.from_pretrained(path)
with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(config)
model.load_state_dict(load_state_dict(path), assign=True, strict=False)
try:
    model.generate(torch.tensor([[4, 5]]), max_new_tokens=2)
except Exception as exc:
    print("fails:", type(exc).__name__)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(model_dir[0].parent)})
    assert "fails:" in done.stdout, done.stderr[-1500:]
