"""IBM Granite 4.0 hybrids (``GraniteMoeHybridForCausalLM``: granite-4.0-h-*): Granite MoE's layers (multipliers,
routed experts stored fused as ``input_linear`` / ``output_linear`` / ``router.layer``) plus a shared SwiGLU MLP in
every layer, with each layer's mixer a Mamba-2 mixer or attention as ``layer_types`` says. Dense variants
(``num_local_experts`` 0) run the shared MLP alone. ``position_embedding_type`` "rope" gives attention RoPE; anything
else ("nope", None: granite-4.0-h's default) none.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.layers.activation import silu_and_mul
from pagedllm.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.model.layers.mamba2 import Mamba2Mixer
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.layers.rotary import RotaryEmbedding
from pagedllm.model.models.granite import _multiplier
from pagedllm.model.models.hybrid import (
    HybridStateLayout,
    ATTENTION,
    MAMBA,
    HybridDecoderLayer,
    HybridModel,
    hybrid_layer_kinds,
    hybrid_mamba_dims,
)
from pagedllm.model.models.llama import LlamaAttention, llama_rotary_embedding
from pagedllm.model.models.moe import GraniteMoeForCausalLM, SparseMoeBlock


class GraniteSharedMLP(nn.Module):
    """``input_linear`` [2 × shared_intermediate, hidden] (gate rows, then up rows) → silu(gate)·up →
    ``output_linear``."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        inter = int(config.shared_intermediate_size)
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"GraniteMoeHybrid's shared MLP supports hidden_act='silu' only, got {act!r}")
        self.input_linear = ColumnParallelLinear(config.hidden_size, [2 * inter], False, tp, dtype)
        self.output_linear = RowParallelLinear(inter, config.hidden_size, False, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_linear(silu_and_mul(self.input_linear(x)))


class GraniteHybridDecoderLayer(HybridDecoderLayer):
    """`mlp`: the routed experts (None for a dense config); `shared_mlp` runs beside them on the same input."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, layer_index: int, kind: str,
                 rotary_emb: RotaryEmbedding | None, mlp: nn.Module | None) -> None:
        super().__init__(kind)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = mlp
        self.shared_mlp = GraniteSharedMLP(config, tp, dtype)
        self.residual_multiplier = _multiplier(config, "residual_multiplier")
        if kind == MAMBA:
            self.mamba = Mamba2Mixer(hybrid_mamba_dims(config), tp, dtype)
        else:
            self.self_attn = LlamaAttention(config, tp, dtype, layer_index=layer_index, rotary_emb=rotary_emb,
                                            scale=_multiplier(config, "attention_multiplier"),
                                            use_rope=rotary_emb is not None)

    def post_mixer_norm(self) -> RMSNorm:
        return self.post_attention_layernorm

    def feed_forward_block(self, hidden: torch.Tensor) -> torch.Tensor:
        shared = self.shared_mlp(hidden)
        return shared if self.mlp is None else self.mlp(hidden) + shared


class GraniteMoeHybridForCausalLM(HybridStateLayout, GraniteMoeForCausalLM):
    """Granite MoE's loading (per-expert split of the fused experts), embeddings, head and logit scaling."""

    def build_model(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> nn.Module:
        kinds = hybrid_layer_kinds(config)
        use_rope = getattr(config, "position_embedding_type", None) == "rope"
        rotary = llama_rotary_embedding(config) if use_rope and ATTENTION in kinds else None

        def make_layer(i: int, kind: str) -> nn.Module:
            return GraniteHybridDecoderLayer(config, tp, dtype, i, kind, rotary, self.make_mlp(config, i, tp, dtype))

        return HybridModel(config, tp, dtype, make_layer, final_norm_name="norm",
                           embedding_multiplier=_multiplier(config, "embedding_multiplier"))

    def make_mlp(self, config: Any, layer_index: int, tp: TensorParallelGroup, dtype: torch.dtype) -> nn.Module | None:
        experts = int(getattr(config, "num_local_experts", 0) or 0)
        if experts == 0:
            return None
        return SparseMoeBlock(config, experts, config.intermediate_size, True, tp, dtype)
