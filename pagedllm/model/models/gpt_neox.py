"""GPT-NeoX (EleutherAI's Pythia, GPT-NeoX-20B): LayerNorm with bias, RoPE on the first `rotary_pct` of each head,
a fused per-head interleaved `query_key_value`, parallel (`use_parallel_residual`) or sequential residual blocks, a
GELU MLP and an untied `embed_out` head.

It also holds the decoder that the LayerNorm + partial-RoPE families share (Phi, StableLM and StarCoder2 are built
of it: models/phi.py, stablelm.py, starcoder2.py). Every family runs under Llama's parameter layout
(`model.embed_tokens`, `model.layers.N.{input_layernorm, post_attention_layernorm, self_attn.{qkv_proj, o_proj,
q_norm, k_norm}, mlp}`, `model.norm`, `lm_head`); each family renames its checkpoint's names into it at load time
(whole dotted components only) and splits its fused tensors there, so tensor parallelism shards q, k and v as for
Llama.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.kernels.metadata import AttentionMetadata
from pagedllm.model.layers.activation import get_act_fn
from pagedllm.model.layers.attention import Attention
from pagedllm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedllm.model.layers.norm import LayerNorm
from pagedllm.model.layers.rotary import RotaryEmbedding
from pagedllm.model.models.llama import (
    RotaryAttention,
    layer_sliding_window,
    llama_rotary_embedding,
)
from pagedllm.model.models.weights import load_named_weights

KVCache = tuple[torch.Tensor, torch.Tensor]
#: (this rank's heads, the first of them, all heads of that kind: q or k) → a norm over each of those heads' rows.
QKNormFactory = Callable[[int, int, int], nn.Module]


def attention_head_dim(config: Any) -> int:
    """The per-head width: the config's `head_dim`, else hidden_size / num_attention_heads (which must divide)."""
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        return int(head_dim)
    hidden, heads = config.hidden_size, config.num_attention_heads
    if hidden % heads:
        raise ValueError(f"hidden_size ({hidden}) must be divisible by num_attention_heads ({heads})")
    return hidden // heads


