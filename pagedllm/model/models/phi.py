"""Phi (phi-1, phi-1.5, phi-2): one LayerNorm feeding attention and MLP in parallel, RoPE on the first
`partial_rotary_factor` of each head, biased q/k/v and `dense` output projections, a gelu_new `fc1` / `fc2` MLP,
a final LayerNorm and an LM head with a bias; `qk_layernorm` adds one LayerNorm (weight and bias) over each head's
q and k before RoPE, shared by the heads.

Built of GPT-NeoX's shared LayerNorm decoder (models/gpt_neox.py), whose layout the checkpoint's names are mapped
into at load time.
"""
from __future__ import annotations

from typing import Any

import torch

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.layers.norm import LayerNorm
from pagedllm.model.layers.rotary import RotaryEmbedding
from pagedllm.model.models.gpt_neox import (
    GeluMLP,
    LayerNormCausalLM,
    LayerNormDecoderLayer,
    PartialRotaryAttention,
    attention_head_dim,
)


class PhiForCausalLM(LayerNormCausalLM):
    """HF Phi checkpoints (`model.layers.N.self_attn.dense`, `model.final_layernorm`, `lm_head.bias`)."""

    renames = {"dense": "o_proj", "final_layernorm": "norm", "q_layernorm": "q_norm", "k_layernorm": "k_norm"}
    lm_head_bias = True
    lora_modules = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "dense": "o_proj",
                    "fc1": "fc1", "fc2": "fc2"}

    def make_layer(self, config: Any, layer_index: int, tp: TensorParallelGroup, dtype: torch.dtype,
                   rotary: RotaryEmbedding) -> LayerNormDecoderLayer:
        qk_norm = None
        if getattr(config, "qk_layernorm", False):
            head_dim, eps = attention_head_dim(config), float(config.layer_norm_eps)

            def qk_norm(num_heads: int, first_head: int, total_heads: int) -> LayerNorm:
                """One LayerNorm shared by every head."""
                return LayerNorm(head_dim, eps, dtype)

        attn = PartialRotaryAttention(config, tp, dtype, rotary, qkv_bias=True, o_bias=True, qk_norm=qk_norm)
        return LayerNormDecoderLayer(attn, GeluMLP(config, tp, dtype, bias=True), self.layer_norm(config, dtype),
                                     None, parallel_residual=True)
