"""Zhipu's GLM (``GlmForCausalLM``: glm-4-9b-chat-hf) and GLM-4 (``Glm4ForCausalLM``: GLM-4-0414, GLM-Z1): Llama's
RMSNorm layers and SwiGLU MLP with biased q/k/v (``attention_bias``) and an unbiased o_proj, RoPE on the first
``partial_rotary_factor`` of each head rotating interleaved pairs, and a fused ``gate_up_proj`` in the checkpoint.
GLM-4 adds Gemma 2's sandwich: a norm on the attention output (``post_self_attn_layernorm``) and on the MLP output
(``post_mlp_layernorm``) before their residual adds.

The checkpoint's names are mapped onto Llama's (GLM) or Gemma's sandwich layer (GLM-4, with RMSNorm's w):
post_self_attn_layernorm → post_attention_layernorm, post_attention_layernorm → pre_feedforward_layernorm,
post_mlp_layernorm → post_feedforward_layernorm; gate_up_proj is split into gate and up. The interleaved RoPE runs as
the engine's rotate-half RoPE on reordered q/k rows (models/interleaved_rope.py).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.models.gemma import GemmaDecoderLayer
from pagedllm.model.models.gpt_neox import PartialRotaryAttention, attention_head_dim
from pagedllm.model.models.interleaved_rope import interleaved_rope_tensors
from pagedllm.model.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    layer_sliding_window,
    llama_rotary_embedding,
)


class GlmForCausalLM(LlamaForCausalLM):
    """GLM: pre-norm Llama layers. Subclasses set `sandwich_norms` (GLM-4)."""

    lora_modules = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
                    "gate_up_proj": "gate_up_proj", "down_proj": "down_proj"}
    partial_rotary = True
    sandwich_norms = False
    renamed_norms: dict[str, str] = {}
    # The reordered q/k rows would need their FP8 scales reordered too: such checkpoints are refused.
    loads_fp8_checkpoints = False

    def build_model(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> LlamaModel:
        rotary = llama_rotary_embedding(config, self.partial_rotary)
        bias = bool(getattr(config, "attention_bias", True))

        def make_layer(i: int) -> nn.Module:
            attn = PartialRotaryAttention(config, tp, dtype, rotary, qkv_bias=bias, o_bias=False,
                                          sliding_window=layer_sliding_window(config, i))
            if self.sandwich_norms:
                return GemmaDecoderLayer(config, tp, dtype, attn, LlamaMLP(config, tp, dtype), True, norm=RMSNorm)
            return LlamaDecoderLayer(config, tp, dtype, layer_index=i, self_attn=attn)

        return LlamaModel(config, tp, dtype, make_layer=make_layer)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under our names: norms renamed, gate_up_proj split, q/k rows reordered."""
        inter = int(self.config.intermediate_size)

        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                parts = [self.renamed_norms.get(p, p) for p in name.split(".")]
                if len(parts) >= 2 and parts[-2] == "gate_up_proj":
                    if tensor.shape[0] != 2 * inter:
                        raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, the config implies "
                                         f"2 × intermediate_size = {2 * inter}")
                    for proj, half in zip(("gate_proj", "up_proj"), tensor.split(inter)):
                        yield ".".join(parts[:-2] + [proj, parts[-1]]), half
                else:
                    yield ".".join(parts), tensor

        rotary = self.model.layers[0].self_attn.rotary_emb
        return interleaved_rope_tensors(renamed(), attention_head_dim(self.config), rotary.rotary_dim)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self.checkpoint_tensors(weights))


class Glm4ForCausalLM(GlmForCausalLM):
    """GLM-4: GLM's attention and MLP in Gemma 2's sandwich layer (four RMSNorms)."""

    sandwich_norms = True
    renamed_norms = {"post_self_attn_layernorm": "post_attention_layernorm",
                     "post_attention_layernorm": "pre_feedforward_layernorm",
                     "post_mlp_layernorm": "post_feedforward_layernorm"}