class PartialRotaryAttention(RotaryAttention):
    """q/k/v through one `qkv_proj`, optional norms over each head's q and k (before RoPE), RoPE on the first
    `rotary_emb.rotary_dim` dims of each head, `o_proj` back to hidden (RotaryAttention.forward)."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, rotary_emb: RotaryEmbedding,
                 qkv_bias: bool, o_bias: bool, sliding_window: int | None = None,
                 qk_norm: QKNormFactory | None = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = attention_head_dim(config)
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, qkv_bias, tp, dtype)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, o_bias, tp, dtype,
                                        input_shard=self.qkv_proj.output_features)
        self.q_size = self.qkv_proj.num_heads * head_dim
        self.kv_size = self.qkv_proj.num_kv_heads * head_dim
        self.head_dim = head_dim
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, self.qkv_proj.num_kv_heads,
                              sliding_window=sliding_window)
        heads = self.qkv_proj.heads
        self.q_norm = qk_norm(heads.num_q_heads, heads.q_start, num_heads) if qk_norm is not None else None
        self.k_norm = qk_norm(heads.num_kv_heads, heads.kv_start, num_kv_heads) if qk_norm is not None else None


class GeluMLP(nn.Module):
    """fc2(act(fc1(x))): GPT-NeoX's dense_h_to_4h / dense_4h_to_h, Phi's fc1 / fc2, StarCoder2's c_fc / c_proj."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, bias: bool,
                 intermediate_size: int | None = None, act: str | None = None) -> None:
        """`intermediate_size` / `act`: for configs naming them otherwise (default: the config's intermediate_size
        and hidden_act)."""
        super().__init__()
        hidden, inter = config.hidden_size, intermediate_size or config.intermediate_size
        self.fc1 = ColumnParallelLinear(hidden, [inter], bias, tp, dtype)
        self.fc2 = RowParallelLinear(inter, hidden, bias, tp, dtype)
        self.act = get_act_fn(act or getattr(config, "hidden_act", "gelu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class LayerNormDecoderLayer(nn.Module):
    """A pre-LayerNorm block. Sequential: h += attn(ln1(h)); h += mlp(ln2(h)). Parallel (`parallel_residual`):
    h + attn(ln1(h)) + mlp(ln2(h)), or mlp(ln1(h)) where the block has no `post_attention_layernorm` (Phi,
    StableLM's parallel blocks)."""

    def __init__(self, self_attn: PartialRotaryAttention, mlp: nn.Module, input_layernorm: LayerNorm,
                 post_attention_layernorm: LayerNorm | None, parallel_residual: bool) -> None:
        super().__init__()
        if post_attention_layernorm is None and not parallel_residual:
            raise ValueError("a sequential-residual block needs its post_attention_layernorm")
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.parallel_residual = parallel_residual

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        attn = self.self_attn(positions, normed, kv_cache, meta)
        if self.parallel_residual:
            mlp_in = normed if self.post_attention_layernorm is None else self.post_attention_layernorm(hidden)
            return hidden + attn + self.mlp(mlp_in)
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LayerNormDecoderModel(nn.Module):
    """Token embeddings, the blocks, a final LayerNorm (no position table: RoPE is in the attention)."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, layers: list[nn.Module],
                 norm: LayerNorm) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def forward(self, input_ids, positions, kv_caches: list[KVCache], meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(positions, hidden, kv_cache, meta)
        return self.norm(hidden)


class LayerNormCausalLM(nn.Module):
    """The causal LM over LayerNormDecoderModel. Subclasses give `make_layer`, the config's LayerNorm epsilon key
    (`eps_key`) and their checkpoint names: `prefix_renames` (leading prefix → ours, first match), `renames` (whole
    name components → ours) and `checkpoint_tensors` for anything more (splitting fused tensors)."""

    stacked_params = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    prefix_renames: tuple[tuple[str, str], ...] = ()
    renames: dict[str, str] = {}
    #: LoRA (lora/adapter.py): each PEFT target module (the checkpoint's name) → our layer it adapts; the module's
    #: path and its B's rows go through the checkpoint mapping above (renames, `checkpoint_tensors`' splits,
    #: `stacked_params`), so a delta lands where its base weight did. Empty: the family serves no adapters.
    lora_modules: dict[str, str] = {}
    #: Checkpoint tensors that are not parameters (old checkpoints' RoPE buffers).
    skip_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
    eps_key = "layer_norm_eps"
    lm_head_bias = False
    tie_default = False
    partial_rotary = True  # honour partial_rotary_factor (StarCoder2's modeling does not)
    uses_sliding_window = False  # honour the config's sliding_window (StarCoder2)
    # The renamed and split checkpoint tensors do not carry FP8 scales through: such checkpoints are refused.
    loads_fp8_checkpoints = False

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        rotary = self.rotary_embedding(config)
        layers = [self.make_layer(config, i, tp, dtype, rotary) for i in range(config.num_hidden_layers)]
        self.model = LayerNormDecoderModel(config, tp, dtype, layers, self.layer_norm(config, dtype))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype, bias=self.lm_head_bias)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", self.tie_default))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def rotary_embedding(self, config: Any) -> RotaryEmbedding:
        """The RoPE table every layer shares (default: the config's theta, scaling and, with `partial_rotary`,
        partial_rotary_factor)."""
        return llama_rotary_embedding(config, self.partial_rotary)

    def layer_norm(self, config: Any, dtype: torch.dtype) -> LayerNorm:
        """A LayerNorm (weight and bias) over hidden_size with the config's epsilon."""
        return LayerNorm(config.hidden_size, float(getattr(config, self.eps_key, 1e-5)), dtype)

    def make_layer(self, config: Any, layer_index: int, tp: TensorParallelGroup, dtype: torch.dtype,
                   rotary: RotaryEmbedding) -> LayerNormDecoderLayer:
        """Block `layer_index` (every layer shares `rotary`)."""
        raise NotImplementedError

    def layer_window(self, config: Any, layer_index: int) -> int | None:
        """Block `layer_index`'s attention window (None: full attention)."""
        return self.sliding_windows(config)[layer_index]

    @classmethod
    def sliding_windows(cls, config: Any) -> list[int | None]:
        """Each layer's attention window (None: the whole context), from the config alone."""
        n = int(config.num_hidden_layers)
        if not cls.uses_sliding_window:
            return [None] * n
        return [layer_sliding_window(config, i) for i in range(n)]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings of `input_ids` (a step with prompt-embedding rows merges those in)."""
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`inputs_embeds`: embeddings to run instead of `input_ids`' (a step with prompt-embedding rows)."""
        return self.model(input_ids, positions, kv_caches, meta, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the vocabulary (Phi's head bias sharded with the vocabulary: ParallelLMHead)."""
        return self.lm_head.compute_logits(hidden)

    def rename(self, name: str) -> str:
        """A checkpoint tensor's name under this module tree (prefix_renames, then component renames)."""
        for old, new in self.prefix_renames:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        return ".".join(self.renames.get(part, part) for part in name.split("."))

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under our names, the non-parameters dropped."""
        for name, tensor in weights:
            if name.endswith(self.skip_suffixes):
                continue
            yield self.rename(name), tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = ("lm_head.weight",) if self.tie_word_embeddings else ()
        load_named_weights(self, self.checkpoint_tensors(weights), self.stacked_params, skip=skip)


def split_interleaved_qkv(name: str, tensor: torch.Tensor, num_heads: int,
                          head_dim: int) -> Iterator[tuple[str, torch.Tensor]]:
    """GPT-NeoX's fused `query_key_value` weight [H·3·D, in] or bias [H·3·D] (each head's q, k, v rows together)
    → its `q_proj`, `k_proj`, `v_proj` tensors of H·D rows each (the stacked names of `qkv_proj`)."""
    if tensor.shape[0] != 3 * num_heads * head_dim:
        raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, the config implies "
                         f"3 × {num_heads} heads × {head_dim} = {3 * num_heads * head_dim}")
    prefix, _, leaf = name.rpartition(".")
    prefix = prefix.rpartition(".")[0]
    per_head = tensor.reshape(num_heads, 3, head_dim, *tensor.shape[1:])
    for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
        yield f"{prefix}.{proj}.{leaf}", per_head[:, i].reshape(num_heads * head_dim, *tensor.shape[1:])


class GPTNeoXForCausalLM(LayerNormCausalLM):
    """HF GPT-NeoX checkpoints (`gpt_neox.layers.N.attention.query_key_value`, `embed_out`, or transformers 5's
    `lm_head`) under the shared layout."""

    prefix_renames = (("gpt_neox.", "model."), ("embed_out.", "lm_head."))
    renames = {"embed_in": "embed_tokens", "final_layer_norm": "norm", "attention": "self_attn", "dense": "o_proj",
               "dense_h_to_4h": "fc1", "dense_4h_to_h": "fc2"}
    # query_key_value's B rows are per-head interleaved as its weight's: split into qkv_proj's q, k and v slices,
    # each with the same A.
    lora_modules = {"query_key_value": "qkv_proj", "dense": "o_proj", "dense_h_to_4h": "fc1", "dense_4h_to_h": "fc2"}

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        kv_heads = getattr(config, "num_key_value_heads", None)
        if kv_heads and kv_heads != config.num_attention_heads:
            raise ValueError(f"GPT-NeoX has one KV head per query head; the config asks num_key_value_heads="
                             f"{kv_heads} of {config.num_attention_heads}")
        super().__init__(config, tp, dtype)

    def make_layer(self, config: Any, layer_index: int, tp: TensorParallelGroup, dtype: torch.dtype,
                   rotary: RotaryEmbedding) -> LayerNormDecoderLayer:
        bias = bool(getattr(config, "attention_bias", True))
        attn = PartialRotaryAttention(config, tp, dtype, rotary, qkv_bias=bias, o_bias=bias)
        return LayerNormDecoderLayer(attn, GeluMLP(config, tp, dtype, bias=True), self.layer_norm(config, dtype),
                                     self.layer_norm(config, dtype),
                                     bool(getattr(config, "use_parallel_residual", True)))

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Drops old checkpoints' causal-mask buffers (`attention.bias` / `attention.masked_bias`) and splits each
        `query_key_value` into q/k/v."""
        config = self.config
        head_dim = attention_head_dim(config)

        def kept() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                parts = name.split(".")
                if len(parts) >= 2 and parts[-2] == "attention" and parts[-1] in ("bias", "masked_bias"):
                    continue
                yield name, tensor

        for name, tensor in super().checkpoint_tensors(kept()):
            if name.split(".")[-2:-1] == ["query_key_value"]:
                yield from split_interleaved_qkv(name, tensor, config.num_attention_heads, head_dim)
            else:
                yield name, tensor
