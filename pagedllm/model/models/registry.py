"""Architecture name → model class, and the model-side limits on the context length."""
from __future__ import annotations

import importlib
from typing import Any

from pagedllm.core.kv_cache_groups import KVCacheLayout, plan_kv_cache_groups, single_group_layout

_LLAMA = "pagedllm.model.models.llama:LlamaForCausalLM"
_QWEN2 = "pagedllm.model.models.qwen2:Qwen2ForCausalLM"
_QWEN3 = "pagedllm.model.models.qwen3:Qwen3ForCausalLM"
_OPT = "pagedllm.model.models.opt:OPTForCausalLM"
_GPT2 = "pagedllm.model.models.gpt2:GPT2LMHeadModel"
_SEQ_CLS = "pagedllm.model.models.sequence_classification:"
_QWEN2_RM = "pagedllm.model.models.qwen2_rm:"
_MIXTRAL = "pagedllm.model.models.moe:MixtralForCausalLM"
_QWEN2_MOE = "pagedllm.model.models.moe:Qwen2MoeForCausalLM"
_QWEN3_MOE = "pagedllm.model.models.moe:Qwen3MoeForCausalLM"
_GEMMA = "pagedllm.model.models.gemma:GemmaForCausalLM"
_GEMMA2 = "pagedllm.model.models.gemma:Gemma2ForCausalLM"
_GEMMA3 = "pagedllm.model.models.gemma:Gemma3ForCausalLM"
_PHI3 = "pagedllm.model.models.phi3:Phi3ForCausalLM"
_GRANITE = "pagedllm.model.models.granite:GraniteForCausalLM"
_GRANITE_MOE = "pagedllm.model.models.moe:GraniteMoeForCausalLM"
_OLMO2 = "pagedllm.model.models.olmo2:Olmo2ForCausalLM"
_OLMO3 = "pagedllm.model.models.olmo2:Olmo3ForCausalLM"
_SMOLLM3 = "pagedllm.model.models.smollm3:SmolLM3ForCausalLM"
_GPT_NEOX = "pagedllm.model.models.gpt_neox:GPTNeoXForCausalLM"
_PHI = "pagedllm.model.models.phi:PhiForCausalLM"
_STABLELM = "pagedllm.model.models.stablelm:StableLmForCausalLM"
_STARCODER2 = "pagedllm.model.models.starcoder2:Starcoder2ForCausalLM"
_OLMOE = "pagedllm.model.models.moe:OlmoeForCausalLM"
_COHERE = "pagedllm.model.models.cohere:CohereForCausalLM"
_GPT_BIGCODE = "pagedllm.model.models.gpt_bigcode:GPTBigCodeForCausalLM"
_GPT_J = "pagedllm.model.models.gpt_j:GPTJForCausalLM"
_GLM = "pagedllm.model.models.glm4:GlmForCausalLM"
_GLM4 = "pagedllm.model.models.glm4:Glm4ForCausalLM"
_FALCON = "pagedllm.model.models.falcon:FalconForCausalLM"
_DEEPSEEK_V2 = "pagedllm.model.models.deepseek_v2:DeepseekV2ForCausalLM"
_DEEPSEEK_V3 = "pagedllm.model.models.deepseek_v2:DeepseekV3ForCausalLM"
_LLAVA = "pagedllm.model.models.llava:LlavaForConditionalGeneration"
_BERT = "pagedllm.model.models.bert:"
_MAMBA2 = "pagedllm.model.models.mamba2:Mamba2ForCausalLM"
_MAMBA = "pagedllm.model.models.mamba:MambaForCausalLM"
_FALCON_MAMBA = "pagedllm.model.models.mamba:FalconMambaForCausalLM"
_JAMBA = "pagedllm.model.models.jamba:JambaForCausalLM"
_BAMBA = "pagedllm.model.models.bamba:BambaForCausalLM"
_GRANITE_HYBRID = "pagedllm.model.models.granite_hybrid:GraniteMoeHybridForCausalLM"
_NEMOTRON_H = "pagedllm.model.models.nemotron_h:NemotronHForCausalLM"
_GPT_OSS = "pagedllm.model.models.gpt_oss:GptOssForCausalLM"

