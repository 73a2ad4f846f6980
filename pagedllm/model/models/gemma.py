"""Gemma family: Gemma, Gemma 2 and Gemma 3 (text).

Gemma is Llama-shaped with its own details: RMSNorms scale by (1 + w) in float32, the embeddings are multiplied by
sqrt(hidden_size) (rounded to the model dtype, as transformers does), the MLP is GeGLU, head_dim is explicit and
the LM head shares the embeddings. Gemma 2 adds a norm after the attention and around the MLP (four per layer),
scores scaled by query_pre_attn_scalar**-0.5, soft caps on the attention scores and the final logits, and local
(sliding-window) layers between global ones (`layer_types`). Gemma 3 drops the attention soft cap, adds per-head
q/k RMSNorms, and gives local and global layers their own RoPE (`rope_parameters` per layer type).

Checkpoint names are transformers' (``model.layers.N.self_attn.q_proj.weight`` …); q/k/v and gate/up are merged at
load time as for Llama.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.kernels.metadata import AttentionMetadata
from pagedllm.model.layers.activation import gelu_and_mul
from pagedllm.model.layers.attention import Attention
from pagedllm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.model.layers.norm import GemmaRMSNorm
from pagedllm.model.layers.rotary import RotaryEmbedding, rope_parameters
from pagedllm.model.models.llama import LlamaForCausalLM, RotaryAttention
from pagedllm.model.models.weights import load_named_weights

KVCache = tuple[torch.Tensor, torch.Tensor]

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' activation names → F.gelu's `approximate`
_GELU = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh", "gelu": "none"}


def _head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _gelu_approximation(name: str | None) -> str:
    if name not in _GELU:
        raise ValueError(f"Gemma's MLP supports the activations {sorted(_GELU)}, got {name!r}")
    return _GELU[name]


class GemmaMLP(nn.Module):
    """GeGLU: down(gelu(gate(x)) · up(x)), gate and up as one merged column-parallel GEMM. `gated_activation` names
    the gate for the CPU direct forward (model/cpu_direct_forward.py; a Llama MLP's, without one, is SiLU)."""

    def __init__(self, config: Any, activation: str | None, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [inter, inter], False, tp, dtype)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, False, tp, dtype)
        self.approximate = _gelu_approximation(activation)
        self.gated_activation = "gelu_tanh" if self.approximate == "tanh" else "gelu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_and_mul(self.gate_up_proj(x), self.approximate))


class GemmaAttention(RotaryAttention):
    """GQA with RoPE (`rotary_emb`, shared by the layers of one attention type), this layer's window and soft cap,
    and (Gemma 3) per-head (1 + w) RMSNorms on q and k before RoPE."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, rotary_emb: RotaryEmbedding,
                 scale: float, sliding_window: int | None, logits_soft_cap: float | None, qk_norm: bool) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = _head_dim(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, num_heads, num_kv_heads, bias, tp, dtype)
        self.o_proj = RowParallelLinear(num_heads * head_dim, config.hidden_size, bias, tp, dtype,
                                        input_shard=self.qkv_proj.output_features)
        self.q_size = self.qkv_proj.num_heads * head_dim
        self.kv_size = self.qkv_proj.num_kv_heads * head_dim
        self.head_dim = head_dim
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, self.qkv_proj.num_kv_heads, scale=scale,
                              sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps, dtype) if qk_norm else None


class GemmaDecoderLayer(nn.Module):
    """Gemma: pre-norms before attention and MLP. `sandwich` (Gemma 2/3): norms after the attention and around the
    MLP too; the residual is added after the post-norms (the fused add of the next pre-norm). `norm`: the norms'
    class (GLM-4's sandwich layers use RMSNorm's w rather than Gemma's 1 + w)."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, attention: nn.Module,
                 mlp: nn.Module, sandwich: bool, norm: type[nn.Module] = GemmaRMSNorm) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = norm(hidden, eps, dtype)
        self.post_attention_layernorm = norm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = norm(hidden, eps, dtype) if sandwich else None
        self.post_feedforward_layernorm = norm(hidden, eps, dtype) if sandwich else None

    def forward(self, positions, hidden, residual, kv_cache, meta):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        if self.pre_feedforward_layernorm is None:  # Gemma: the Llama order
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden), residual
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


def layer_types(config: Any, default_period: int) -> list[str]:
    """Each layer's attention type: the config's `layer_types`, else every `sliding_window_pattern`-th layer (default
    `default_period`; 1: all global) is global and the others local, as transformers fills it in."""
    n = int(config.num_hidden_layers)
    types = list(getattr(config, "layer_types", None) or [])
    if not types:
        period = int(getattr(config, "sliding_window_pattern", None) or default_period)
        types = [SLIDING if (i + 1) % period else FULL for i in range(n)]
    if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise ValueError(f"layer_types must name {n} layers, each {SLIDING!r} or {FULL!r}; got {types}")
    return types


