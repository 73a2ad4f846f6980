"""IBM Granite (3.x dense, ``GraniteForCausalLM``): the Llama architecture with four scalar multipliers from the config.

- ``embedding_multiplier``: the input embeddings (token or prompt embeddings alike) are multiplied by it;
- ``residual_multiplier``: each attention and MLP output is multiplied by it before it joins the residual stream;
- ``attention_multiplier``: the attention softmax scale, instead of head_dim**-0.5;
- ``logits_scaling``: the logits are divided by it.

``attention_bias`` puts a bias on all four attention projections (q, k, v and o), as transformers' Granite does.
The CPU direct forward (model/cpu_direct_forward.py) runs it with the embedding and residual multipliers (the
attention's scale is read from each layer; the logits' division is compute_logits').
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.kernels.metadata import AttentionMetadata
from pagedllm.model.layers.rotary import RotaryEmbedding
from pagedllm.model.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    llama_rotary_embedding,
)

KVCache = tuple[torch.Tensor, torch.Tensor]


def _multiplier(config: Any, name: str, nonzero: bool = False) -> float:
    """The config's `name` (default 1) as a finite float (`nonzero`: a divisor); anything else is a clear error."""
    value = getattr(config, name, None)
    value = 1.0 if value is None else float(value)
    if not math.isfinite(value) or (nonzero and value == 0):
        raise ValueError(f"Granite's {name} must be a finite{' non-zero' if nonzero else ''} number, got {value!r}")
    return value


class GraniteDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer; the attention and MLP outputs are scaled by ``residual_multiplier`` before the add
    (which the next norm fuses, as Llama's: the layer returns (scaled MLP output, residual))."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, layer_index: int,
                 rotary_emb: RotaryEmbedding, mlp: nn.Module | None = None) -> None:
        attention = LlamaAttention(config, tp, dtype, layer_index=layer_index, rotary_emb=rotary_emb,
                                   scale=_multiplier(config, "attention_multiplier"))
        super().__init__(config, tp, dtype, mlp=mlp, layer_index=layer_index, self_attn=attention)
        self.residual_multiplier = _multiplier(config, "residual_multiplier")

    def forward(self, positions, hidden, residual, kv_cache: KVCache, meta: AttentionMetadata):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) * self.residual_multiplier, residual


class GraniteForCausalLM(LlamaForCausalLM):
    """Llama's loading (merged q/k/v and gate/up), embeddings and head; Granite's layers and logit scaling."""


    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__(config, tp, dtype)
        self.logits_scaling = _multiplier(config, "logits_scaling", nonzero=True)

    def build_model(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> LlamaModel:
        rotary = llama_rotary_embedding(config)
        return LlamaModel(config, tp, dtype,
                          make_layer=lambda i: GraniteDecoderLayer(config, tp, dtype, i, rotary,
                                                                   self.make_mlp(config, i, tp, dtype)),
                          embedding_multiplier=_multiplier(config, "embedding_multiplier"))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden) / self.logits_scaling
