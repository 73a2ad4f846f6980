"""Shared pieces of the hybrid Mamba-2 / attention decoders (Bamba, GraniteMoeHybrid).

Each layer is Llama's pre-norm block whose mixer is either a Mamba-2 mixer (``mamba``) or attention (``self_attn``),
followed by the family's feed-forward block. Attention layer i reads ``kv_caches[i]`` (attention layers counted alone,
in layer order); Mamba layer j reads ``meta.mamba.layer_caches[j]``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.kernels.metadata import AttentionMetadata
from pagedllm.model.layers.embedding import VocabParallelEmbedding
from pagedllm.model.layers.mamba2 import Mamba2Dims, time_step_limit
from pagedllm.model.layers.mamba_state import MambaLayerCache, MambaStateShape
from pagedllm.model.layers.norm import RMSNorm

MAMBA = "mamba"
ATTENTION = "attention"
_KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION}


def hybrid_layer_kinds(config: Any) -> list[str]:
    """Each layer's mixer, "mamba" or "attention", from the config's ``layers_block_type`` / ``layer_types`` (new
    names "linear_attention" / "full_attention" or the legacy "mamba" / "attention") or Bamba's
    ``attn_layer_indices``."""
    num_layers = int(config.num_hidden_layers)
    types = getattr(config, "layers_block_type", None) or getattr(config, "layer_types", None)
    if types is None:
        attn = set(getattr(config, "attn_layer_indices", None) or [])
        return [ATTENTION if i in attn else MAMBA for i in range(num_layers)]
    return kinds_from_names(types, num_layers, _KINDS, "a hybrid Mamba-2 model")


def kinds_from_names(types: Any, num_layers: int, kinds: dict[str, str], family: str) -> list[str]:
    """Each layer's kind from a config's per-layer names (a list, or a pattern string of one letter per layer), checked
    against `kinds` (config name → kind) and the layer count."""
    types = list(types)
    if len(types) != num_layers:
        raise ValueError(f"the config lists {len(types)} layer types for {num_layers} layers")
    unknown = sorted({t for t in types if t not in kinds})
    if unknown:
        raise ValueError(f"unsupported layer types {unknown}; {family} allows {sorted(kinds)}")
    return [kinds[t] for t in types]


def hybrid_mamba_dims(config: Any) -> Mamba2Dims:
    """The Mamba-2 geometry of a hybrid config (``mamba_*`` fields, Bamba / GraniteMoeHybrid naming)."""
    hidden = int(config.hidden_size)
    heads = int(config.mamba_n_heads)
    expand = int(getattr(config, "mamba_expand", 2))
    head_dim = getattr(config, "mamba_d_head", None)
    head_dim = expand * hidden // heads if head_dim in (None, "auto") else int(head_dim)
    if heads * head_dim != expand * hidden:
        raise ValueError(f"mamba_n_heads × mamba_d_head ({heads * head_dim}) must equal mamba_expand × hidden_size "
                         f"({expand * hidden})")
    return Mamba2Dims(hidden_size=hidden, num_heads=heads, head_dim=head_dim, n_groups=int(config.mamba_n_groups),
                      d_state=int(config.mamba_d_state), d_conv=int(config.mamba_d_conv),
                      conv_bias=bool(getattr(config, "mamba_conv_bias", True)),
                      proj_bias=bool(getattr(config, "mamba_proj_bias", False)),
                      eps=float(config.rms_norm_eps),
                      time_step_limit=time_step_limit(getattr(config, "time_step_limit", None)),
                      activation=getattr(config, "hidden_act", "silu"))


class HybridStateLayout:
    """For a hybrid model class: its KV-cache layers (the attention ones) and its Mamba layers' state, from the config's
    layer kinds (`layer_kinds`) and Mamba geometry (`mamba_dims`); a family with its own config names overrides both."""

    layer_kinds = staticmethod(hybrid_layer_kinds)
    mamba_dims = staticmethod(hybrid_mamba_dims)

    @classmethod
    def sliding_windows(cls, config: Any) -> list[int | None]:
        """One entry (None: full attention) per attention layer; the other layers have none."""
        return [None] * cls.layer_kinds(config).count(ATTENTION)

    @classmethod
    def mamba_state_shape(cls, config: Any) -> MambaStateShape:
        """Each state slot's per-layer conv and SSM state, for every Mamba layer."""
        return cls.mamba_dims(config).state_shape(cls.layer_kinds(config).count(MAMBA))


