"""Phi-3 / Phi-3.5 (mini) and Phi-4-mini: the Llama architecture with fused checkpoint tensors, an optional sliding
window on every layer, LongRoPE scaling on the 128k variants (layers/rotary.py), and RoPE on part of each head under a
``partial_rotary_factor`` (Phi-4-mini's 0.75: 96 of 128 dims; models/llama.py: llama_rotary_embedding).

Checkpoints store one ``qkv_proj`` [q | k | v] and one ``gate_up_proj`` [gate | up] per layer; they are split into the
merged parameters' shards at load time, so tensor parallelism shards q, k, v, gate and up as for Llama.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from pagedllm.model.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # An FP8 checkpoint's scales of the fused tensors are not split here: such checkpoints are refused.
    loads_fp8_checkpoints = False
    partial_rotary = True
    #: LoRA: PEFT names Phi-3's own fused modules; an adapter's B on qkv_proj / gate_up_proj is split by
    #: `checkpoint_tensors` as the weight is (lora/adapter.py), each piece with the same A.
    lora_modules = {"qkv_proj": "qkv_proj", "o_proj": "o_proj", "gate_up_proj": "gate_up_proj", "down_proj": "down_proj"}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self.checkpoint_tensors(weights))

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``qkv_proj`` → q/k/v_proj and ``gate_up_proj`` → gate/up_proj tensors (Llama's stacked names)."""
        config = self.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        q = config.num_attention_heads * head_dim
        kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
        inter = config.intermediate_size
        fused = {"qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
                 "gate_up_proj": (("gate_proj", inter), ("up_proj", inter))}
        for name, tensor in weights:
            parts = name.split(".")
            pieces = fused.get(parts[-2]) if len(parts) >= 2 else None
            if pieces is None:
                yield name, tensor
                continue
            total = sum(rows for _, rows in pieces)
            if tensor.shape[0] != total:
                raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, the config implies {total} "
                                 f"({' + '.join(f'{p} {r}' for p, r in pieces)})")
            start = 0
            for piece, rows in pieces:
                yield ".".join(parts[:-2] + [piece, parts[-1]]), tensor[start:start + rows]
                start += rows

