"""IBM Bamba (``BambaForCausalLM``, ibm-ai-platform/Bamba-9B): Mamba-2 layers with full-attention layers at
``attn_layer_indices``, each followed by a SwiGLU MLP (``feed_forward``; ``pre_ff_layernorm`` before it).

Attention is Llama's with RoPE on half of each head (transformers hard-codes partial_rotary_factor 0.5 for Bamba).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.layers.mamba2 import Mamba2Mixer
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.layers.rotary import RotaryEmbedding
from pagedllm.model.models.hybrid import (
    HybridStateLayout,
    ATTENTION,
    MAMBA,
    HybridDecoderLayer,
    HybridModel,
    hybrid_layer_kinds,
    hybrid_mamba_dims,
)
from pagedllm.model.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    llama_rotary_embedding,
)


class BambaDecoderLayer(HybridDecoderLayer):
    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, layer_index: int, kind: str,
                 rotary_emb: RotaryEmbedding | None) -> None:
        super().__init__(kind)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.feed_forward = LlamaMLP(config, tp, dtype, bias=bool(getattr(config, "mlp_bias", False)))
        if kind == MAMBA:
            self.mamba = Mamba2Mixer(hybrid_mamba_dims(config), tp, dtype)
        else:
            self.self_attn = LlamaAttention(config, tp, dtype, layer_index=layer_index, rotary_emb=rotary_emb)

    def post_mixer_norm(self) -> RMSNorm:
        return self.pre_ff_layernorm

    def feed_forward_block(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(hidden)


class BambaForCausalLM(HybridStateLayout, LlamaForCausalLM):
    """Bamba: Llama's embeddings, head and weight loading (merged q/k/v and gate/up); hybrid layers."""

    loads_fp8_checkpoints = False

    def build_model(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> nn.Module:
        kinds = hybrid_layer_kinds(config)
        rotary = llama_rotary_embedding(config, partial_rotary=True) if ATTENTION in kinds else None
        return HybridModel(config, tp, dtype, lambda i, kind: BambaDecoderLayer(config, tp, dtype, i, kind, rotary),
                           final_norm_name="final_layernorm")
