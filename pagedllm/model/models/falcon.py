"""Falcon (TII's Falcon-7B / 40B / 180B and their fine-tunes): LayerNorm blocks with RoPE on whole heads, a fused
`query_key_value`, a GELU `dense_h_to_4h` / `dense_4h_to_h` MLP, biases under ``bias`` and an LM head tied to the
embeddings. Three layouts:

- ``new_decoder_architecture`` (40B, 180B): GQA; attention and MLP in parallel, each after its own LayerNorm
  (``ln_attn`` / ``ln_mlp``), or both after one (``num_ln_in_parallel_attn`` = 1);
- ``parallel_attn`` (7B): one LayerNorm feeding attention and MLP in parallel; multi-query (``multi_query``: one
  K/V head) or one K/V head per query head;
- neither: sequential blocks (``input_layernorm``, ``post_attention_layernorm``).

Every layout stores `query_key_value` as groups of one K/V head's queries, then its key and value ([kv_heads,
q_per_kv + 2, head_dim] rows: multi-query is one group, per-head K/V one group per head); it is split into q, k and v
at load time. ALiBi checkpoints (``alibi``: falcon-rw) are refused.

Built of GPT-NeoX's shared LayerNorm decoder (models/gpt_neox.py), whose layout the checkpoint's names are mapped
into at load time.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.layers.rotary import RotaryEmbedding
from pagedllm.model.models.gpt_neox import (
    GeluMLP,
    LayerNormCausalLM,
    LayerNormDecoderLayer,
    PartialRotaryAttention,
    attention_head_dim,
)


def falcon_kv_heads(config: Any) -> int:
    """The K/V heads Falcon's attention produces (as transformers: num_kv_heads under the new architecture or without
    multi-query, else 1)."""
    if getattr(config, "new_decoder_architecture", False) or not getattr(config, "multi_query", True):
        return int(getattr(config, "num_kv_heads", None) or config.num_attention_heads)
    return 1


def split_grouped_qkv(name: str, tensor: torch.Tensor, num_kv_heads: int,
                      head_dim: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Falcon's fused `query_key_value` weight or bias ([kv_heads · (q_per_kv + 2) · D, ...]: each K/V group's query
    heads, then its key, then its value) → its `q_proj`, `k_proj`, `v_proj` tensors."""
    group_rows, rem = divmod(tensor.shape[0], num_kv_heads * head_dim)
    if rem or group_rows < 3:
        raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows: not {num_kv_heads} K/V groups of "
                         f"(queries + 2) × {head_dim}")
    prefix, _, leaf = name.rpartition(".")
    prefix = prefix.rpartition(".")[0]
    groups = tensor.reshape(num_kv_heads, group_rows, head_dim, *tensor.shape[1:])
    parts = {"q_proj": groups[:, :-2], "k_proj": groups[:, -2], "v_proj": groups[:, -1]}
    for proj, part in parts.items():
        yield f"{prefix}.{proj}.{leaf}", part.reshape(-1, *tensor.shape[1:])


class FalconForCausalLM(LayerNormCausalLM):
    """HF Falcon checkpoints (`transformer.h.N.self_attention.query_key_value`, `mlp.dense_h_to_4h`, `ln_attn`)."""

    prefix_renames = (("transformer.h.", "model.layers."), ("transformer.word_embeddings.", "model.embed_tokens."),
                      ("transformer.ln_f.", "model.norm."))
    renames = {"self_attention": "self_attn", "dense": "o_proj", "dense_h_to_4h": "fc1", "dense_4h_to_h": "fc2",
               "ln_attn": "input_layernorm", "ln_mlp": "post_attention_layernorm"}
    lora_modules = {"query_key_value": "qkv_proj", "dense": "o_proj", "dense_h_to_4h": "fc1", "dense_4h_to_h": "fc2"}
    eps_key = "layer_norm_epsilon"
    tie_default = True
    partial_rotary = False

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        if getattr(config, "alibi", False):
            raise ValueError("Falcon with alibi=True (ALiBi position biases, e.g. falcon-rw) is not supported; "
                             "supported: Falcon's rotary checkpoints (alibi=False)")
        new_arch = bool(getattr(config, "new_decoder_architecture", False))
        if new_arch and not getattr(config, "parallel_attn", True):
            raise ValueError("Falcon's new_decoder_architecture runs attention and MLP in parallel; the config sets "
                             "parallel_attn=False, which transformers' modeling does not run either")
        kv_heads = getattr(config, "num_key_value_heads", None)
        if kv_heads is None:
            # FalconConfig has no num_key_value_heads before transformers 5.2x; the shared attention and the KV cache
            # (worker.kv_geometry, after the model is built) read it.
            config.num_key_value_heads = kv_heads = falcon_kv_heads(config)
        if kv_heads != falcon_kv_heads(config):
            raise ValueError(f"this Falcon config's attention has {falcon_kv_heads(config)} K/V heads, its "
                             f"num_key_value_heads says {kv_heads}")
        super().__init__(config, tp, dtype)

    @staticmethod
    def _norms(config: Any) -> tuple[bool, int]:
        """(parallel residual, LayerNorms per block)."""
        if getattr(config, "new_decoder_architecture", False):
            return True, int(getattr(config, "num_ln_in_parallel_attn", None) or 2)
        if getattr(config, "parallel_attn", True):
            return True, 1
        return False, 2

    def make_layer(self, config: Any, layer_index: int, tp: TensorParallelGroup, dtype: torch.dtype,
                   rotary: RotaryEmbedding) -> LayerNormDecoderLayer:
        bias = bool(getattr(config, "bias", False))
        attn = PartialRotaryAttention(config, tp, dtype, rotary, qkv_bias=bias, o_bias=bias)
        mlp = GeluMLP(config, tp, dtype, bias=bias, intermediate_size=getattr(config, "ffn_hidden_size", None)
                      or 4 * config.hidden_size, act=getattr(config, "activation", None) or "gelu")
        parallel, norms = self._norms(config)
        if norms not in (1, 2):
            raise ValueError(f"num_ln_in_parallel_attn must be 1 or 2, got {norms}")
        return LayerNormDecoderLayer(attn, mlp, self.layer_norm(config, dtype),
                                     self.layer_norm(config, dtype) if norms == 2 else None, parallel)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Splits each `query_key_value` into q/k/v."""
        kv_heads, head_dim = falcon_kv_heads(self.config), attention_head_dim(self.config)
        for name, tensor in super().checkpoint_tensors(weights):
            if name.split(".")[-2:-1] == ["query_key_value"]:
                yield from split_grouped_qkv(name, tensor, kv_heads, head_dim)
            else:
                yield name, tensor
