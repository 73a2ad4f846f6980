"""StableLM (StableLM-3B-4E1T, StableLM 2 1.6B / 12B, Zephyr): LayerNorm blocks, RoPE on the first
`partial_rotary_factor` of each head, optional q/k/v biases (`use_qkv_bias`), sequential or parallel residual
blocks (`use_parallel_residual`: one LayerNorm feeds attention and MLP), optional per-head q/k LayerNorms
(`qk_layernorm`: StableLM 2 12B, one weight per head, no bias) and Llama's SwiGLU MLP.

Built of GPT-NeoX's shared LayerNorm decoder (models/gpt_neox.py); the per-head norms' checkpoint tensors
(`q_layernorm.norms.H.weight`) are stacked into one [heads, head_dim] weight at load time, of which each tensor
parallel rank keeps its own heads' rows.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.layers.rotary import RotaryEmbedding
from pagedllm.model.models.gpt_neox import (
    LayerNormCausalLM,
    LayerNormDecoderLayer,
    PartialRotaryAttention,
    attention_head_dim,
)
from pagedllm.model.models.llama import LlamaForCausalLM, LlamaMLP


class PerHeadLayerNorm(nn.Module):
    """A LayerNorm without bias per attention head, over head_dim, for this rank's heads
    [first_head, first_head + num_heads) of `total_heads` (transformers' StableLmLayerNormPerHead)."""

    def __init__(self, num_heads: int, first_head: int, total_heads: int, head_dim: int, eps: float,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.first_head, self.total_heads = num_heads, first_head, total_heads
        self.head_dim = head_dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_heads, head_dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        if tuple(loaded.shape) != (self.total_heads, self.head_dim):
            raise ValueError(f"per-head norm weights of shape {tuple(loaded.shape)}, the config implies "
                             f"({self.total_heads}, {self.head_dim})")
        param.data.copy_(loaded[self.first_head:self.first_head + self.num_heads])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T·heads, head_dim] rows, head-major within each token → the same shape, each row normalised with its
        head's weight."""
        y = F.layer_norm(x.view(-1, self.num_heads, self.head_dim), (self.head_dim,), None, None, self.eps)
        return (y * self.weight).view(x.shape)


class StableLmForCausalLM(LayerNormCausalLM):
    """HF StableLM checkpoints (Llama's names, LayerNorms with biases, `self_attn.q_layernorm.norms.H.weight`)."""

    renames = {"q_layernorm": "q_norm", "k_layernorm": "k_norm"}
    lora_modules = LlamaForCausalLM.lora_modules  # Llama's module names

    def make_layer(self, config: Any, layer_index: int, tp: TensorParallelGroup, dtype: torch.dtype,
                   rotary: RotaryEmbedding) -> LayerNormDecoderLayer:
        qk_norm = None
        if getattr(config, "qk_layernorm", False):
            head_dim, eps = attention_head_dim(config), float(config.layer_norm_eps)

            def qk_norm(num_heads: int, first_head: int, total_heads: int) -> PerHeadLayerNorm:
                return PerHeadLayerNorm(num_heads, first_head, total_heads, head_dim, eps, dtype)

        attn = PartialRotaryAttention(config, tp, dtype, rotary, qkv_bias=bool(getattr(config, "use_qkv_bias", False)),
                                      o_bias=False, qk_norm=qk_norm)
        parallel = bool(getattr(config, "use_parallel_residual", False))
        return LayerNormDecoderLayer(attn, LlamaMLP(config, tp, dtype), self.layer_norm(config, dtype),
                                     None if parallel else self.layer_norm(config, dtype), parallel)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Stacks each layer's per-head `q_norm.norms.H.weight` (and k's) into one `q_norm.weight` of all heads."""
        config = self.config
        totals = {"q_norm": config.num_attention_heads,
                  "k_norm": getattr(config, "num_key_value_heads", None) or config.num_attention_heads}
        pending: dict[str, dict[int, torch.Tensor]] = {}
        for name, tensor in super().checkpoint_tensors(weights):
            parts = name.split(".")
            if len(parts) >= 4 and parts[-4] in ("q_norm", "k_norm") and parts[-3] == "norms":
                if parts[-1] != "weight":
                    raise ValueError(f"checkpoint tensor {name!r}: StableLM's per-head norms have no bias")
                key = ".".join(parts[:-3])
                heads = pending.setdefault(key, {})
                heads[int(parts[-2])] = tensor
                total = totals[parts[-4]]
                if len(heads) == total:
                    del pending[key]
                    if sorted(heads) != list(range(total)):
                        raise ValueError(f"{key}: per-head norms {sorted(heads)}, expected heads 0..{total - 1}")
                    yield key + ".weight", torch.stack([heads[h] for h in range(total)])
                continue
            yield name, tensor
        if pending:
            key, heads = next(iter(pending.items()))
            raise ValueError(f"checkpoint holds {len(heads)} per-head norms of {key!r}, not one per head")
