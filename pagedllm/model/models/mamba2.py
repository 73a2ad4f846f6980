"""Mamba-2 (``Mamba2ForCausalLM``: state-spaces/mamba2-*, Mamba-Codestral): every layer a pre-norm Mamba-2 mixer, no
attention and so no KV cache; each sequence's state lives in its state slot (model/layers/mamba_state.py).

Checkpoint names: ``backbone.embeddings`` (``backbone.embedding`` in mamba_ssm's own checkpoints),
``backbone.layers.N.norm`` and ``.mixer``, ``backbone.norm_f``, ``lm_head`` (absent when tied). With
``residual_in_fp32`` (the default) the residual stream is kept in float32, as transformers does.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.kernels.metadata import AttentionMetadata
from pagedllm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model.layers.mamba2 import Mamba2Dims, Mamba2Mixer, time_step_limit
from pagedllm.model.layers.mamba_state import MambaStateShape
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.models.weights import load_named_weights


def mamba2_dims(config: Any) -> Mamba2Dims:
    """The mixer geometry of a ``Mamba2Config``."""
    hidden = int(config.hidden_size)
    heads, head_dim = int(config.num_heads), int(config.head_dim)
    expand = getattr(config, "expand", None)
    if expand is not None and int(expand * hidden) != heads * head_dim:
        raise ValueError(f"Mamba-2 config: expand × hidden_size ({int(expand * hidden)}) must equal num_heads × "
                         f"head_dim ({heads * head_dim})")
    return Mamba2Dims(hidden_size=hidden, num_heads=heads, head_dim=head_dim, n_groups=int(config.n_groups),
                      d_state=int(config.state_size), d_conv=int(config.conv_kernel),
                      conv_bias=bool(getattr(config, "use_conv_bias", True)),
                      proj_bias=bool(getattr(config, "use_bias", False)),
                      eps=float(getattr(config, "layer_norm_epsilon", 1e-5)),
                      time_step_limit=time_step_limit(getattr(config, "time_step_limit", None)),
                      activation=getattr(config, "hidden_act", "silu"))


class Mamba2Block(nn.Module):
    def __init__(self, dims: Any, tp: TensorParallelGroup, dtype: torch.dtype, mixer_cls: type = Mamba2Mixer) -> None:
        super().__init__()
        self.norm = RMSNorm(dims.hidden_size, dims.eps, dtype)
        self.mixer = mixer_cls(dims, tp, dtype)


class Mamba2Backbone(nn.Module):
    """Embeddings, pre-norm mixer blocks (Mamba-2's, or `mixer_cls` of geometry `dims`), the final norm."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, dims: Any = None,
                 mixer_cls: type = Mamba2Mixer) -> None:
        super().__init__()
        dims = mamba2_dims(config) if dims is None else dims
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        self.layers = nn.ModuleList([Mamba2Block(dims, tp, dtype, mixer_cls)
                                     for _ in range(config.num_hidden_layers)])
        self.norm_f = RMSNorm(config.hidden_size, dims.eps, dtype)
        self.residual_in_fp32 = bool(getattr(config, "residual_in_fp32", True))
        self.dtype = dtype

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        caches = _layer_caches(meta, len(self.layers))
        for layer, cache in zip(self.layers, caches):
            residual = hidden.float() if self.residual_in_fp32 else hidden
            hidden = residual + layer.mixer(layer.norm(hidden.to(self.dtype)), cache, meta)
        # as transformers: the final norm reads the (float32) residual stream itself
        return self.norm_f.forward_native(hidden).to(self.dtype)


def _layer_caches(meta: AttentionMetadata, num_layers: int) -> list:
    state = getattr(meta, "mamba", None)
    if state is None or len(state.layer_caches) != num_layers:
        have = "none" if state is None else len(state.layer_caches)
        raise ValueError(f"the model has {num_layers} Mamba layers and needs one MambaLayerCache each in "
                         f"meta.mamba.layer_caches; got {have}")
    return state.layer_caches


class Mamba2ForCausalLM(nn.Module):
    """Pure Mamba-2: no attention layers (``sliding_windows`` is empty), one state slot per running sequence."""

    mixer_cls: type = Mamba2Mixer

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.backbone = Mamba2Backbone(config, tp, dtype, self.mixer_dims(config), self.mixer_cls)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    @classmethod
    def sliding_windows(cls, config: Any) -> list[int | None]:
        """One entry per attention layer: none here."""
        return []

    @classmethod
    def mixer_dims(cls, config: Any) -> Any:
        """Every layer's mixer geometry."""
        return mamba2_dims(config)

    @classmethod
    def mamba_state_shape(cls, config: Any) -> MambaStateShape:
        """Each state slot's per-layer conv and SSM state, for every layer."""
        return cls.mixer_dims(config).state_shape(int(config.num_hidden_layers))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embeddings(input_ids)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`kv_caches` is empty (no attention layers); the state comes from ``meta.mamba``."""
        hidden = self.backbone.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        return self.backbone(hidden, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = ("lm_head.weight",) if self.tie_word_embeddings else ()
        load_named_weights(self, _renamed(weights), {}, skip=skip)


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """mamba_ssm's checkpoints name the embedding ``backbone.embedding``."""
    for name, tensor in weights:
        if name == "backbone.embedding.weight":
            name = "backbone.embeddings.weight"
        yield name, tensor
