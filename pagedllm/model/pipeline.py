"""A model cut to one pipeline stage (vLLM's --pipeline-parallel-size): the stage keeps its decoder layers, the first
stage the token embeddings, the last stage the final norm and the LM head; the rest become `PPMissingLayer`s, which
hold no weights, and the checkpoint's tensors for them are skipped at load.

Supported: models whose decoder is `LlamaModel` run as it is (Llama, Qwen2/3, Mistral, Phi-3, Granite, OLMo 2,
SmolLM3, GLM-4, the Mixtral-style MoE families), generating text, with one KV cache group (every layer the same
attention window).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagedllm.distributed.parallel_state import PipelineParallelGroup, TensorParallelGroup


class PPMissingLayer(nn.Identity):
    """A module another pipeline stage runs (vLLM's name)."""


def pipeline_unsupported_reason(cls: type) -> str | None:
    """Why `cls` cannot be split into pipeline stages (None: it can)."""
    from pagedllm.model.models.llama import LlamaForCausalLM

    if not issubclass(cls, LlamaForCausalLM):
        return f"{cls.__name__} is not a Llama-style decoder"
    for method in ("forward", "compute_logits", "embed_input_ids"):
        if getattr(cls, method) is not getattr(LlamaForCausalLM, method):
            return f"{cls.__name__} has its own {method}"
    return None


def _check_decoder(model: nn.Module) -> None:
    from pagedllm.model.models.llama import LlamaModel

    decoder = getattr(model, "model", None)
    if not isinstance(decoder, LlamaModel) or type(decoder).forward is not LlamaModel.forward:
        raise ValueError(f"pipeline_parallel_size > 1: {type(model).__name__}'s decoder "
                         f"({type(decoder).__name__}) runs its own forward; pipeline stages need LlamaModel's.")


def keep_pipeline_stage(model: nn.Module, stage: PipelineParallelGroup) -> nn.Module:
    """Replace what other stages run with PPMissingLayer (before the model is given memory) and give the decoder
    its stage."""
    _check_decoder(model)
    decoder = model.model
    layers = decoder.layers
    for i in range(len(layers)):
        if not stage.start_layer <= i < stage.end_layer:
            layers[i] = PPMissingLayer()
    tied = bool(getattr(model, "tie_word_embeddings", False))
    if not stage.is_first and not (stage.is_last and tied):  # (a tied LM head is the embedding's weight)
        decoder.embed_tokens = PPMissingLayer()
    if not stage.is_last:
        decoder.norm = PPMissingLayer()
        model.lm_head = PPMissingLayer()
    decoder.pipeline = stage
    return model


def stage_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors this stage holds (those of missing modules are skipped)."""
    missing = tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, PPMissingLayer))
    for name, tensor in weights:
        if not name.startswith(missing):
            yield name, tensor


def check_pipeline_parallel(config, hf_config) -> None:
    """A clear ValueError for what pipeline stages cannot run (checked before any process starts)."""
    from pagedllm.model.models.registry import get_model_class, kv_cache_layout

    pp = config.parallel_config.pipeline_parallel_size
    what = f"pipeline_parallel_size={pp}"
    if (reason := pipeline_unsupported_reason(get_model_class(hf_config))) is not None:
        raise ValueError(f"{what}: {reason}; pipeline stages run Llama-style decoders (Llama, Qwen2/3, Mistral, "
                         "Phi-3, Granite, SmolLM3, Mixtral-style MoE). Use tensor_parallel_size to split this model.")
    unsupported = {
        "runner='pooling'": config.model_config.runner == "pooling",
        "speculative decoding": config.speculative_config is not None,
        "LoRA adapters": config.lora_config is not None,
        "enable_prompt_embeds": bool(config.model_config.enable_prompt_embeds),
        "quantization='fp8'": config.model_config.quantization == "fp8",
        "cpu_offload_gb": bool(config.cache_config.cpu_offload_gb),
    }
    named = [name for name, on in unsupported.items() if on]
    if named:
        raise ValueError(f"{what} does not run with {', '.join(named)}; turn that off, or split the model with "
                         "tensor_parallel_size instead.")
    with torch.device("meta"):  # (a decoder with its own forward: refused here, before any process starts)
        _check_decoder(get_model_class(hf_config)(hf_config, TensorParallelGroup(), torch.float32))
    if kv_cache_layout(hf_config, config.cache_config).num_groups != 1:
        raise ValueError(f"{what}: this model's layers have different attention windows (several KV cache groups), "
                         "which pipeline stages do not split; pass disable_hybrid_kv_cache_manager=True, or use "
                         "tensor_parallel_size.")
