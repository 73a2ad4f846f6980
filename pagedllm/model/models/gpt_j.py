"""GPT-J (EleutherAI's GPT-J-6B and its fine-tunes): one LayerNorm per block feeding attention and a gelu_new MLP in
parallel (h + attn(ln_1(h)) + mlp(ln_1(h))), bias-free q/k/v/out projections, RoPE on the first `rotary_dim` dims of
each head rotating interleaved pairs (rotate_every_two, theta 10000), a final LayerNorm and an untied LM head with a
bias.

Built of GPT-NeoX's shared LayerNorm decoder (models/gpt_neox.py), whose layout the checkpoint's names are mapped
into at load time; the interleaved RoPE runs as the engine's rotate-half RoPE on reordered q/k rows
(models/interleaved_rope.py).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.layers.rotary import RotaryEmbedding
from pagedllm.model.models.gpt_neox import (
    GeluMLP,
    LayerNormCausalLM,
    LayerNormDecoderLayer,
    PartialRotaryAttention,
    attention_head_dim,
)
from pagedllm.model.models.interleaved_rope import interleaved_rope_tensors


def _rotary_dim(config: Any) -> int:
    rotary_dim = getattr(config, "rotary_dim", None)
    head_dim = attention_head_dim(config)
    if rotary_dim is None or not 0 < int(rotary_dim) <= head_dim or int(rotary_dim) % 2:
        raise ValueError(f"GPT-J needs an even rotary_dim in (0, head_dim = {head_dim}], got {rotary_dim}")
    return int(rotary_dim)


class GPTJForCausalLM(LayerNormCausalLM):
    """HF GPT-J checkpoints (`transformer.h.N.attn.{q,k,v,out}_proj`, `mlp.fc_in` / `fc_out`, `lm_head.bias`)."""

    prefix_renames = (("transformer.h.", "model.layers."), ("transformer.wte.", "model.embed_tokens."),
                      ("transformer.ln_f.", "model.norm."))
    renames = {"ln_1": "input_layernorm", "attn": "self_attn", "out_proj": "o_proj", "fc_in": "fc1", "fc_out": "fc2"}
    lora_modules = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "out_proj": "o_proj",
                    "fc_in": "fc1", "fc_out": "fc2"}
    eps_key = "layer_norm_epsilon"
    lm_head_bias = True

    def rotary_embedding(self, config: Any) -> RotaryEmbedding:
        """RoPE at theta 10000 (GPT-J's fixed base) on the first rotary_dim dims of each head."""
        return RotaryEmbedding(attention_head_dim(config), int(config.max_position_embeddings),
                               {"rope_theta": 10000.0, "rope_type": "default"}, torch.float32, _rotary_dim(config))

    def make_layer(self, config: Any, layer_index: int, tp: TensorParallelGroup, dtype: torch.dtype,
                   rotary: RotaryEmbedding) -> LayerNormDecoderLayer:
        attn = PartialRotaryAttention(config, tp, dtype, rotary, qkv_bias=False, o_bias=False)
        mlp = GeluMLP(config, tp, dtype, bias=True, intermediate_size=getattr(config, "n_inner", None)
                      or 4 * config.hidden_size, act=getattr(config, "activation_function", "gelu_new"))
        return LayerNormDecoderLayer(attn, mlp, self.layer_norm(config, dtype), None, parallel_residual=True)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Drops old checkpoints' causal-mask buffers (`attn.bias` / `attn.masked_bias`); reorders q/k rows."""
        kept = ((n, t) for n, t in weights if not n.endswith((".attn.bias", ".attn.masked_bias")))
        return interleaved_rope_tensors(super().checkpoint_tensors(kept), attention_head_dim(self.config),
                                        _rotary_dim(self.config))
