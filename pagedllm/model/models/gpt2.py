"""GPT-2 (the paper's "GPT" family): learned positions, pre-LayerNorm blocks, GELU-tanh MLP,
biases everywhere, and an LM head tied to the token embedding.

HF stores GPT-2's projections as `Conv1D` weights of shape [in, out] (the transpose of
nn.Linear's) and q/k/v fused in one `c_attn`; both are undone at load time so the layers are
the same tensor-parallel linears every other family uses.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.kernels.metadata import AttentionMetadata
from pagedllm.model.layers.activation import get_act_fn
from pagedllm.model.layers.attention import Attention
from pagedllm.model.layers.embedding import LearnedPositionalEmbedding, ParallelLMHead, VocabParallelEmbedding
from pagedllm.model.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.model.layers.norm import LayerNorm
from pagedllm.model.models.weights import load_named_weights

KVCache = tuple[torch.Tensor, torch.Tensor]

_CONV1D = ("c_attn", "c_proj", "c_fc")  # modules whose checkpoint weight is [in, out]


class GPT2Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = config.hidden_size
        heads = config.num_attention_heads
        if hidden % heads:
            raise ValueError(f"n_embd ({hidden}) must be divisible by n_head ({heads})")
        head_dim = hidden // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads  # GPTBigCode's multi_query: 1
        self.c_attn = QKVParallelLinear(hidden, head_dim, heads, kv_heads, True, tp, dtype)
        self.c_proj = RowParallelLinear(hidden, hidden, True, tp, dtype, input_shard=self.c_attn.output_features)
        self.q_size = self.c_attn.num_heads * head_dim
        self.kv_size = self.c_attn.num_kv_heads * head_dim
        scale = head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        self.attn = Attention(self.c_attn.num_heads, head_dim, self.c_attn.num_kv_heads, scale=scale)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.c_proj(self.attn(q, k, v, kv_cache, meta))


class GPT2MLP(nn.Module):
    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = config.hidden_size
        inner = getattr(config, "n_inner", None) or 4 * hidden
        self.c_fc = ColumnParallelLinear(hidden, [inner], True, tp, dtype)
        self.c_proj = RowParallelLinear(inner, hidden, True, tp, dtype)
        self.act = get_act_fn(getattr(config, "activation_function", "gelu_new"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: Any, layer_idx: int, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        eps = float(getattr(config, "layer_norm_epsilon", 1e-5))
        self.ln_1 = LayerNorm(config.hidden_size, eps, dtype)
        self.attn = GPT2Attention(config, layer_idx, tp, dtype)
        self.ln_2 = LayerNorm(config.hidden_size, eps, dtype)
        self.mlp = GPT2MLP(config, tp, dtype)

    def forward(self, hidden: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden), kv_cache, meta)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(nn.Module):
    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        if getattr(config, "add_cross_attention", False):
            raise ValueError("GPT-2 with add_cross_attention=True (an encoder-decoder) is not supported")
        hidden = config.hidden_size
        self.wte = VocabParallelEmbedding(config.vocab_size, hidden, tp, dtype)
        self.wpe = LearnedPositionalEmbedding(config.max_position_embeddings, hidden, dtype)
        self.h = nn.ModuleList([GPT2Block(config, i, tp, dtype) for i in range(config.num_hidden_layers)])
        self.ln_f = LayerNorm(hidden, float(getattr(config, "layer_norm_epsilon", 1e-5)), dtype)

    def forward(self, input_ids, positions, kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.wte(input_ids) + self.wpe(positions)
        for block, kv_cache in zip(self.h, kv_caches):
            hidden = block(hidden, kv_cache, meta)
        return self.ln_f(hidden)


class GPT2LMHeadModel(nn.Module):
    """HF-compatible parameter names (`transformer.h.N.attn.c_attn`, ...)."""

    # Synthetic names produced by `_convert` when it splits c_attn → (our parameter, shard id).
    stacked_params = {"q_proj": ("c_attn", 0), "k_proj": ("c_attn", 1), "v_proj": ("c_attn", 2)}

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config, tp, dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        return self.transformer(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    @staticmethod
    def _convert(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """HF GPT-2 tensors → nn.Linear layout, c_attn split into q/k/v parts."""
        for name, tensor in weights:
            if not name.startswith(("transformer.", "lm_head.")):  # openai-community/gpt2 omits the prefix
                name = "transformer." + name
            parts = name.split(".")
            if parts[-2] == "attn" and parts[-1] in ("bias", "masked_bias"):
                continue  # causal-mask buffers saved by old checkpoints, not parameters
            if parts[-2] in _CONV1D and parts[-1] == "weight":
                tensor = tensor.t()
            if parts[-2] == "c_attn":
                for proj, part in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3, dim=0)):
                    yield ".".join(parts[:-2] + [proj, parts[-1]]), part
                continue
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = ("lm_head.weight",) if self.tie_word_embeddings else ()
        load_named_weights(self, self._convert(weights), self.stacked_params, skip=skip)