# Architecture (HF `architectures[0]`) or `model_type` → "module:Class".
_MODELS = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _QWEN2,
    "Qwen3ForCausalLM": _QWEN3,
    "OPTForCausalLM": _OPT,
    "GPT2LMHeadModel": _GPT2,
    "MixtralForCausalLM": _MIXTRAL,
    "Qwen2MoeForCausalLM": _QWEN2_MOE,
    "Qwen3MoeForCausalLM": _QWEN3_MOE,
    "GemmaForCausalLM": _GEMMA,
    "Gemma2ForCausalLM": _GEMMA2,
    "Gemma3ForCausalLM": _GEMMA3,  # Gemma 3 text-only checkpoints (gemma-3-1b, model_type gemma3_text)
    "Phi3ForCausalLM": _PHI3,
    "GraniteForCausalLM": _GRANITE,
    "GraniteMoeForCausalLM": _GRANITE_MOE,
    "Olmo2ForCausalLM": _OLMO2,
    "Olmo3ForCausalLM": _OLMO3,
    "SmolLM3ForCausalLM": _SMOLLM3,
    "GPTNeoXForCausalLM": _GPT_NEOX,
    "PhiForCausalLM": _PHI,
    "StableLmForCausalLM": _STABLELM,
    "Starcoder2ForCausalLM": _STARCODER2,
    "OlmoeForCausalLM": _OLMOE,
    "CohereForCausalLM": _COHERE,
    "GPTBigCodeForCausalLM": _GPT_BIGCODE,
    "GPTJForCausalLM": _GPT_J,
    "GlmForCausalLM": _GLM,
    "Glm4ForCausalLM": _GLM4,
    "FalconForCausalLM": _FALCON,
    "DeepseekV2ForCausalLM": _DEEPSEEK_V2,
    "DeepseekV3ForCausalLM": _DEEPSEEK_V3,
    # State-space models (Mamba-2 layers keep per-sequence state slots: model/layers/mamba_state.py), pure or
    # hybrid with attention layers.
    "Mamba2ForCausalLM": _MAMBA2,
    "MambaForCausalLM": _MAMBA,
    "FalconMambaForCausalLM": _FALCON_MAMBA,
    "JambaForCausalLM": _JAMBA,
    "BambaForCausalLM": _BAMBA,
    "GraniteMoeHybridForCausalLM": _GRANITE_HYBRID,
    "NemotronHForCausalLM": _NEMOTRON_H,
    "GptOssForCausalLM": _GPT_OSS,
    # Image inputs (multimodal/): a vision tower and projector in front of the text model of `text_config`.
    "LlavaForConditionalGeneration": _LLAVA,
    # Base models (no LM head: embedding checkpoints such as e5-mistral's MistralModel): pooling runner only.
    "LlamaModel": _LLAMA,
    "MistralModel": _LLAMA,
    "Qwen2Model": _QWEN2,
    "Qwen3Model": _QWEN3,
    # Sequence classifiers (the decoder and a `score` head over the labels): pooling runner only.
    "LlamaForSequenceClassification": _SEQ_CLS + "LlamaForSequenceClassification",
    "MistralForSequenceClassification": _SEQ_CLS + "LlamaForSequenceClassification",
    "Qwen2ForSequenceClassification": _SEQ_CLS + "Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification": _SEQ_CLS + "Qwen3ForSequenceClassification",
    # Token classifiers (the decoder and a `score` head over the labels, read at every token): pooling runner only.
    "LlamaForTokenClassification": _SEQ_CLS + "LlamaForTokenClassification",
    "MistralForTokenClassification": _SEQ_CLS + "LlamaForTokenClassification",
    "Qwen2ForTokenClassification": _SEQ_CLS + "Qwen2ForTokenClassification",
    "Qwen3ForTokenClassification": _SEQ_CLS + "Qwen3ForTokenClassification",
    # Reward models (the decoder and a two-layer `score` head read at every token; pooling runner only): per-token
    # rewards (ALL pooling), a process reward model's step rewards (STEP pooling).
    "Qwen2ForRewardModel": _QWEN2_RM + "Qwen2ForRewardModel",
    "Qwen2ForProcessRewardModel": _QWEN2_RM + "Qwen2ForProcessRewardModel",
    # Encoder-only models (bidirectional attention, no KV cache: model/models/bert.py): pooling runner only.
    "BertModel": _BERT + "BertModel",
    "RobertaModel": _BERT + "RobertaModel",
    "XLMRobertaModel": _BERT + "XLMRobertaModel",
    "BertForSequenceClassification": _BERT + "BertForSequenceClassification",
    "RobertaForSequenceClassification": _BERT + "RobertaForSequenceClassification",
    "XLMRobertaForSequenceClassification": _BERT + "XLMRobertaForSequenceClassification",
    "BertForTokenClassification": _BERT + "BertForTokenClassification",
    "RobertaForTokenClassification": _BERT + "RobertaForTokenClassification",
    "XLMRobertaForTokenClassification": _BERT + "XLMRobertaForTokenClassification",
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _QWEN2,
    "qwen3": _QWEN3,
    "opt": _OPT,
    "gpt2": _GPT2,
    "mixtral": _MIXTRAL,
    "qwen2_moe": _QWEN2_MOE,
    "qwen3_moe": _QWEN3_MOE,
    "gemma": _GEMMA,
    "gemma2": _GEMMA2,
    "gemma3_text": _GEMMA3,
    "phi3": _PHI3,
    "granite": _GRANITE,
    "granitemoe": _GRANITE_MOE,
    "olmo2": _OLMO2,
    "olmo3": _OLMO3,
    "smollm3": _SMOLLM3,
    "gpt_neox": _GPT_NEOX,
    "phi": _PHI,
    "stablelm": _STABLELM,
    "starcoder2": _STARCODER2,
    "olmoe": _OLMOE,
    "cohere": _COHERE,
    "gpt_bigcode": _GPT_BIGCODE,
    "gptj": _GPT_J,
    "glm": _GLM,
    "glm4": _GLM4,
    "falcon": _FALCON,
    "deepseek_v2": _DEEPSEEK_V2,
    "deepseek_v3": _DEEPSEEK_V3,
    "llava": _LLAVA,
    "mamba2": _MAMBA2,
    "mamba": _MAMBA,
    "falcon_mamba": _FALCON_MAMBA,
    "jamba": _JAMBA,
    "bamba": _BAMBA,
    "granitemoehybrid": _GRANITE_HYBRID,
    "nemotron_h": _NEMOTRON_H,
    "gpt_oss": _GPT_OSS,
}

