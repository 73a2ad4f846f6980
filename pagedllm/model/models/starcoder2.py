"""StarCoder2 (3B / 7B / 15B): sequential LayerNorm blocks (`norm_epsilon`), GQA with RoPE on whole heads, biases on
every linear (`use_bias`), a gelu_pytorch_tanh `c_fc` / `c_proj` MLP, a sliding window on every layer
(`sliding_window`) and, usually, an LM head tied to the token embedding.

Built of GPT-NeoX's shared LayerNorm decoder (models/gpt_neox.py), whose layout the checkpoint's names are mapped
into at load time.
"""
from __future__ import annotations

from typing import Any

import torch

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.layers.rotary import RotaryEmbedding
from pagedllm.model.models.gpt_neox import (
    GeluMLP,
    LayerNormCausalLM,
    LayerNormDecoderLayer,
    PartialRotaryAttention,
)


class Starcoder2ForCausalLM(LayerNormCausalLM):
    """HF StarCoder2 checkpoints (Llama's attention names, `mlp.c_fc` / `mlp.c_proj`)."""

    renames = {"c_fc": "fc1", "c_proj": "fc2"}
    lora_modules = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
                    "c_fc": "fc1", "c_proj": "fc2"}
    eps_key = "norm_epsilon"
    tie_default = True
    partial_rotary = False  # transformers' StarCoder2 rotates whole heads, whatever partial_rotary_factor says
    uses_sliding_window = True

    def make_layer(self, config: Any, layer_index: int, tp: TensorParallelGroup, dtype: torch.dtype,
                   rotary: RotaryEmbedding) -> LayerNormDecoderLayer:
        bias = bool(getattr(config, "use_bias", True))
        attn = PartialRotaryAttention(config, tp, dtype, rotary, qkv_bias=bias, o_bias=bias,
                                      sliding_window=self.layer_window(config, layer_index))
        return LayerNormDecoderLayer(attn, GeluMLP(config, tp, dtype, bias=bias), self.layer_norm(config, dtype),
                                     self.layer_norm(config, dtype), parallel_residual=False)
