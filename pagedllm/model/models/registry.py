"""Architecture name → model class."""
from __future__ import annotations

import importlib
from typing import Any

# Architecture (HF `architectures[0]` or `model_type`) → "module:Class".
_MODELS = {
    "LlamaForCausalLM": "pagedllm.model.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "pagedllm.model.models.llama:LlamaForCausalLM",
    "llama": "pagedllm.model.models.llama:LlamaForCausalLM",
    "mistral": "pagedllm.model.models.llama:LlamaForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(k for k in _MODELS if k[0].isupper())


def get_model_class(config: Any) -> type:
    """The model class for a HF config; a clear error lists what is supported."""
    names = list(getattr(config, "architectures", None) or []) + [getattr(config, "model_type", "")]
    for name in names:
        if name in _MODELS:
            module, cls = _MODELS[name].split(":")
            return getattr(importlib.import_module(module), cls)
    raise ValueError(f"model architecture {names} is not supported; supported: {supported_architectures()}")
