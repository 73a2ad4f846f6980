"""NVIDIA Nemotron-H (``NemotronHForCausalLM``: Nemotron-H 8B/47B/56B, NVIDIA-Nemotron-Nano-9B-v2): a stack of
pre-norm blocks, each one mixer as ``layers_block_type`` says (``hybrid_override_pattern`` "M" / "*" / "-" / "E"): a
Mamba-2 mixer, attention without positional encoding, a ReLU² MLP (``up_proj`` → relu(x)² → ``down_proj``), or (Nemotron 3:
NVIDIA-Nemotron-3-Nano-30B-A3B) a mixture of ReLU² experts beside a shared one, routed as DeepSeek-V3 routes (sigmoid
scores, a correction bias that only chooses, grouped top-k), optionally through a latent projection.

Checkpoint names: ``backbone.embeddings``, ``backbone.layers.N.norm`` and ``.mixer``, ``backbone.norm_f``,
``lm_head`` (never tied); an MoE block's ``mixer.gate`` (router), ``mixer.experts.E.{up,down}_proj``,
``mixer.shared_experts`` and ``mixer.fc{1,2}_latent_proj``. Its RMSNorms multiply by the weight in float32 before the one
rounding.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.kernels.metadata import AttentionMetadata
from pagedllm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model.layers.fused_moe import FusedMoE
from pagedllm.model.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagedllm.model.layers.mamba2 import Mamba2Dims, Mamba2Mixer, time_step_limit
from pagedllm.model.models.hybrid import ATTENTION, MAMBA, HybridStateLayout, kinds_from_names
from pagedllm.model.models.deepseek_v2 import DeepseekV2TopkRouter
from pagedllm.model.models.llama import LlamaAttention
from pagedllm.model.models.moe import ExpertWeightRouter
from pagedllm.model.models.weights import load_named_weights

MLP = "mlp"
MOE = "moe"
_KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "M": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION,
          "*": ATTENTION, "mlp": MLP, "-": MLP, "moe": MOE, "E": MOE}


def nemotron_layer_kinds(config: Any) -> list[str]:
    """Each block's mixer: "mamba", "attention", "mlp" or "moe", from ``layers_block_type`` (or the
    ``hybrid_override_pattern`` string of older configs)."""
    types = getattr(config, "layers_block_type", None) or getattr(config, "hybrid_override_pattern", None)
    if types is None:
        raise ValueError("a Nemotron-H config needs layers_block_type (or hybrid_override_pattern)")
    return kinds_from_names(types, int(config.num_hidden_layers), _KINDS, "Nemotron-H")


def check_nemotron_moe(config: Any) -> None:
    """Clear errors for MoE settings transformers' Nemotron-H (matched here) would not run as configured."""
    experts, top_k = int(config.n_routed_experts), int(config.num_experts_per_tok)
    groups, topk_group = int(getattr(config, "n_group", 1) or 1), int(getattr(config, "topk_group", 1) or 1)
    if experts % groups or not 1 <= topk_group <= groups or experts // groups < 2:
        raise ValueError(f"Nemotron-H grouped routing needs n_group dividing n_routed_experts ({experts}) into groups "
                         f"of at least 2 and 1 <= topk_group <= n_group; got n_group={groups}, topk_group={topk_group}")
    if not 1 <= top_k <= topk_group * (experts // groups):
        raise ValueError(f"num_experts_per_tok={top_k} must lie in [1, {topk_group * (experts // groups)}] (the "
                         f"experts of the topk_group={topk_group} groups a token may use)")


def nemotron_mamba_dims(config: Any) -> Mamba2Dims:
    """The Mamba-2 geometry of a ``NemotronHConfig`` (its projections' bias is ``use_bias``)."""
    return Mamba2Dims(hidden_size=int(config.hidden_size), num_heads=int(config.mamba_num_heads),
                      head_dim=int(config.mamba_head_dim), n_groups=int(config.n_groups),
                      d_state=int(config.ssm_state_size), d_conv=int(config.conv_kernel),
                      conv_bias=bool(getattr(config, "use_conv_bias", True)),
                      proj_bias=bool(getattr(config, "use_bias", False)),
                      eps=float(config.layer_norm_epsilon),
                      time_step_limit=time_step_limit(getattr(config, "time_step_limit", None)),
                      activation=getattr(config, "mamba_hidden_act", "silu"))


class NemotronHRMSNorm(nn.Module):
    """RMSNorm with the weight applied in float32 (then one rounding); with `residual`, adds it first and returns
    (normed, new residual)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (self.weight.float() * xf).to(x.dtype)
        return out if residual is None else (out, residual)


class NemotronHMLP(nn.Module):
    """up_proj → relu(x)² → down_proj (`intermediate_size`: the MoE block's shared expert's, else the config's)."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        act = getattr(config, "mlp_hidden_act", "relu2")
        if act != "relu2":
            raise ValueError(f"Nemotron-H's MLP supports mlp_hidden_act='relu2' only, got {act!r}")
        bias = bool(getattr(config, "mlp_bias", False))
        inter = int(intermediate_size or config.intermediate_size)
        self.up_proj = ColumnParallelLinear(config.hidden_size, [inter], bias, tp, dtype)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class NemotronHMoE(nn.Module):
    """Nemotron 3's MoE block: routed ReLU² experts (non-gated: up → relu² → down), weighted as DeepSeek-V3 weights
    them, plus a shared ReLU² expert on every token; with ``moe_latent_size`` the routed experts run in a smaller
    width between ``fc1_latent_proj`` and ``fc2_latent_proj`` (the router and the shared expert see the full width)."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        num_experts = int(config.n_routed_experts)
        self.gate = DeepseekV2TopkRouter(config, num_experts, sigmoid=True)
        latent = getattr(config, "moe_latent_size", None)
        bias = bool(getattr(config, "mlp_bias", False))
        width = int(latent or config.hidden_size)
        self.fc1_latent_proj = ReplicatedLinear(config.hidden_size, width, bias, dtype) if latent else None
        self.fc2_latent_proj = ReplicatedLinear(width, config.hidden_size, bias, dtype) if latent else None
        self.experts = FusedMoE(num_experts, self.gate.top_k, width, int(config.moe_intermediate_size),
                                self.gate.norm_topk_prob, tp, dtype, custom_routing_function=self.gate.select_experts,
                                activation="relu2")
        self.shared_experts = NemotronHMLP(config, tp, dtype, int(config.moe_shared_expert_intermediate_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        routed = self.experts(routed, self.gate(x))
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts(x)


class NemotronHBlock(nn.Module):
    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, layer_index: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm = NemotronHRMSNorm(config.hidden_size, config.layer_norm_epsilon, dtype)
        if kind == MAMBA:
            self.mixer = Mamba2Mixer(nemotron_mamba_dims(config), tp, dtype)
        elif kind == ATTENTION:
            if getattr(config, "attention_bias", False):
                raise ValueError("Nemotron-H attention has no biases (transformers ignores attention_bias); "
                                 "attention_bias=True is not supported")
            self.mixer = LlamaAttention(config, tp, dtype, layer_index=layer_index, use_rope=False)
        elif kind == MOE:
            check_nemotron_moe(config)
            self.mixer = NemotronHMoE(config, tp, dtype)
        else:
            self.mixer = NemotronHMLP(config, tp, dtype)


class NemotronHBackbone(nn.Module):
    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.kinds = nemotron_layer_kinds(config)
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        self.layers = nn.ModuleList([NemotronHBlock(config, tp, dtype, i, kind) for i, kind in enumerate(self.kinds)])
        self.norm_f = NemotronHRMSNorm(config.hidden_size, config.layer_norm_epsilon, dtype)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata) -> torch.Tensor:
        num_attention, num_mamba = self.kinds.count(ATTENTION), self.kinds.count(MAMBA)
        if len(kv_caches) != num_attention:
            raise ValueError(f"the model has {num_attention} attention layers and needs one KV cache each; got "
                             f"{len(kv_caches)}")
        state = getattr(meta, "mamba", None)
        if num_mamba and (state is None or len(state.layer_caches) != num_mamba):
            have = "none" if state is None else len(state.layer_caches)
            raise ValueError(f"the model has {num_mamba} Mamba layers and needs one MambaLayerCache each in "
                             f"meta.mamba.layer_caches; got {have}")
        residual = None
        attention_index = mamba_index = 0
        for layer in self.layers:
            if residual is None:
                residual = hidden
                hidden = layer.norm(hidden)
            else:
                hidden, residual = layer.norm(hidden, residual)
            if layer.kind == MAMBA:
                hidden = layer.mixer(hidden, state.layer_caches[mamba_index], meta)
                mamba_index += 1
            elif layer.kind == ATTENTION:
                hidden = layer.mixer(positions, hidden, kv_caches[attention_index], meta)
                attention_index += 1
            else:  # an MLP or MoE block
                hidden = layer.mixer(hidden)
        hidden, _ = self.norm_f(hidden, residual)
        return hidden


class NemotronHForCausalLM(HybridStateLayout, nn.Module):
    """Nemotron-H and Nemotron 3: Mamba-2, attention (no RoPE), ReLU² MLP and MoE blocks in the config's order."""

    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
    layer_kinds = staticmethod(nemotron_layer_kinds)
    mamba_dims = staticmethod(nemotron_mamba_dims)

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.backbone = NemotronHBackbone(config, tp, dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embeddings(input_ids)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.backbone.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        return self.backbone(hidden, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        experts = ExpertWeightRouter(self)
        load_named_weights(self, experts.dense_weights(_renamed(weights)), self.stacked_params)
        experts.check_complete()


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' in-memory prefix ``model.`` is the checkpoints' ``backbone.``."""
    for name, tensor in weights:
        yield ("backbone." + name[len("model."):] if name.startswith("model.") else name), tensor
