"""A real, tiny Hugging Face model directory made in the test: a Llama (transformers' own classes, random weights)
and a word-level fast tokenizer, written with save_pretrained exactly as the hub would serve them.

    reference = make_tiny_llama(path)            # config.json, model.safetensors, tokenizer.json, ...
    assert generate(model, tokenizer) == reference
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
