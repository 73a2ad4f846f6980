"""RoPE scaling against transformers' own computation (`transformers.modeling_rope_utils`): the inverse
frequencies and the cos/sin factor of each supported type, from the same HF config."""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedllm.model.layers.rotary import RotaryEmbedding, _inv_freq, attention_factor, rope_parameters

SHAPE = dict(vocab_size=100, hidden_size=256, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 1024},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 16, "beta_slow": 2,
     "truncate": False},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048, "attention_factor": 1.3},
], ids=["linear", "llama3", "yarn", "yarn-betas-untruncated", "yarn-mscale", "yarn-attention-factor"])
def test_inverse_frequencies_and_factor_match_transformers(scaling: dict) -> None:
    config = transformers.LlamaConfig(**SHAPE, rope_theta=500000.0, rope_scaling=dict(scaling))
    params = rope_parameters(config)
    want_inv, want_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    torch.testing.assert_close(_inv_freq(64, params).float(), want_inv.float(), rtol=2e-6, atol=0)
    assert attention_factor(params) == pytest.approx(want_factor, rel=1e-12)
    rope = RotaryEmbedding(64, 64, params, torch.float32)
    assert rope.cos_cache[0, 0].item() == pytest.approx(want_factor)  # cos(0) · the factor


def test_unsupported_scaling_is_a_clear_error() -> None:
    config = transformers.LlamaConfig(**SHAPE, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="'dynamic' is not supported; supported: default, linear, llama3, yarn"):
        RotaryEmbedding(64, 64, rope_parameters(config), torch.float32)