_DEFAULT_MAX_LEN = 2048


_ENCODER_BASE_MODELS = ("BertModel", "RobertaModel", "XLMRobertaModel")
_ENCODER_CLASSIFICATION_MODELS = ("BertForSequenceClassification", "RobertaForSequenceClassification",
                                  "XLMRobertaForSequenceClassification")
_ENCODER_TOKEN_CLASSIFICATION_MODELS = ("BertForTokenClassification", "RobertaForTokenClassification",
                                        "XLMRobertaForTokenClassification")
# Reward models classify every token too (task token_classify).
_REWARD_MODELS = ("Qwen2ForRewardModel", "Qwen2ForProcessRewardModel")
_TOKEN_CLASSIFICATION_MODELS = ("LlamaForTokenClassification", "MistralForTokenClassification",
                                "Qwen2ForTokenClassification", "Qwen3ForTokenClassification",
                                *_ENCODER_TOKEN_CLASSIFICATION_MODELS, *_REWARD_MODELS)

_BASE_MODELS = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model", *_ENCODER_BASE_MODELS)


_CLASSIFICATION_MODELS = ("LlamaForSequenceClassification", "MistralForSequenceClassification",
                          "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification",
                          *_ENCODER_CLASSIFICATION_MODELS)


def is_base_model(config: Any) -> bool:
    """A checkpoint of the transformer without its LM head (tensor names lack the ``model.`` prefix)."""
    archs = list(getattr(config, "architectures", None) or [])
    return bool(archs) and archs[0] in _BASE_MODELS


