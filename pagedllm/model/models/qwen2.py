"""Qwen2: the Llama architecture with biases on the q/k/v projections (none on o_proj)."""
from __future__ import annotations

from pagedllm.model.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
