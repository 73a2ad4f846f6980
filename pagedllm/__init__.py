"""pagedllm: an LLM serving engine built on PagedAttention.

Top-level names are imported lazily so that `pagedllm.core` stays importable without torch.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagedllm.entrypoints.llm",
    "LLMEngine": "pagedllm.engine.llm_engine",
    "EngineArgs": "pagedllm.engine.arg_utils",
    "SamplingParams": "pagedllm.sampling_params",
    "BeamSearchParams": "pagedllm.sampling_params",
    "StructuredOutputsParams": "pagedllm.sampling_params",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
    "PoolingParams": "pagedllm.pooling_params",
    "LoRARequest": "pagedllm.lora.request",
    "PoolingRequestOutput": "pagedllm.outputs",
    "EmbeddingRequestOutput": "pagedllm.outputs",
    "ClassificationRequestOutput": "pagedllm.outputs",
    "ScoringRequestOutput": "pagedllm.outputs",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
