"""A small but real model on disk: safetensors shards with an index, config.json and tokenizer files.

Used by the tests, the demo and the benchmarks, so nothing ever downloads weights from a hub. It needs numpy and
safetensors, which are dev dependencies: the product itself never makes a model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def make_model(
    directory: str | Path,
    *,
    layers: int = 4,
    hidden: int = 256,
    vocab: int = 1024,
    shards: int = 2,
    dtype: str = "float16",
    seed: int = 0,
) -> list[Path]:
    """Write a Llama-shaped model into `directory`; returns every file written (relative order stable)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    np_dtype = np.dtype(dtype)
    tensors: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[f"{p}.self_attn.{name}.weight"] = (hidden, hidden)
        for name, shape in (("gate_proj", (4 * hidden, hidden)), ("up_proj", (4 * hidden, hidden)),
                            ("down_proj", (hidden, 4 * hidden))):
            tensors[f"{p}.mlp.{name}.weight"] = shape
        tensors[f"{p}.input_layernorm.weight"] = (hidden,)
    tensors["model.norm.weight"] = (hidden,)
    tensors["lm_head.weight"] = (vocab, hidden)

    names = list(tensors)
    per_shard = -(-len(names) // shards)
    written: list[Path] = []
    weight_map: dict[str, str] = {}
    for s in range(shards):
        chunk = names[s * per_shard:(s + 1) * per_shard]
        if not chunk:
            continue
        fname = "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        arrays = {n: _random(rng, tensors[n], np_dtype) for n in chunk}
        save_file(arrays, str(root / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, fname))
        written.append(root / fname)
    if shards > 1:
        total = sum(int(np.prod(tensors[n])) * np_dtype.itemsize for n in names)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_json(root / "model.safetensors.index.json", index)
        written.append(root / "model.safetensors.index.json")
    _write_json(root / "config.json", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": 4 * hidden, "num_hidden_layers": layers, "num_attention_heads": max(1, hidden // 64),
        "num_key_value_heads": max(1, hidden // 64), "vocab_size": vocab, "torch_dtype": str(np_dtype),
    })
    tokenizer_config = {"model_max_length": 2048, "tokenizer_class": "PreTrainedTokenizerFast"}
    _write_json(root / "tokenizer_config.json", tokenizer_config)
    vocab_map = {f"tok{i}": i for i in range(vocab)}
    _write_json(root / "tokenizer.json", {"version": "1.0", "model": {"type": "WordLevel", "vocab": vocab_map,
                                                                     "unk_token": "tok0"}})
    written += [root / "config.json", root / "tokenizer_config.json", root / "tokenizer.json"]
    return written


def _random(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    if dtype.kind == "f":
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    return rng.integers(-100, 100, size=shape).astype(dtype)


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
