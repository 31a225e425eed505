"""A tiny but real Llama that vLLM can serve: transformers' own classes, random weights, a word-level tokenizer
built here, written with save_pretrained (safetensors, sharded with an index). Nothing comes from a hub.

    python tests_engines/make_tiny_llama.py DIR [--bin]     # --bin: pytorch_model.bin instead (no safetensors)
    python tests_engines/make_tiny_llama.py DIR --layers 4 --hidden 2048 --vocab 32000 --shard-bytes 500000000
                                                             # a larger one for scripts/bench_engine.py

vLLM's CPU attention needs a head size of at least 32: hidden 64 over 2 heads.
"""

from __future__ import annotations

import argparse
from pathlib import Path

WORDS = ("the", "cache", "serves", "model", "weights", "from", "disk", "to", "every", "pod", "on", "a", "node", "fast",
         "and", "safe")
PROMPT = "the cache serves the model weights to every pod"
VOCAB = 256
SHARD_BYTES = 200_000  # of the 0.45 MB of float32 weights


def make_tokenizer(vocab: int = VOCAB):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[PAD]", "[BOS]", "[EOS]", *WORDS]
    words += [f"w{i}" for i in range(vocab - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", bos_token="[BOS]",
                                   eos_token="[EOS]")


def make(directory: Path, *, safetensors: bool = True, layers: int = 2, hidden: int = 64, vocab: int = VOCAB,
         shard_bytes: int = SHARD_BYTES) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tokenizer = make_tokenizer(vocab)
    heads = max(2, hidden // 128)  # the tiny one: 2 heads of 32
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=256,
                         tie_word_embeddings=False, pad_token_id=1, bos_token_id=2, eos_token_id=3,
                         torch_dtype="float32")
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the default init, so greedy decoding is not a flat tie
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.5)
    model.save_pretrained(directory, max_shard_size=shard_bytes)  # 3 shards and their index, as large models come
    if not safetensors:  # transformers 5 always writes safetensors: a .bin checkpoint by hand, as older ones did
        torch.save(model.state_dict(), Path(directory) / "pytorch_model.bin")
        for f in Path(directory).glob("*.safetensors*"):
            f.unlink()
    tokenizer.save_pretrained(directory)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("directory", type=Path)
    ap.add_argument("--bin", action="store_true")
    for name, default in (("layers", 2), ("hidden", 64), ("vocab", VOCAB), ("shard-bytes", SHARD_BYTES)):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args()
    make(a.directory, safetensors=not a.bin, layers=a.layers, hidden=a.hidden, vocab=a.vocab, shard_bytes=a.shard_bytes)
