"""Llama family (Llama 2/3, SmolLM2, Mistral-style; Qwen2 and Qwen3 as subclasses): GQA, RoPE, RMSNorm, SwiGLU."""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from pagedllm.distributed.parallel_state import PipelineParallelGroup, TensorParallelGroup
from pagedllm.kernels.metadata import AttentionMetadata
from pagedllm.model.layers.activation import silu_and_mul
from pagedllm.model.layers.attention import Attention
from pagedllm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.layers.rotary import RotaryEmbedding, partial_rotary_factor, rope_parameters
from pagedllm.model.models.registry import get_sliding_window
from pagedllm.model.models.weights import load_named_weights

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, bias: bool = False,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [inter, inter], bias, tp, dtype)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, tp, dtype)
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Llama MLP supports hidden_act='silu' only, got {act!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


def layer_sliding_window(config: Any, layer_index: int) -> int | None:
    """Layer `layer_index`'s attention window: the config's `sliding_window` on every layer (Mistral, Phi-3), or on
    the layers `layer_types` marks "sliding_attention" (Qwen2 past max_window_layers, Gemma 2/3); None: full."""
    window = get_sliding_window(config)
    layer_types = getattr(config, "layer_types", None)
    if window is None or not layer_types:
        return window
    return window if layer_types[layer_index] == "sliding_attention" else None


def llama_rotary_embedding(config: Any, partial_rotary: bool = False) -> RotaryEmbedding:
    """The model's RoPE tables (max_position × rotary_dim float32 cos and sin: 134 MB for Llama 3.1's 131k positions),
    built once and shared by every layer. rotary_dim is head_dim, or with `partial_rotary` (a family whose modeling
    honours it, Phi-3 / Phi-4-mini; transformers' Llama, Mistral and Qwen ignore it) int(head_dim ·
    partial_rotary_factor)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    max_pos = getattr(config, "max_position_embeddings", 8192)
    rotary_dim = head_dim
    if partial_rotary:
        factor = partial_rotary_factor(config)
        rotary_dim = int(head_dim * factor)  # as transformers: truncated
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor={factor} rotates {rotary_dim} of head_dim {head_dim} dims; RoPE "
                             f"needs an even number in (0, head_dim]")
    return RotaryEmbedding(head_dim, max_pos, rope_parameters(config), torch.float32, rotary_dim)


class RotaryAttention(nn.Module):
    """The forward shared by attention blocks built of `qkv_proj`, optional per-head `q_norm` / `k_norm`, `rotary_emb`,
    `attn` and `o_proj` (with `q_size`, `kv_size`, `head_dim`): Llama's family and Gemma's."""

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata):
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:  # per head: [T, H·D] → [T·H, D] rows (new contiguous tensors)
            t = q.shape[0]
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(t, -1)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(t, -1)
        # CUDA: rotated in place in the qkv buffer by one fused kernel; CPU: the torch ops via float32.
        if self.rotary_emb is not None:  # (None: a NoPE layer, SmolLM3's)
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class LlamaAttention(RotaryAttention):
    """`qkv_bias` (Qwen2): biased q/k/v whatever the config; the config's `attention_bias` biases q, k, v and o (as
    transformers' Llama, Qwen3, Granite, SmolLM3). `qk_norm` (Qwen3): an RMSNorm over each head's q and k (one weight
    of head_dim per kind), before RoPE. `layer_index` picks the layer's sliding window (layer_sliding_window).
    `scale`: the softmax scale (default head_dim**-0.5); `use_rope` False: a layer without RoPE (SmolLM3's NoPE)."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, qkv_bias: bool = False,
                 qk_norm: bool = False, layer_index: int = 0, rotary_emb: RotaryEmbedding | None = None,
                 scale: float | None = None, use_rope: bool = True) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or hidden // num_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, qkv_bias or attention_bias, tp,
                                          dtype)
        o_bias = attention_bias
        self.o_proj = RowParallelLinear(
            num_heads * head_dim, hidden, o_bias, tp, dtype, input_shard=self.qkv_proj.output_features
        )
        self.q_size = self.qkv_proj.num_heads * head_dim
        self.kv_size = self.qkv_proj.num_kv_heads * head_dim
        self.head_dim = head_dim
        if not use_rope:
            self.rotary_emb = None
        else:
            self.rotary_emb = rotary_emb if rotary_emb is not None else llama_rotary_embedding(config)
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, self.qkv_proj.num_kv_heads, scale=scale,
                              sliding_window=layer_sliding_window(config, layer_index))
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype) if qk_norm else None



