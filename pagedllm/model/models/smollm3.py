"""Hugging Face's SmolLM3 (``SmolLM3ForCausalLM``): the Llama architecture with RoPE skipped on some layers ("NoPE").

``no_rope_layers[i]`` is 1 where layer i applies RoPE and 0 where it does not; transformers fills it in from
``no_rope_layer_interval`` (default 4: every fourth layer, 3, 7, 11, …, has no RoPE). Sliding windows, where
``use_sliding_window`` is set, apply to the layers ``layer_types`` marks "sliding_attention" (layer_sliding_window).
``attention_bias`` puts a bias on all four attention projections, as transformers' SmolLM3 does.

The CPU direct forward (model/cpu_direct_forward.py) skips RoPE on the layers without it.
"""
from __future__ import annotations

from typing import Any

import torch

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    llama_rotary_embedding,
)


def rope_layers(config: Any) -> list[bool]:
    """Whether each layer applies RoPE: ``no_rope_layers`` (1: RoPE, 0: none), else transformers' default from
    ``no_rope_layer_interval`` (every interval-th layer has none)."""
    n = int(config.num_hidden_layers)
    flags = getattr(config, "no_rope_layers", None)
    if flags is None:
        interval = int(getattr(config, "no_rope_layer_interval", None) or 4)
        return [(i + 1) % interval != 0 for i in range(n)]
    flags = list(flags)
    if len(flags) != n or any(f not in (0, 1) for f in flags):
        raise ValueError(f"no_rope_layers must give {n} layers a 1 (RoPE) or 0 (no RoPE); got {flags}")
    return [bool(f) for f in flags]


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """Llama's loading (merged q/k/v and gate/up), embeddings (tied by default), head and windows; NoPE layers."""


    def build_model(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> LlamaModel:
        rope = rope_layers(config)
        rotary = llama_rotary_embedding(config)

        def layer(i: int) -> LlamaDecoderLayer:
            attention = LlamaAttention(config, tp, dtype, layer_index=i, rotary_emb=rotary, use_rope=rope[i])
            return LlamaDecoderLayer(config, tp, dtype, layer_index=i, self_attn=attention)

        return LlamaModel(config, tp, dtype, make_layer=layer)
