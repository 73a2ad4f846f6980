"""OPT (Zhang et al. 2022), one of the paper's evaluated families: learned positions (offset 2),
LayerNorm before or after each block (`do_layer_norm_before`), ReLU MLP, biases everywhere, and
`project_in`/`project_out` when `word_embed_proj_dim` differs from `hidden_size` (OPT-350m)."""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.kernels.metadata import AttentionMetadata
from pagedllm.model.layers.activation import get_act_fn
from pagedllm.model.layers.attention import Attention
from pagedllm.model.layers.embedding import LearnedPositionalEmbedding, ParallelLMHead, VocabParallelEmbedding
from pagedllm.model.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pagedllm.model.layers.norm import LayerNorm
from pagedllm.model.models.weights import load_named_weights

KVCache = tuple[torch.Tensor, torch.Tensor]

# OPT reserves the first two rows of its position table (fairseq's padding offset).
POSITION_OFFSET = 2
_LN_EPS = 1e-5  # nn.LayerNorm's default, which HF OPT uses


def _layer_norm(config: Any, dtype: torch.dtype) -> LayerNorm:
    affine = bool(getattr(config, "layer_norm_elementwise_affine", True))
    return LayerNorm(config.hidden_size, _LN_EPS, dtype, elementwise_affine=affine)


class OPTAttention(nn.Module):
    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = config.hidden_size
        heads = config.num_attention_heads
        if hidden % heads:
            raise ValueError(f"hidden_size ({hidden}) must be divisible by num_attention_heads ({heads})")
        head_dim = hidden // heads
        bias = bool(getattr(config, "enable_bias", True))
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, heads, bias, tp, dtype)
        self.out_proj = RowParallelLinear(hidden, hidden, bias, tp, dtype, input_shard=self.qkv_proj.output_features)
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, self.qkv_proj.num_kv_heads)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        return self.out_proj(self.attn(q, k, v, kv_cache, meta))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        bias = bool(getattr(config, "enable_bias", True))
        self.do_layer_norm_before = bool(config.do_layer_norm_before)
        self.self_attn = OPTAttention(config, tp, dtype)
        self.self_attn_layer_norm = _layer_norm(config, dtype)
        self.fc1 = ColumnParallelLinear(config.hidden_size, [config.ffn_dim], bias, tp, dtype)
        self.fc2 = RowParallelLinear(config.ffn_dim, config.hidden_size, bias, tp, dtype)
        self.final_layer_norm = _layer_norm(config, dtype)
        self.act = get_act_fn(getattr(config, "activation_function", "relu"))

    def forward(self, hidden: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        residual = hidden
        if self.do_layer_norm_before:  # 125m, 1.3b, ..., 175b
            hidden = self.self_attn_layer_norm(hidden)
        hidden = residual + self.self_attn(hidden, kv_cache, meta)
        if not self.do_layer_norm_before:  # 350m
            hidden = self.self_attn_layer_norm(hidden)
        residual = hidden
        if self.do_layer_norm_before:
            hidden = self.final_layer_norm(hidden)
        hidden = residual + self.fc2(self.act(self.fc1(hidden)))
        if not self.do_layer_norm_before:
            hidden = self.final_layer_norm(hidden)
        return hidden


class OPTDecoder(nn.Module):
    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = config.hidden_size
        proj_dim = getattr(config, "word_embed_proj_dim", None) or hidden
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, proj_dim, tp, dtype)
        self.embed_positions = LearnedPositionalEmbedding(
            config.max_position_embeddings, hidden, dtype, offset=POSITION_OFFSET
        )
        self.project_in = self.project_out = None
        if proj_dim != hidden:
            self.project_in = ReplicatedLinear(proj_dim, hidden, False, dtype)
            self.project_out = ReplicatedLinear(hidden, proj_dim, False, dtype)
        self.final_layer_norm = None
        if config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False):
            self.final_layer_norm = _layer_norm(config, dtype)
        self.layers = nn.ModuleList([OPTDecoderLayer(config, tp, dtype) for _ in range(config.num_hidden_layers)])

    def forward(self, input_ids, positions, kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        if self.project_in is not None:
            embeds = self.project_in(embeds)
        hidden = embeds + self.embed_positions(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(hidden, kv_cache, meta)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden


class OPTModel(nn.Module):
    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config, tp, dtype)

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        return self.decoder(input_ids, positions, kv_caches, meta)


class OPTForCausalLM(nn.Module):
    """HF-compatible parameter names; q/k/v are merged into `qkv_proj` at load time."""

    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
    loads_fp8_checkpoints = True  # [out, in] linears: model/fp8_checkpoint.py's per-row scales fit them

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.model = OPTModel(config, tp, dtype)
        proj_dim = getattr(config, "word_embed_proj_dim", None) or config.hidden_size
        self.lm_head = ParallelLMHead(config.vocab_size, proj_dim, tp, dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.decoder.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("decoder."):  # facebook/opt-* checkpoints omit the "model." prefix
                    name = "model." + name
                yield name, tensor

        skip = ("lm_head.weight",) if self.tie_word_embeddings else ()
        load_named_weights(self, renamed(), self.stacked_params, skip=skip)
