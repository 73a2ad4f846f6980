"""AI21 Jamba (``JambaForCausalLM``: ai21labs/Jamba-v0.1, AI21-Jamba-*-1.5/1.6): Mamba-1 layers (with Jamba's
``dt_layernorm`` / ``b_layernorm`` / ``c_layernorm``) and, where ``i % attn_layer_period == attn_layer_offset``,
attention layers without positional embedding; every layer's feed-forward (``pre_ff_layernorm`` before it) is a
sparse MoE where ``i % expert_layer_period == expert_layer_offset`` (``layers_num_experts[i] > 1``), else a SwiGLU
MLP.

The router (``feed_forward.router``, no bias) takes the top ``num_experts_per_tok`` of a float32 softmax over all
experts, the selected probabilities left unnormalised (transformers' JambaTopKRouter). Checkpoints store each expert
apart (``experts.{e}.{gate,up,down}_proj.weight``) or fused (``experts.gate_up_proj`` [E, 2 × inter, hidden], gate
rows then up, and ``experts.down_proj`` [E, hidden, inter]); both are stacked into the layer's FusedMoE.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.layers.fused_moe import FusedMoE
from pagedllm.model.layers.linear import ReplicatedLinear
from pagedllm.model.layers.mamba1 import Mamba1Dims, Mamba1Mixer
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.models.hybrid import (
    ATTENTION,
    MAMBA,
    HybridDecoderLayer,
    HybridModel,
    HybridStateLayout,
    kinds_from_names,
)
from pagedllm.model.models.llama import LlamaAttention, LlamaMLP
from pagedllm.model.models.moe import _MoeForCausalLM

_JAMBA_KINDS = {"mamba": MAMBA, "attention": ATTENTION}


def _period(config: Any, prefix: str) -> tuple[int, int]:
    period, offset = int(getattr(config, f"{prefix}_period")), int(getattr(config, f"{prefix}_offset"))
    if period < 1 or not 0 <= offset < period:
        raise ValueError(f"Jamba needs 0 <= {prefix}_offset < {prefix}_period, got offset {offset}, period {period}")
    return period, offset


def jamba_layer_kinds(config: Any) -> list[str]:
    """Each layer's mixer: the config's ``layers_block_type``, else attention where
    ``i % attn_layer_period == attn_layer_offset`` and Mamba elsewhere."""
    num_layers = int(config.num_hidden_layers)
    types = getattr(config, "layers_block_type", None)
    if types is None:
        period, offset = _period(config, "attn_layer")
        types = ["attention" if i % period == offset else "mamba" for i in range(num_layers)]
    return kinds_from_names(types, num_layers, _JAMBA_KINDS, "Jamba")


def jamba_layer_experts(config: Any) -> list[int]:
    """Each layer's expert count (1: a dense MLP): ``layers_num_experts``, else ``num_experts`` where
    ``i % expert_layer_period == expert_layer_offset``."""
    num_layers = int(config.num_hidden_layers)
    experts = getattr(config, "layers_num_experts", None)
    if experts is None:
        period, offset = _period(config, "expert_layer")
        n = int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 1) or 1)
        experts = [n if i % period == offset else 1 for i in range(num_layers)]
    experts = [int(e) for e in experts]
    if len(experts) != num_layers:
        raise ValueError(f"the config lists {len(experts)} expert counts for {num_layers} layers")
    return experts


def jamba_mamba_dims(config: Any) -> Mamba1Dims:
    """The Mamba-1 geometry of a ``JambaConfig`` (``mamba_*`` fields; inner norms with the model's rms_norm_eps)."""
    hidden = int(config.hidden_size)
    rank = getattr(config, "mamba_dt_rank", "auto")
    rank = math.ceil(hidden / 16) if rank == "auto" else int(rank)
    eps = float(config.rms_norm_eps)
    return Mamba1Dims(hidden_size=hidden, intermediate=int(config.mamba_expand) * hidden,
                      d_state=int(config.mamba_d_state), d_conv=int(config.mamba_d_conv), dt_rank=rank,
                      conv_bias=bool(getattr(config, "mamba_conv_bias", True)),
                      proj_bias=bool(getattr(config, "mamba_proj_bias", False)), eps=eps, inner_norm="weighted",
                      inner_eps=eps, activation=getattr(config, "hidden_act", "silu"))


class JambaSparseMoeBlock(nn.Module):
    """``router`` (no bias) → top-k of the softmax, unnormalised → the routed SwiGLU ``experts``."""

    def __init__(self, config: Any, num_experts: int, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        top_k = int(config.num_experts_per_tok)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"Jamba's num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Jamba's experts support hidden_act='silu' only, got {act!r}")
        self.router = ReplicatedLinear(hidden, num_experts, False, dtype)
        self.router.keep_unquantized = True
        self.experts = FusedMoE(num_experts, top_k, hidden, int(config.intermediate_size), False, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class JambaDecoderLayer(HybridDecoderLayer):
    """input_layernorm → Mamba-1 mixer or NoPE attention → add → pre_ff_layernorm → ``feed_forward``."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, layer_index: int, kind: str,
                 num_experts: int) -> None:
        super().__init__(kind)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if num_experts > 1:
            self.feed_forward = JambaSparseMoeBlock(config, num_experts, tp, dtype)
        else:
            self.feed_forward = LlamaMLP(config, tp, dtype)
        if kind == MAMBA:
            self.mamba = Mamba1Mixer(jamba_mamba_dims(config), tp, dtype)
        else:
            self.self_attn = LlamaAttention(config, tp, dtype, layer_index=layer_index, use_rope=False)

    def post_mixer_norm(self) -> RMSNorm:
        return self.pre_ff_layernorm

    def feed_forward_block(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(hidden)


class JambaForCausalLM(HybridStateLayout, _MoeForCausalLM):
    """Jamba: Llama's embeddings, head (tied or not) and loading (merged q/k/v and gate/up; experts stacked by
    ExpertWeightRouter); hybrid Mamba-1 / attention layers."""

    layer_kinds = staticmethod(jamba_layer_kinds)
    mamba_dims = staticmethod(jamba_mamba_dims)

    def build_model(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> nn.Module:
        kinds = jamba_layer_kinds(config)
        experts = jamba_layer_experts(config)
        return HybridModel(config, tp, dtype, lambda i, kind: JambaDecoderLayer(config, tp, dtype, i, kind,
                                                                                experts[i]),
                           final_norm_name="final_layernorm", kinds=kinds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._per_expert(weights))

    def _per_expert(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Fused expert tensors (``experts.gate_up_proj`` / ``experts.down_proj``, no ``.weight``) split per expert;
        every other tensor as it is."""
        inter, hidden = int(self.config.intermediate_size), int(self.config.hidden_size)
        for name, tensor in weights:
            prefix, sep, rest = name.rpartition(".experts.")
            if not sep or rest not in ("gate_up_proj", "down_proj"):
                yield name, tensor
                continue
            want = (2 * inter, hidden) if rest == "gate_up_proj" else (hidden, inter)
            if tensor.dim() != 3 or tuple(tensor.shape[1:]) != want:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; the config implies "
                                 f"[experts, {want[0]}, {want[1]}]")
            for e in range(tensor.shape[0]):
                if rest == "gate_up_proj":
                    yield f"{prefix}.experts.{e}.gate_proj.weight", tensor[e, :inter]
                    yield f"{prefix}.experts.{e}.up_proj.weight", tensor[e, inter:]
                else:
                    yield f"{prefix}.experts.{e}.down_proj.weight", tensor[e]
