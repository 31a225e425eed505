"""A tiny but real Llama that vLLM can serve: transformers' own classes, random weights, a word-level tokenizer
built here, written with save_pretrained (safetensors). Nothing comes from a hub.

    python tests_engines/make_tiny_llama.py DIR [--bin]     # --bin: pytorch_model.bin instead (no safetensors)

vLLM's CPU attention needs a head size of at least 32: hidden 64 over 2 heads.
"""

from __future__ import annotations

import sys
from pathlib import Path

WORDS = ("the", "cache", "serves", "model", "weights", "from", "disk", "to", "every", "pod", "on", "a", "node", "fast",
         "and", "safe")
PROMPT = "the cache serves the model weights to every pod"
VOCAB = 256


def make_tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[PAD]", "[BOS]", "[EOS]", *WORDS]
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", bos_token="[BOS]",
                                   eos_token="[EOS]")


def make(directory: Path, *, safetensors: bool = True) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tokenizer = make_tokenizer()
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, pad_token_id=1, bos_token_id=2, eos_token_id=3,
                         torch_dtype="float32")
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the default init, so greedy decoding is not a flat tie
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.5)
    model.save_pretrained(directory)
    if not safetensors:  # transformers 5 always writes safetensors: a .bin checkpoint by hand, as older ones did
        torch.save(model.state_dict(), Path(directory) / "pytorch_model.bin")
        for f in Path(directory).glob("*.safetensors*"):
            f.unlink()
    tokenizer.save_pretrained(directory)


if __name__ == "__main__":
    make(Path(sys.argv[1]), safetensors="--bin" not in sys.argv[2:])