def is_classification_model(config: Any) -> bool:
    """A *ForSequenceClassification checkpoint: the decoder and a `score` head over the labels, no LM head."""
    archs = list(getattr(config, "architectures", None) or [])
    return bool(archs) and archs[0] in _CLASSIFICATION_MODELS


def is_token_classification_model(config: Any) -> bool:
    """A *ForTokenClassification checkpoint (or a reward model: Qwen2ForRewardModel, Qwen2ForProcessRewardModel):
    the transformer and a classifier head applied to every token."""
    archs = list(getattr(config, "architectures", None) or [])
    return bool(archs) and archs[0] in _TOKEN_CLASSIFICATION_MODELS


def is_encoder_only(config: Any) -> bool:
    """An encoder-only checkpoint (BERT, RoBERTa, XLM-RoBERTa): bidirectional attention over each whole prompt,
    no KV cache, no chunked prefill, no prefix caching."""
    archs = list(getattr(config, "architectures", None) or [])
    return bool(archs) and archs[0] in (_ENCODER_BASE_MODELS + _ENCODER_CLASSIFICATION_MODELS
                                        + _ENCODER_TOKEN_CLASSIFICATION_MODELS)


def has_recurrent_state(config: Any) -> bool:
    """A model with state-space (Mamba) layers: each sequence keeps a recurrent state (model/layers/mamba_state.py)
    besides, or instead of, the KV cache of its attention layers."""
    try:
        return hasattr(get_model_class(config), "mamba_state_shape")
    except ValueError:
        return False


def text_config(config: Any) -> Any:
    """The language model's config: a multimodal config's `text_config` (vLLM's hf_text_config), else the config."""
    sub = getattr(config, "text_config", None)
    return sub if sub is not None and getattr(config, "vision_config", None) is not None else config


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


def kv_cache_head_size(config: Any) -> int:
    """The per-head width of the KV cache: the model class's ``kv_cache_head_size(config)`` where it caches something
    other than ``head_dim`` (DeepSeek's MLA: its latent, kv_lora_rank + qk_rope_head_dim), else ``head_dim`` or
    hidden / heads."""
    config = text_config(config)
    hook = getattr(get_model_class(config), "kv_cache_head_size", None)
    if hook is not None:
        return int(hook(config))
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_cache_uses_mla(config: Any) -> bool:
    """Whether the model class caches an MLA latent (its ``use_mla``): one KV head, the key tensor also read as the
    value tensor (worker/cache_engine.py)."""
    return bool(getattr(get_model_class(text_config(config)), "use_mla", False))


def get_sliding_window(config: Any) -> int | None:
    """The attention window of a HF config (Mistral, Qwen2 with use_sliding_window), or None."""
    config = text_config(config)
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types and "sliding_attention" not in layer_types:
        return None
    return int(window)


def layer_sliding_windows(config: Any) -> list[int | None]:
    """Each attention layer's window (None: full attention), as the model class builds its layers."""
    try:
        windows = getattr(get_model_class(config), "sliding_windows", None)
    except ValueError:
        windows = None
    if windows is None:
        return [None] * int(text_config(config).num_hidden_layers)
    return list(windows(config))


def kv_cache_layout(config: Any, cache_config: Any) -> KVCacheLayout:
    """The model's KV cache groups under `cache_config` (its disable_sliding_window and
    disable_hybrid_kv_cache_manager): core/kv_cache_groups.py."""
    windows = layer_sliding_windows(config)
    if not windows:  # a pure state-space model (Mamba2): no attention layer, no KV pool
        return single_group_layout(0)
    if cache_config.disable_sliding_window:
        windows = [None] * len(windows)
    return plan_kv_cache_groups(windows, enable_hybrid=not cache_config.disable_hybrid_kv_cache_manager)


def get_model_max_len(config: Any, max_model_len: int | None = None) -> int:
    """The longest context this engine may serve for `config` (`max_model_len` is the user's request, which the
    engine applies under this ceiling): the config's position limit. A sliding window does not lower it: every
    attention backend implements it (each query attends to its last `sliding_window` keys, whatever the context)."""
    if is_encoder_only(config):
        return get_model_class(config).max_model_len(config)
    limit = None
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            limit = value
            break
    return limit or _DEFAULT_MAX_LEN
