"""weightcache_vllm.options: the extra config and the per-rank tensor filter (no vLLM needed)."""

from __future__ import annotations

import pytest
from weightcache_vllm import Options, parse_options, weights_wanted

NAMES = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight",
         "model.layers.1.self_attn.rotary_emb.inv_freq", "model.layers.10.input_layernorm.weight",
         "vision_tower.layers.0.weight", "model.norm.weight", "lm_head.weight"]


def test_defaults() -> None:
    assert parse_options(None) == Options(verify=True, require=False, path=None, exclude=())
    assert parse_options({"verify": False, "require": True, "path": "/models/m", "exclude": "*.bias"}) == Options(
        verify=False, require=True, path="/models/m", exclude=("*.bias",))


@pytest.mark.parametrize("extra", [{"verfy": True}, {"verify": "yes"}, {"path": 3}, {"exclude": [1]}, {"path": ""}])
def test_bad_extra_config_says_which(extra: dict) -> None:
    with pytest.raises(ValueError, match="model-loader-extra-config"):
        parse_options(extra)


def test_everything_on_one_rank_but_computed_buffers() -> None:
    assert weights_wanted(NAMES) == [n for n in NAMES if not n.endswith("inv_freq")]


def test_tied_embeddings_skip_lm_head() -> None:
    assert "lm_head.weight" not in weights_wanted(NAMES, tied_embeddings=True)


def test_pipeline_stage_reads_only_its_layers() -> None:
    got = weights_wanted(NAMES, layer_range=(1, 2))
    assert got == ["model.embed_tokens.weight", "model.layers.1.mlp.up_proj.weight", "vision_tower.layers.0.weight",
                   "model.norm.weight", "lm_head.weight"]  # other towers are never filtered


def test_exclude_globs() -> None:
    assert weights_wanted(NAMES, exclude=["model.layers.*"]) == [
        "model.embed_tokens.weight", "vision_tower.layers.0.weight", "model.norm.weight", "lm_head.weight"]
