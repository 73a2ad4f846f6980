"""Cohere's Command-R (``CohereForCausalLM``: c4ai-command-r-v01, Command-R+, Aya 23): one bias-free LayerNorm per
block feeding attention and a SwiGLU MLP in parallel (h + attn(ln(h)) + mlp(ln(h))), GQA whose RoPE rotates
interleaved pairs, optional per-head q/k LayerNorms (``use_qk_norm``: Command-R+), biases on q/k/v/o under
``attention_bias``, an LM head tied to the embeddings and logits multiplied by ``logit_scale``.

Built of GPT-NeoX's shared LayerNorm decoder (models/gpt_neox.py). The interleaved RoPE runs as the engine's
rotate-half RoPE: each head's q and k rows (and the q/k norms' weights) are reordered at load time
(models/interleaved_rope.py), which leaves every attention score as it was.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.layers.norm import LayerNorm
from pagedllm.model.layers.rotary import RotaryEmbedding
from pagedllm.model.models.gpt_neox import (
    LayerNormCausalLM,
    LayerNormDecoderLayer,
    PartialRotaryAttention,
    attention_head_dim,
)
from pagedllm.model.models.interleaved_rope import interleaved_rope_tensors
from pagedllm.model.models.llama import LlamaForCausalLM, LlamaMLP
from pagedllm.model.models.stablelm import PerHeadLayerNorm


class CohereForCausalLM(LayerNormCausalLM):
    """HF Cohere checkpoints: Llama's names (`model.layers.N.self_attn.q_proj`, `mlp.gate_proj`, `model.norm`)."""

    lora_modules = LlamaForCausalLM.lora_modules  # Llama's module names
    tie_default = True
    partial_rotary = False  # transformers' Cohere rotates whole heads

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__(config, tp, dtype)
        self.logit_scale = float(getattr(config, "logit_scale", 1.0))

    def layer_norm(self, config: Any, dtype: torch.dtype) -> LayerNorm:
        """Cohere's LayerNorms have a weight and no bias."""
        return LayerNorm(config.hidden_size, float(config.layer_norm_eps), dtype, bias=False)

    def make_layer(self, config: Any, layer_index: int, tp: TensorParallelGroup, dtype: torch.dtype,
                   rotary: RotaryEmbedding) -> LayerNormDecoderLayer:
        qk_norm = None
        if getattr(config, "use_qk_norm", False):
            head_dim, eps = attention_head_dim(config), float(config.layer_norm_eps)

            def qk_norm(num_heads: int, first_head: int, total_heads: int) -> PerHeadLayerNorm:
                return PerHeadLayerNorm(num_heads, first_head, total_heads, head_dim, eps, dtype)

        bias = bool(getattr(config, "attention_bias", False))
        attn = PartialRotaryAttention(config, tp, dtype, rotary, qkv_bias=bias, o_bias=bias, qk_norm=qk_norm)
        return LayerNormDecoderLayer(attn, LlamaMLP(config, tp, dtype), self.layer_norm(config, dtype), None,
                                     parallel_residual=True)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits times `logit_scale` (as transformers' Cohere)."""
        return self.lm_head.compute_logits(hidden) * self.logit_scale

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each head's q and k rows (and q/k norm weights) reordered for rotate-half RoPE."""
        head_dim = attention_head_dim(self.config)
        return interleaved_rope_tensors(super().checkpoint_tensors(weights), head_dim, head_dim)
