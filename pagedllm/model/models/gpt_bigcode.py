"""GPTBigCode (StarCoder 1, StarCoderBase, SantaCoder, WizardCoder): GPT-2's blocks (learned absolute positions,
pre-LayerNorm, a gelu_pytorch_tanh MLP, biases everywhere, an LM head tied to the token embedding) with multi-query
attention (``multi_query``: one K/V head shared by every query head).

Unlike GPT-2's Conv1D, its projections are nn.Linear ([out, in]); the fused ``c_attn`` holds [q (every head) | k | v]
under multi-query and each head's [q, k, v] rows together otherwise. Both are split into q, k and v at load time, so
tensor parallelism shards the query heads and replicates the one K/V head.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.models.gpt2 import GPT2LMHeadModel
from pagedllm.model.models.gpt_neox import split_interleaved_qkv


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    """HF GPTBigCode checkpoints (`transformer.h.N.attn.c_attn`, `transformer.wpe`, ...) on GPT-2's modules."""

    #: LoRA (lora/adapter.py): PEFT target → our layer; c_attn's B rows are split over q, k and v as its weight's.
    lora_modules = {"c_attn": "c_attn", "c_proj": "c_proj", "c_fc": "c_fc"}

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        heads = config.num_attention_heads
        want = 1 if getattr(config, "multi_query", True) else heads
        kv_heads = getattr(config, "num_key_value_heads", None)  # GPTBigCodeConfig derives it from multi_query
        if kv_heads != want:  # GPT2Attention and the KV cache (worker.kv_geometry) read it
            raise ValueError(f"GPTBigCode has {want} K/V head(s) with multi_query="
                             f"{getattr(config, 'multi_query', True)}; the config says num_key_value_heads={kv_heads}")
        super().__init__(config, tp, dtype)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as loaded (LoRA places adapters' B rows through it)."""
        return self._convert(weights)

    def _convert(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """c_attn split into q/k/v parts (the [out, in] weights need no transpose); old checkpoints' causal-mask
        buffers (`transformer.bias`, GPT-2's `attn.bias` / `attn.masked_bias`) dropped."""
        config = self.config
        hidden, heads = config.hidden_size, config.num_attention_heads
        head_dim = hidden // heads
        for name, tensor in weights:
            parts = name.split(".")
            if name in ("transformer.bias", "transformer.masked_bias") or \
                    (parts[-2] == "attn" and parts[-1] in ("bias", "masked_bias")):
                continue
            if parts[-2] != "c_attn":
                yield name, tensor
            elif config.num_key_value_heads == heads:  # each head's [q, k, v] rows together
                yield from split_interleaved_qkv(name, tensor, heads, head_dim)
            else:
                if tensor.shape[0] != hidden + 2 * head_dim:
                    raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows; multi-query attention "
                                     f"of {heads} heads × {head_dim} implies {hidden + 2 * head_dim}")
                for proj, part in zip(("q_proj", "k_proj", "v_proj"), tensor.split([hidden, head_dim, head_dim])):
                    yield ".".join(parts[:-2] + [proj, parts[-1]]), part
