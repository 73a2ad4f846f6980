"""Qwen3 (dense): the Llama architecture with an RMSNorm over each attention head's q and k before RoPE, an
explicit head_dim, and no q/k/v biases."""
from __future__ import annotations

from pagedllm.model.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