class LlamaDecoderLayer(nn.Module):
    """`mlp`: the layer's feed-forward block (default: the dense SwiGLU MLP; MoE models pass their experts);
    `self_attn`: its attention (default: LlamaAttention of the other arguments)."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, qkv_bias: bool = False,
                 qk_norm: bool = False, mlp: nn.Module | None = None, layer_index: int = 0,
                 rotary_emb: RotaryEmbedding | None = None, self_attn: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = self_attn if self_attn is not None else LlamaAttention(config, tp, dtype, qkv_bias, qk_norm,
                                                                                layer_index, rotary_emb)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, tp, dtype, bias=bool(getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """`make_mlp(layer_index)`: each layer's feed-forward block, or None for the dense MLP. `make_layer(layer_index)`:
    each whole decoder layer instead (a family's own layers; then no RoPE table is built here). Every layer returns
    (output, residual), whose sum is its result. `embedding_multiplier` (Granite's) scales the input embeddings."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, qkv_bias: bool = False,
                 qk_norm: bool = False, make_mlp: Callable[[int], nn.Module | None] | None = None,
                 partial_rotary: bool = False, make_layer: Callable[[int], nn.Module] | None = None,
                 embedding_multiplier: float = 1.0) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        if make_layer is None:
            rotary = llama_rotary_embedding(config, partial_rotary)

            def make_layer(i: int) -> nn.Module:
                return LlamaDecoderLayer(config, tp, dtype, qkv_bias, qk_norm, make_mlp(i) if make_mlp else None, i,
                                         rotary)

        self.layers = nn.ModuleList([make_layer(i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.embedding_multiplier = embedding_multiplier
        self.hidden_size = int(config.hidden_size)
        self.dtype = dtype
        # This rank's pipeline stage (model/pipeline.py); None: every layer runs here.
        self.pipeline: PipelineParallelGroup | None = None

    def forward(self, input_ids, positions, kv_caches: list[KVCache], meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`inputs_embeds`: embeddings to run instead of `input_ids`' (a multimodal step's, image rows merged in;
        scaled by `embedding_multiplier` as token embeddings are, as transformers' Granite does). Runs one layer per
        cache in `kv_caches` (self-speculation passes the first layers' only)."""
        stage = self.pipeline
        if stage is not None and not stage.is_first:  # the previous stage's output
            shape = (int(positions.shape[-1]), self.hidden_size)
            hidden, residual = stage.recv_activations([shape, shape], self.dtype, positions.device)
            layers = self.layers[stage.start_layer:stage.end_layer]
        else:
            hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            if self.embedding_multiplier != 1.0:
                hidden = hidden * self.embedding_multiplier
            residual = None
            layers = self.layers if stage is None else self.layers[:stage.end_layer]  # (the first stage: from 0)
        for layer, kv_cache in zip(layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        if stage is not None and not stage.is_last:
            stage.send_activations([hidden, residual])
            return hidden  # (not read: the last stage computes the logits)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """HF-compatible parameter names (merged qkv / gate_up are mapped at load time)."""

    # checkpoint suffix → (our parameter suffix, shard id)
    stacked_params = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    #: LoRA (lora/adapter.py): each PEFT target module (the checkpoint's name) → our layer it adapts. Which rows of a
    #: fused layer an adapter's B feeds comes from the weights' own mapping (`stacked_params`), so a delta lands
    #: where its base weight did.
    lora_modules = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
                    "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
    qkv_bias = False
    qk_norm = False  # Qwen3: per-head RMSNorms on q and k
    partial_rotary = False  # Phi-3: honour the config's partial_rotary_factor (llama_rotary_embedding)
    loads_fp8_checkpoints = True  # [out, in] linears: model/fp8_checkpoint.py's per-row scales fit them

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.model = self.build_model(config, tp, dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def sliding_windows(cls, config: Any) -> list[int | None]:
        """Each layer's attention window (None: the whole context), from the config alone."""
        return [layer_sliding_window(config, i) for i in range(int(config.num_hidden_layers))]

    def build_model(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> LlamaModel:
        """The decoder (families with their own layers override this)."""
        return LlamaModel(config, tp, dtype, self.qkv_bias, self.qk_norm,
                          lambda i: self.make_mlp(config, i, tp, dtype), self.partial_rotary)

    def make_mlp(self, config: Any, layer_index: int, tp: TensorParallelGroup, dtype: torch.dtype) -> nn.Module | None:
        """Layer `layer_index`'s feed-forward block; None: the dense SwiGLU MLP (MoE models override this)."""
        return None

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings of `input_ids` (a step with prompt-embedding rows merges those in)."""
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`inputs_embeds`: embeddings to run instead of `input_ids`' (a step with prompt-embedding rows)."""
        return self.model(input_ids, positions, kv_caches, meta, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
        if self.tie_word_embeddings:
            skip = skip + ("lm_head.weight",)
        load_named_weights(self, weights, self.stacked_params, skip=skip)
