"""AI2's OLMo 2 (``Olmo2ForCausalLM``) and OLMo 3 (``Olmo3ForCausalLM``): the Llama architecture with

- post-norms instead of pre-norms: ``h = h + post_attention_layernorm(attn(h))``, then
  ``h = h + post_feedforward_layernorm(mlp(h))`` (no norm on a layer's input; the final norm stays);
- ``q_norm`` / ``k_norm``: RMSNorms over the whole q and k projections (every head at once, one weight of
  heads · head_dim each), before RoPE;
- (OLMo 3) sliding-window layers among full ones (``layer_types``, ``sliding_window``) and RoPE settings per layer
  type (``rope_parameters`` keyed by "sliding_attention" / "full_attention").

Tensor parallelism: each rank holds whole heads, so a q/k norm's mean square spans every rank; the ranks' sums of
squares are all-reduced (one reduction of q's and k's together per layer) before each rank normalises its own heads
with its slice of the weight. KV heads replicated across ranks (more ranks than KV heads) count once per replica
in both the sum and the element count, so the mean is exact.

Rounding: norms use the engine's RMSNorm (w · round(x̂), Llama's order; OLMo 2 rounds w · x̂ once), identical in float32
and one rounding apart in bfloat16, as vLLM. The CPU direct forward (model/cpu_direct_forward.py) runs these layers
too (its post-norm layout: no input norm, the attention's and the MLP's outputs normed before their residual adds).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup, shard_attention_heads
from pagedllm.kernels.metadata import AttentionMetadata
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.layers.rotary import RotaryEmbedding, rope_parameters
from pagedllm.model.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel

KVCache = tuple[torch.Tensor, torch.Tensor]

SLIDING, FULL = "sliding_attention", "full_attention"


def _head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def olmo_layer_types(config: Any) -> list[str]:
    """Each layer's attention type: the config's `layer_types` (OLMo 3), else all full (OLMo 2)."""
    n = int(config.num_hidden_layers)
    types = list(getattr(config, "layer_types", None) or [FULL] * n)
    if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise ValueError(f"layer_types must name {n} layers, each {SLIDING!r} or {FULL!r}; got {types}")
    if SLIDING in types and not getattr(config, "sliding_window", None):
        raise ValueError("layer_types has sliding_attention layers but the config has no sliding_window")
    return types


class ShardedProjectionRMSNorm(RMSNorm):
    """An RMSNorm over a whole projection of `full_size` features of which this rank holds [start, start + size)
    (whole heads). Unsharded, it is the engine's RMSNorm; sharded, `forward_sharded` takes the all-reduced sum
    of squares of each row, which covers `count` features (every rank's, replicas included)."""

    def __init__(self, full_size: int, start: int, size: int, count: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__(size, eps, dtype)
        self.full_size, self.start, self.count = full_size, start, count
        self.weight.weight_loader = self._load_shard

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        if loaded.shape != (self.full_size,):
            raise ValueError(f"q/k norm weight: the checkpoint's is {tuple(loaded.shape)}, the config implies "
                             f"({self.full_size},)")
        param.data.copy_(loaded[self.start:self.start + param.shape[0]])

    def forward_sharded(self, x: torch.Tensor, sum_sq: torch.Tensor) -> torch.Tensor:
        """x [T, size] normalised by sum_sq [T, 1] (float32, over `count` features), RMSNorm's roundings."""
        xf = x.float() * torch.rsqrt(sum_sq / self.count + self.eps)
        return self.weight * xf.to(x.dtype)


class Olmo2Attention(LlamaAttention):
    """Llama's GQA with RoPE (`rotary_emb`), biased q/k/v/o under ``attention_bias``, whole-projection q/k norms."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, layer_index: int,
                 rotary_emb: RotaryEmbedding) -> None:
        super().__init__(config, tp, dtype, layer_index=layer_index, rotary_emb=rotary_emb)
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = self.head_dim
        self.tp = tp
        heads = self.qkv_proj.heads
        kv_count = sum(shard_attention_heads(num_heads, num_kv_heads, tp.size, r).num_kv_heads
                       for r in range(tp.size)) * head_dim  # every rank's KV heads, replicas included
        eps = config.rms_norm_eps
        self.q_norm = ShardedProjectionRMSNorm(num_heads * head_dim, heads.q_start * head_dim, self.q_size,
                                               num_heads * head_dim, eps, dtype)
        self.k_norm = ShardedProjectionRMSNorm(num_kv_heads * head_dim, heads.kv_start * head_dim, self.kv_size,
                                               kv_count, eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.qk_norm(q, k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q_norm(q), k_norm(k) over the whole projections (every rank's heads: one all-reduce under TP)."""
        if self.tp.size == 1:
            return self.q_norm(q), self.k_norm(k)
        sums = torch.stack([q.float().pow(2).sum(-1), k.float().pow(2).sum(-1)], dim=-1)  # [T, 2]
        sums = self.tp.all_reduce(sums)
        return self.q_norm.forward_sharded(q, sums[:, 0:1]), self.k_norm.forward_sharded(k, sums[:, 1:2])


class Olmo2DecoderLayer(nn.Module):
    """Post-norm layer. As Llama's, it returns (output, residual) whose sum is the layer's output: the next layer (or
    the final norm) adds them."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, layer_index: int,
                 rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, tp, dtype, layer_index, rotary_emb)
        self.mlp = LlamaMLP(config, tp, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, positions, hidden, residual, kv_cache: KVCache, meta: AttentionMetadata):
        if residual is not None:
            hidden = hidden + residual
        residual = hidden + self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache, meta))
        return self.post_feedforward_layernorm(self.mlp(residual)), residual


class Olmo2ForCausalLM(LlamaForCausalLM):
    """Llama's loading (merged q/k/v and gate/up), embeddings, head and per-layer windows; OLMo 2's layers."""


    def build_model(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> LlamaModel:
        types = olmo_layer_types(config)
        # One RoPE table (max_position × head_dim floats) per distinct settings, shared by the layers using them.
        max_pos = getattr(config, "max_position_embeddings", 8192)
        tables: list[tuple[dict, RotaryEmbedding]] = []
        rotary: dict[str, RotaryEmbedding] = {}
        for kind in dict.fromkeys(types):
            params = rope_parameters(config, kind)
            table = next((t for p, t in tables if p == params), None)
            if table is None:
                table = RotaryEmbedding(_head_dim(config), max_pos, params, torch.float32)
                tables.append((params, table))
            rotary[kind] = table
        return LlamaModel(config, tp, dtype, make_layer=lambda i: Olmo2DecoderLayer(config, tp, dtype, i,
                                                                                    rotary[types[i]]))


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 3: OLMo 2's layers; its sliding-window layers and per-layer-type RoPE come from the config."""