class GemmaModel(nn.Module):
    """`variant`: the model class, whose attributes and hooks say what differs between Gemma 1, 2 and 3."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype,
                 variant: type[GemmaForCausalLM]) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, tp, dtype)
        # transformers multiplies by sqrt(hidden) rounded to the model dtype (55.4256 → 55.5 in bfloat16).
        self.normalizer = float(torch.tensor(hidden**0.5, dtype=torch.float32, device="cpu").to(dtype))
        windows = variant.sliding_windows(config)
        types = [SLIDING if w is not None else FULL for w in windows]
        max_pos = getattr(config, "max_position_embeddings", 8192)
        # One rotary table per attention type (each is max_position × head_dim floats), shared by its layers.
        rotary = {kind: RotaryEmbedding(_head_dim(config), max_pos, variant.rope_parameters(config, kind),
                                        torch.float32) for kind in dict.fromkeys(types)}
        scale = variant.attention_scale(config)
        soft_cap = variant.attention_soft_cap(config)
        activation = variant.activation(config)
        self.layers = nn.ModuleList([
            GemmaDecoderLayer(
                config, tp, dtype,
                GemmaAttention(config, tp, dtype, rotary[kind], scale, window, soft_cap, variant.qk_norm),
                GemmaMLP(config, activation, tp, dtype), variant.sandwich_norms)
            for kind, window in zip(types, windows)
        ])
        self.norm = GemmaRMSNorm(hidden, config.rms_norm_eps, dtype)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The scaled token embeddings (transformers' Gemma*TextScaledWordEmbedding: what `inputs_embeds` means)."""
        return self.embed_tokens(input_ids) * self.normalizer

    def forward(self, input_ids, positions, kv_caches: list[KVCache], meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`inputs_embeds`: scaled embeddings to run instead of `input_ids`' (a step with prompt-embedding rows)."""
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class GemmaForCausalLM(nn.Module):
    """Gemma (1). Subclasses set the Gemma 2 / 3 differences as class attributes and the hooks below."""

    stacked_params = LlamaForCausalLM.stacked_params
    lora_modules = LlamaForCausalLM.lora_modules  # Llama's module names
    loads_fp8_checkpoints = True  # [out, in] linears, as Llama's
    qk_norm = False
    sandwich_norms = False  # Gemma 2/3: post-attention and pre/post-feed-forward norms
    sliding_period = 0  # > 0: local/global layers (the fallback period when the config has no layer_types)

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True (an embedding model's bidirectional attention) is not "
                             "supported; Gemma models generate with causal attention only")
        self.config = config
        self.model = GemmaModel(config, tp, dtype, type(self))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype)
        # Gemma checkpoints tie the head to the embeddings; honour an untied one if a config says so.
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_soft_cap = self.final_soft_cap(config)

    # -- per-variant settings ------------------------------------------------------------------
    @classmethod
    def sliding_windows(cls, config: Any) -> list[int | None]:
        """Each layer's attention window (None: global), from the config alone; GemmaModel builds its layers from it."""
        n = int(config.num_hidden_layers)
        types = layer_types(config, cls.sliding_period) if cls.sliding_period else [FULL] * n
        window = getattr(config, "sliding_window", None)
        if SLIDING in types and not window:
            raise ValueError("layer_types has sliding_attention layers but the config has no sliding_window")
        return [int(window) if kind == SLIDING else None for kind in types]

    @staticmethod
    def activation(config: Any) -> str | None:
        """`hidden_activation` where the config sets it, else `hidden_act` (transformers' GemmaConfig turns the legacy
        "gelu" of Gemma 1's Hub configs into "gelu_pytorch_tanh", the approximation the model was trained with)."""
        return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)

    @staticmethod
    def attention_scale(config: Any) -> float:
        return _head_dim(config) ** -0.5

    @staticmethod
    def attention_soft_cap(config: Any) -> float | None:
        return None

    @staticmethod
    def final_soft_cap(config: Any) -> float | None:
        return None

    @staticmethod
    def rope_parameters(config: Any, layer_type: str) -> dict:
        return rope_parameters(config)

    # -- the engine's interface ----------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings of `input_ids`, scaled as the model runs them (a step with prompt-embedding rows
        merges those in)."""
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        cap = self.final_logit_soft_cap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = ("rotary_emb.inv_freq",)
        if self.tie_word_embeddings:
            skip = skip + ("lm_head.weight",)
        load_named_weights(self, weights, self.stacked_params, skip=skip)


def _positive_or_none(value: Any) -> float | None:
    return float(value) if value else None


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2: four norms per layer, query_pre_attn_scalar, attention and final-logit soft caps, local layers
    alternating with global ones."""

    sandwich_norms = True
    sliding_period = 2

    @staticmethod
    def attention_scale(config: Any) -> float:
        return float(getattr(config, "query_pre_attn_scalar", None) or _head_dim(config)) ** -0.5

    @staticmethod
    def attention_soft_cap(config: Any) -> float | None:
        return _positive_or_none(getattr(config, "attn_logit_softcapping", None))

    @staticmethod
    def final_soft_cap(config: Any) -> float | None:
        return _positive_or_none(getattr(config, "final_logit_softcapping", None))


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text): Gemma 2's layout with per-head q/k norms, no attention soft cap (transformers ignores
    attn_logit_softcapping for Gemma 3), five local layers per global one by default, and RoPE per layer type:
    the local base (rope_local_base_freq, 10 000) on local layers, the global one (possibly scaled) on global ones."""

    qk_norm = True
    sliding_period = 6

    @staticmethod
    def attention_soft_cap(config: Any) -> float | None:
        return None

    @staticmethod
    def rope_parameters(config: Any, layer_type: str) -> dict:
        params = rope_parameters(config, layer_type)
        nested = getattr(config, "rope_parameters", None) or {}
        if layer_type == SLIDING and SLIDING not in nested:  # a config of the old style: one dict, a local base
            params = {"rope_type": "default",
                      "rope_theta": float(getattr(config, "rope_local_base_freq", None) or 10000.0)}
        return params