class HybridDecoderLayer(nn.Module):
    """input_layernorm → mixer → × residual_multiplier → add → the post-mixer norm → feed-forward → ×
    residual_multiplier; returns (output, residual) as Llama's layers, the next norm fusing the add. Subclasses
    create ``input_layernorm`` and ``mamba`` (kind "mamba") or ``self_attn`` (kind "attention"), and name their
    post-mixer norm and feed-forward block through ``post_mixer_norm`` / ``feed_forward_block``."""

    residual_multiplier: float = 1.0

    def __init__(self, kind: str) -> None:
        super().__init__()
        if kind not in (MAMBA, ATTENTION):
            raise ValueError(f"a hybrid layer's mixer is {MAMBA!r} or {ATTENTION!r}, got {kind!r}")
        self.is_mamba = kind == MAMBA

    def post_mixer_norm(self) -> RMSNorm:
        raise NotImplementedError

    def feed_forward_block(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: Any, mamba_cache: MambaLayerCache | None, meta: AttentionMetadata):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.is_mamba:
            hidden = self.mamba(hidden, mamba_cache, meta)
        else:
            hidden = self.self_attn(positions, hidden, kv_cache, meta)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        hidden, residual = self.post_mixer_norm()(hidden, residual)
        hidden = self.feed_forward_block(hidden)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        return hidden, residual


class HybridModel(nn.Module):
    """``embed_tokens``, the layers ``make_layer(i, kind)`` builds, and the final norm (named
    ``final_norm_name``: Bamba's ``final_layernorm``, Granite's ``norm``). `kinds`: each layer's mixer, when the
    family reads it from its own config fields (default: hybrid_layer_kinds)."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, make_layer,
                 final_norm_name: str = "norm", embedding_multiplier: float = 1.0,
                 kinds: list[str] | None = None) -> None:
        super().__init__()
        self.kinds = hybrid_layer_kinds(config) if kinds is None else list(kinds)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        self.layers = nn.ModuleList([make_layer(i, kind) for i, kind in enumerate(self.kinds)])
        self.final_norm_name = final_norm_name
        setattr(self, final_norm_name, RMSNorm(config.hidden_size, config.rms_norm_eps, dtype))
        self.embedding_multiplier = embedding_multiplier

    def forward(self, input_ids, positions, kv_caches: list, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        num_attention = self.kinds.count(ATTENTION)
        num_mamba = len(self.kinds) - num_attention
        if len(kv_caches) != num_attention:
            raise ValueError(f"the model has {num_attention} attention layers and needs one KV cache each; got "
                             f"{len(kv_caches)} (self-speculation over the first layers is not supported here)")
        state = getattr(meta, "mamba", None)
        if num_mamba and (state is None or len(state.layer_caches) != num_mamba):
            have = "none" if state is None else len(state.layer_caches)
            raise ValueError(f"the model has {num_mamba} Mamba layers and needs one MambaLayerCache each in "
                             f"meta.mamba.layer_caches; got {have}")
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.embedding_multiplier != 1.0:
            hidden = hidden * self.embedding_multiplier
        residual = None
        attention_index = mamba_index = 0
        for layer in self.layers:
            if layer.is_mamba:
                hidden, residual = layer(positions, hidden, residual, None, state.layer_caches[mamba_index], meta)
                mamba_index += 1
            else:
                hidden, residual = layer(positions, hidden, residual, kv_caches[attention_index], None, meta)
                attention_index += 1
        hidden, _ = getattr(self, self.final_norm_name)(hidden, residual)
        return hidden
