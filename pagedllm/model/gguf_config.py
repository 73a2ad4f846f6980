"""What a GGUF file's metadata says: llama.cpp's architectures (their tensor names) and the Hugging Face config
built from a file's metadata as llama.cpp reads it (its hard-coded defaults where a file is silent)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from pagedllm.model.gguf_deepseek import DEEPSEEK2_TENSORS, deepseek2_config
from pagedllm.model.gguf_gpt_oss import GPT_OSS_TENSORS, gpt_oss_config
from pagedllm.model.gguf_mamba import SSM_ARCHITECTURES, SSM_MODELS, ssm_config
from pagedllm.model.gguf_moe import (
    MOE_MODELS,
    MOE_TENSORS,
    SHARED_EXPERT_TENSORS,
    moe_config,
)

logger = logging.getLogger("pagedllm")

GLOBAL_TENSORS: Mapping[str, str] = MappingProxyType(
    {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
)
_ATTENTION_TENSORS: Mapping[str, str] = MappingProxyType({
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
})
_GATED_MLP_TENSORS: Mapping[str, str] = MappingProxyType({
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
})
_QK_NORM_TENSORS: Mapping[str, str] = MappingProxyType({
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's and Gemma 3's per-head norms
    "attn_k_norm": "self_attn.k_norm",
})
_LLAMA_NORMS: Mapping[str, str] = MappingProxyType({
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
})
# Gemma 2 / 3: a norm after the attention and two around the MLP; llama.cpp's `ffn_norm` is the pre-MLP one.
_SANDWICH_NORMS: Mapping[str, str] = MappingProxyType({
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
})
# Phi-3 stores q|k|v as one `attn_qkv` and gate|up as one `ffn_up` (2 × intermediate rows): HF's own fused names.
_PHI3_TENSORS: Mapping[str, str] = MappingProxyType({
    "attn_qkv": "self_attn.qkv_proj",
    **_ATTENTION_TENSORS,  # unfused q/k/v, which llama.cpp accepts too
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
    **_LLAMA_NORMS,
})
# OLMo 2 / 3: post-norms after attention and MLP (no pre-norms); q/k norms over whole projections.
_OLMO2_TENSORS: Mapping[str, str] = MappingProxyType({
    **_ATTENTION_TENSORS,
    **_GATED_MLP_TENSORS,
    **_QK_NORM_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
})
# The LayerNorm families (GPT-NeoX, Phi-2, StableLM, StarCoder2) under pagedllm's shared layout of them
# (models/gpt_neox.py: Llama's attention and norm names, fc1 / fc2 for a GELU MLP), which their classes load as named
# and the quantized path matches module by module. Their norms and most projections carry biases.
_GELU_MLP_TENSORS: Mapping[str, str] = MappingProxyType({"ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"})
_GPTNEOX_TENSORS: Mapping[str, str] = MappingProxyType({
    "attn_qkv": "self_attn.qkv_proj",  # q|k|v (the converter reorders HF's per-head interleaved query_key_value)
    "attn_output": "self_attn.o_proj",
    **_GELU_MLP_TENSORS,
    **_LLAMA_NORMS,
})
# Phi-2: one norm feeding attention and MLP; q/k/v separate (HF's) or fused (older files' Wqkv).
_PHI2_TENSORS: Mapping[str, str] = MappingProxyType({
    "attn_qkv": "self_attn.qkv_proj",
    **_ATTENTION_TENSORS,
    **_GELU_MLP_TENSORS,
    "attn_norm": "input_layernorm",
})
_STARCODER2_TENSORS: Mapping[str, str] = MappingProxyType({**_ATTENTION_TENSORS, **_GELU_MLP_TENSORS, **_LLAMA_NORMS})
#: Phi-3 LongRoPE's per-dimension frequency factors: read into the config's rope scaling, not weights.
ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
#: Fused GGUF/HF tensors → their parts in row order (the quantized path serves the parts: layers/quantized_linear.py).
FUSED_PARTS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
})


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one llama.cpp architecture maps onto a transformers model."""

    hf_arch: str
    model_type: str
    block_tensors: Mapping[str, str]
    #: q_proj/k_proj rows permuted to llama.cpp's interleaved RoPE (Llama); the others use the NEOX (rotate-half)
    #: order and are stored as HF has them.
    permuted_qk: bool = False
    #: llama.cpp's converter stores Gemma's RMSNorm weights (the norm is x·(1 + w)) with the 1 added.
    norm_offset: float = 0.0
    #: whether the HF model has projection biases (a bias tensor elsewhere is refused)
    biases: bool = False
    hidden_act: str = "silu"
    #: what attn_q_norm / attn_k_norm normalise: each head ("head": one weight of head_dim, Qwen3, Gemma 3), the
    #: whole projection ("projection": heads · head_dim weights, OLMo 2) or each head with its own weight
    #: ("per_head": [heads, head_dim], StableLM 2 12B)
    qk_norm: str = "head"
    #: LayerNorms (weight and bias; epsilon from attention.layer_norm_epsilon) instead of RMSNorms
    layer_norm: bool = False
    #: whether RoPE may rotate part of each head (rope.dimension_count < head_dim)
    partial_rotary: bool = False
    #: the model class loads q/k/v separately: the dequantizing path splits a fused attn_qkv into them
    split_fused: bool = False


_LLAMA_BLOCK = MappingProxyType({**_ATTENTION_TENSORS, **_GATED_MLP_TENSORS, **_LLAMA_NORMS, **_QK_NORM_TENSORS})
_LLAMA_NO_QK_NORM = MappingProxyType({**_ATTENTION_TENSORS, **_GATED_MLP_TENSORS, **_LLAMA_NORMS})
_GEMMA2_BLOCK = MappingProxyType({**_ATTENTION_TENSORS, **_GATED_MLP_TENSORS, **_SANDWICH_NORMS})
# Mixture-of-experts blocks (gguf_moe.py): Llama's attention and norms, a router and merged experts.
_MOE_ATTENTION = MappingProxyType({**_ATTENTION_TENSORS, **_LLAMA_NORMS})
GGUF_ARCHITECTURES: Mapping[str, GGUFArchitecture] = MappingProxyType({
    # Mixtral's files are `llama` ones with experts (llama.expert_count > 0): MixtralForCausalLM (gguf_moe.moe_config).
    "llama": GGUFArchitecture("LlamaForCausalLM", "llama", MappingProxyType({**_LLAMA_BLOCK, **MOE_TENSORS}),
                              permuted_qk=True, biases=True),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "qwen2", _LLAMA_BLOCK, biases=True),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "qwen3", _LLAMA_BLOCK, biases=True),
    # llama.cpp runs Gemma's MLP with its tanh-approximated GELU (LLM_FFN_GELU).
    "gemma": GGUFArchitecture("GemmaForCausalLM", "gemma", MappingProxyType({**_ATTENTION_TENSORS, **_GATED_MLP_TENSORS,
                                                                  **_LLAMA_NORMS}),
                   norm_offset=1.0, hidden_act="gelu_pytorch_tanh"),
    "gemma2": GGUFArchitecture("Gemma2ForCausalLM", "gemma2", _GEMMA2_BLOCK, norm_offset=1.0, hidden_act="gelu_pytorch_tanh"),
    "gemma3": GGUFArchitecture("Gemma3ForCausalLM", "gemma3_text", MappingProxyType({**_GEMMA2_BLOCK, **_QK_NORM_TENSORS}),
                    norm_offset=1.0, hidden_act="gelu_pytorch_tanh"),
    "phi3": GGUFArchitecture("Phi3ForCausalLM", "phi3", _PHI3_TENSORS, partial_rotary=True),
    # Llama's layout (the converter subclasses Llama's: q/k permuted) with four multipliers (_granite_config).
    "granite": GGUFArchitecture("GraniteForCausalLM", "granite", _LLAMA_NO_QK_NORM, permuted_qk=True, biases=True),
    # Granite's layout and multipliers with routed experts (split from HF's input_linear by the converter).
    "granitemoe": GGUFArchitecture(*MOE_MODELS["granitemoe"], MappingProxyType({**_MOE_ATTENTION, **MOE_TENSORS}),
                                   permuted_qk=True, biases=True),
    # Qwen2's biased q/k/v with routed experts and a sigmoid-gated shared expert; Qwen3's q/k norms with routed ones.
    "qwen2moe": GGUFArchitecture(*MOE_MODELS["qwen2moe"], MappingProxyType({
        **_MOE_ATTENTION, **MOE_TENSORS, **SHARED_EXPERT_TENSORS}), biases=True),
    "qwen3moe": GGUFArchitecture(*MOE_MODELS["qwen3moe"], MappingProxyType({
        **_MOE_ATTENTION, **_QK_NORM_TENSORS, **MOE_TENSORS}), biases=True),
    # Olmo2ForCausalLM, or Olmo3ForCausalLM where the file names a sliding window (_olmo2_config).
    "olmo2": GGUFArchitecture("Olmo2ForCausalLM", "olmo2", _OLMO2_TENSORS, qk_norm="projection"),
    # Llama's layout (q/k permuted), every fourth layer without RoPE (_smollm3_config).
    "smollm3": GGUFArchitecture("SmolLM3ForCausalLM", "smollm3", _LLAMA_NO_QK_NORM, permuted_qk=True),
    # llama.cpp runs these MLPs with its tanh-approximated GELU (LLM_FFN_GELU), GPT-NeoX's too (Pythia's HF configs
    # say the exact "gelu"); their RoPE is NEOX (q/k stored as HF has them). See _layernorm_config.
    "gptneox": GGUFArchitecture("GPTNeoXForCausalLM", "gpt_neox", _GPTNEOX_TENSORS, biases=True,
                                hidden_act="gelu_pytorch_tanh", layer_norm=True, partial_rotary=True,
                                split_fused=True),
    "phi2": GGUFArchitecture("PhiForCausalLM", "phi", _PHI2_TENSORS, biases=True, hidden_act="gelu_new",
                             layer_norm=True, partial_rotary=True, split_fused=True),
    "stablelm": GGUFArchitecture("StableLmForCausalLM", "stablelm", _LLAMA_BLOCK, biases=True, qk_norm="per_head",
                                 layer_norm=True, partial_rotary=True),
    "starcoder2": GGUFArchitecture("Starcoder2ForCausalLM", "starcoder2", _STARCODER2_TENSORS, biases=True,
                                   hidden_act="gelu_pytorch_tanh", layer_norm=True),
    # DeepSeek-V2 / V3 (MLA, shared + routed experts): DeepseekV3ForCausalLM where routing is sigmoid
    # (gguf_deepseek.deepseek2_config); q/k stored as HF has them; no biases (llama.cpp loads none).
    "deepseek2": GGUFArchitecture("DeepseekV2ForCausalLM", "deepseek_v2", DEEPSEEK2_TENSORS),
    # GPT-OSS (attention sinks, biased experts, MXFP4 experts served from their blocks on the CPU): gguf_gpt_oss.py.
    "gpt-oss": GGUFArchitecture("GptOssForCausalLM", "gpt_oss", GPT_OSS_TENSORS, biases=True),
    # State-space models (gguf_mamba.py maps their tensors and builds their configs); granitehybrid's q/k are
    # permuted as Llama's (nemotron_h's too, without RoPE); jamba's are not (JambaModel writes them as HF has them).
    **{arch: GGUFArchitecture(*SSM_MODELS[arch], MappingProxyType({}),
                              permuted_qk=arch not in ("mamba", "mamba2", "jamba"))
       for arch in SSM_ARCHITECTURES},
})
SUPPORTED_GGUF_ARCHITECTURES: tuple[str, ...] = tuple(GGUF_ARCHITECTURES)

def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    """Scalar or string metadata value ``key`` (``default`` when absent)."""
    field = reader.fields.get(key)
    if field is None or not field.data:
        return default
    if hasattr(field, "contents"):
        return field.contents()
    part = field.parts[field.data[0]]
    if part.dtype == np.uint8 and len(field.types) and field.types[0].name == "STRING":
        return bytes(part).decode("utf-8")
    return part.tolist()[0]


def gguf_array_len(reader: Any, key: str) -> int | None:
    """Length of an array metadata value (e.g. the token list) without decoding it."""
    field = reader.fields.get(key)
    return None if field is None else len(field.data)


def _is_array_field(reader: Any, key: str) -> bool:
    field = reader.fields.get(key)
    return field is not None and len(field.types) > 0 and field.types[0].name == "ARRAY"


def gguf_array(reader: Any, key: str) -> list[Any] | None:
    """Numeric or string array metadata value ``key`` as a list (None when absent or not an array)."""
    if not _is_array_field(reader, key):
        return None
    field = reader.fields[key]
    if hasattr(field, "contents"):
        return list(field.contents())
    return [field.parts[i].tolist()[0] for i in field.data]


# --------------------------------------------------------------------------------------------
# Config

#: llama.cpp's period of local/global layers when a file names none (llama_model_gemma2/3/olmo2::load_arch_hparams).
_SLIDING_PERIOD: Mapping[str, int] = MappingProxyType({"gemma2": 2, "gemma3": 6, "olmo2": 4, "gpt-oss": 2})
#: SmolLM3: llama.cpp skips RoPE on layer i where (i + 1) % 4 == 0 (hard-coded n_no_rope_layer_step; no key).
_SMOLLM3_NO_ROPE_STEP = 4
#: Gemma 2's window when a file names none (llama.cpp's default; Gemma 2's 4096).
_GEMMA2_DEFAULT_WINDOW = 4096
#: Layer counts of Gemma 2 27B and Gemma 3 27B. GGUF has no key for query_pre_attn_scalar: llama.cpp scales queries
#: by (hidden / heads)**-0.5 for these (as their HF configs, 144 and 168) and by head_dim**-0.5 otherwise.
_GEMMA_27B_LAYERS: Mapping[str, int] = MappingProxyType({"gemma2": 46, "gemma3": 62})
#: Gemma 3's local RoPE base when a file names none (llama_hparams::rope_freq_base_train_swa).
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GGUFModelInfo:
    """The pieces of GGUF metadata the conversion needs."""

    config: dict[str, Any]
    n_head: int
    n_head_kv: int
    eos_token_ids: list[int]
    has_tokenizer: bool
    chat_template: str | None
    #: q_proj/k_proj rows in llama.cpp's interleaved RoPE order (Llama): un-permuted when read.
    permuted_qk: bool = True
    arch: str = "llama"
    #: subtracted from every ``*norm.weight`` when read (Gemma's norms are stored with +1)
    norm_offset: float = 0.0


def build_config(reader: Any, path: Path) -> GGUFModelInfo:
    """Build an HF config dict (Llama, Qwen2/3, Gemma 1/2/3, Phi-3, Granite, OLMo 2/3, SmolLM3, GPT-NeoX, Phi-2,
    StableLM, StarCoder2, or the mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE, Granite MoE, DeepSeek-V2 / V3 and
    GPT-OSS)
    from GGUF metadata, as llama.cpp reads it."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"Unsupported GGUF architecture {arch!r} in {path}; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    spec = GGUF_ARCHITECTURES[arch]
    split_count = gguf_field(reader, "split.count", 1)
    if split_count and int(split_count) > 1:
        raise ValueError(
            f"{path} is one part of a split GGUF ({split_count} parts); merge it first "
            "(llama-gguf-split --merge) and pass the merged file"
        )

    if arch in SSM_ARCHITECTURES:
        return _ssm_info(reader, arch, spec, path)

    def req(key: str) -> Any:
        v = gguf_field(reader, f"{arch}.{key}")
        if v is None:
            raise ValueError(f"{path} is not a valid GGUF file: missing metadata key '{arch}.{key}'")
        return v

    hidden = int(req("embedding_length"))
    n_head = int(req("attention.head_count"))
    n_head_kv = int(gguf_field(reader, f"{arch}.attention.head_count_kv", n_head))
    key_length = int(gguf_field(reader, f"{arch}.attention.key_length", 0) or 0)
    head_dim = key_length or hidden // n_head
    value_length = int(gguf_field(reader, f"{arch}.attention.value_length", 0) or 0)
    if value_length and value_length != head_dim and arch != "deepseek2":  # (MLA: gguf_deepseek)
        keys = (f"{arch}.attention.key_length = {key_length}" if key_length
                else f"a key length of embedding_length / head_count = {head_dim} ({arch}.attention.key_length unset)")
        raise ValueError(
            f"{path} has {keys} but {arch}.attention.value_length = {value_length}: keys and values of different "
            f"head sizes are not supported (pagedllm runs one head_dim for both; the two must be equal)"
        )
    tensor_names = {t.name for t in reader.tensors}
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ValueError(f"{path} is not a valid GGUF file: no 'token_embd.weight' tensor")
    vocab_size = int(embd.shape[-1])  # GGUF shape is (ne0=hidden, ne1=vocab)
    n_tokens = gguf_array_len(reader, "tokenizer.ggml.tokens")
    if n_tokens is not None and n_tokens != vocab_size:
        logger.warning("GGUF token list has %d entries but the embedding has %d rows", n_tokens, vocab_size)

    rope_theta = float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0))
    rope_scaling: dict[str, Any] | None = None
    # As llama.cpp: a factor without a type is linear scaling; `rope.scale_linear` is the factor's old key.
    factor = gguf_field(reader, f"{arch}.rope.scaling.factor", gguf_field(reader, f"{arch}.rope.scale_linear"))
    scaling_type = gguf_field(reader, f"{arch}.rope.scaling.type", "linear" if factor else None)
    if scaling_type in ("linear", "yarn") and factor and float(factor) != 1.0:
        rope_scaling = {"rope_type": scaling_type, "factor": float(factor)}
        orig = gguf_field(reader, f"{arch}.rope.scaling.original_context_length")
        if scaling_type == "yarn" and orig:
            rope_scaling["original_max_position_embeddings"] = int(orig)
    elif scaling_type == "longrope" and arch == "phi3":
        pass  # the rope_factors tensors carry it (_phi3_config)
    elif scaling_type not in (None, "none", "linear", "yarn"):
        allowed = "linear, yarn" + (", longrope" if arch == "phi3" else "")
        raise ValueError(f"Unsupported RoPE scaling type {scaling_type!r} in {path}; supported: {allowed}")
    n_rot = gguf_field(reader, f"{arch}.rope.dimension_count")
    if n_rot is not None and int(n_rot) != head_dim and not spec.partial_rotary and arch != "deepseek2":
        partial = [a for a, s in GGUF_ARCHITECTURES.items() if s.partial_rotary and a != "phi3"]
        raise ValueError(
            f"{path} rotates {n_rot} of each head's {head_dim} dimensions ({arch}.rope.dimension_count); partial "
            f"rotary embeddings are supported for phi3 only (and the LayerNorm architectures {', '.join(partial)}), "
            f"architecture {arch!r} must rotate whole heads"
        )

    bos, eos_ids, pad = _special_tokens(reader)
    config: dict[str, Any] = {
        "architectures": [spec.hf_arch],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(req("feed_forward_length")),
        "num_hidden_layers": int(req("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_head_kv,
        "head_dim": head_dim,
        "hidden_act": spec.hidden_act,
        "max_position_embeddings": int(gguf_field(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    if spec.biases and not spec.layer_norm:  # (the LayerNorm families name theirs: _layernorm_config)
        # transformers' attention_bias biases q, k, v and o (Qwen2's q/k/v are biased whatever it says)
        qkv_biased = "blk.0.attn_q.bias" in tensor_names or spec.hf_arch == "Qwen2ForCausalLM"
        config["attention_bias"] = qkv_biased and "blk.0.attn_output.bias" in tensor_names
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
    config.update({
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "pad_token_id": None if pad is None else int(pad),
        "torch_dtype": "float32",
    })
    if arch in ("gemma", "gemma2", "gemma3"):
        config.update(_gemma_config(reader, arch, config, path))
    elif arch == "phi3":
        config.update(_phi3_config(reader, config, None if n_rot is None else int(n_rot), scaling_type, path))
    elif arch in ("granite", "granitemoe"):
        config.update(_granite_config(reader, config, path, arch))
    elif arch == "olmo2":
        config = _olmo2_config(reader, config, path)
    elif arch == "smollm3":
        config.update(_smollm3_config(config))
    elif spec.layer_norm:
        config = _layernorm_config(reader, arch, config, tensor_names, None if n_rot is None else int(n_rot), path)
    elif arch == "deepseek2":
        config = deepseek2_config(lambda key, default: gguf_field(reader, key, default), config, tensor_names, path)
    elif arch == "gpt-oss":
        config.update(gpt_oss_config(lambda key, default: gguf_field(reader, key, default), config,
                                     {t.name: t.tensor_type.name for t in reader.tensors},
                                     _sliding_layer_types(reader, arch, config["num_hidden_layers"], path), path))
    if arch in MOE_MODELS:
        config.update(moe_config(lambda key, default: gguf_field(reader, key, default), arch, config, tensor_names,
                                 path))
    return GGUFModelInfo(
        config=config,
        n_head=n_head,
        n_head_kv=n_head_kv,
        eos_token_ids=eos_ids,
        has_tokenizer=gguf_field(reader, "tokenizer.ggml.model") is not None,
        chat_template=gguf_field(reader, "tokenizer.chat_template"),
        permuted_qk=spec.permuted_qk,
        arch=arch,
        norm_offset=spec.norm_offset,
    )


def _special_tokens(reader: Any) -> tuple[int | None, list[int], int | None]:
    """The file's BOS id, its end-of-generation ids (EOS, EOT, EOM; deduplicated) and its padding id."""
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    pad = gguf_field(reader, "tokenizer.ggml.padding_token_id")
    eos_ids = [int(x) for x in (gguf_field(reader, "tokenizer.ggml.eos_token_id"),
                                gguf_field(reader, "tokenizer.ggml.eot_token_id"),
                                gguf_field(reader, "tokenizer.ggml.eom_token_id")) if x is not None]
    return None if bos is None else int(bos), list(dict.fromkeys(eos_ids)), None if pad is None else int(pad)


def _ssm_info(reader: Any, arch: str, spec: GGUFArchitecture, path: Path) -> GGUFModelInfo:
    """A state-space file's model info (its config: gguf_mamba.ssm_config)."""
    shapes = {t.name: tuple(int(s) for s in reversed(t.shape.tolist())) for t in reader.tensors}
    config = ssm_config(lambda key, default: gguf_field(reader, key, default), lambda key: gguf_array(reader, key),
                        arch, shapes, path)
    bos, eos_ids, pad = _special_tokens(reader)
    config.update(bos_token_id=bos, eos_token_id=eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
                  pad_token_id=pad)
    n_head = int(config.get("num_attention_heads", 0))
    return GGUFModelInfo(config=config, n_head=n_head, n_head_kv=int(config.get("num_key_value_heads", 0)),
                         eos_token_ids=eos_ids, has_tokenizer=gguf_field(reader, "tokenizer.ggml.model") is not None,
                         chat_template=gguf_field(reader, "tokenizer.chat_template"), permuted_qk=spec.permuted_qk,
                         arch=arch)


def _sliding_layer_types(reader: Any, arch: str, n_layers: int, path: Path) -> list[str]:
    """Each layer's attention type as llama.cpp sets it (``llama_hparams::set_swa_pattern``):
    ``attention.sliding_window_pattern`` is a flag per layer, or a period n (layer i is global when
    i % n == n - 1; 0: every layer local); absent, the architecture's default period (Gemma 2: 2, Gemma 3: 6)."""
    key = f"{arch}.attention.sliding_window_pattern"
    flags = gguf_array(reader, key)
    if flags is not None:
        if len(flags) != n_layers:
            raise ValueError(f"{path}: {key} has {len(flags)} per-layer flags, the model has {n_layers} layers")
        local = [bool(f) for f in flags]
    else:
        period = int(gguf_field(reader, key, _SLIDING_PERIOD[arch]))
        local = [period == 0 or i % period < period - 1 for i in range(n_layers)]
    return [SLIDING if is_local else FULL for is_local in local]


def _gemma_config(reader: Any, arch: str, base: dict[str, Any], path: Path) -> dict[str, Any]:
    """Gemma 1/2/3 settings llama.cpp's converter stores (or llama.cpp hard-codes), as transformers names them."""
    out: dict[str, Any] = {"hidden_activation": GGUF_ARCHITECTURES[arch].hidden_act}
    if arch == "gemma":
        return out
    n_layers, hidden, n_head = base["num_hidden_layers"], base["hidden_size"], base["num_attention_heads"]

    def opt(key: str, default: Any = None) -> Any:
        return gguf_field(reader, f"{arch}.{key}", default)

    out["query_pre_attn_scalar"] = hidden // n_head if n_layers == _GEMMA_27B_LAYERS[arch] else base["head_dim"]
    window = int(opt("attention.sliding_window", _GEMMA2_DEFAULT_WINDOW if arch == "gemma2" else 0) or 0)
    if arch == "gemma2":
        if window <= 0:
            raise ValueError(f"{path}: gemma2.attention.sliding_window is {window}; Gemma 2's local layers need a "
                             "positive window")
        local_base = opt("rope.freq_base_swa")
        if local_base is not None and float(local_base) != base["rope_theta"]:
            raise ValueError(
                f"{path}: gemma2.rope.freq_base_swa = {local_base} differs from rope.freq_base = {base['rope_theta']}; "
                "a separate local RoPE base is supported for gemma3 only (Gemma 2 has one base)"
            )
        attn_cap, final_cap = float(opt("attn_logit_softcapping", 50.0)), float(opt("final_logit_softcapping", 30.0))
        out.update(sliding_window=window, layer_types=_sliding_layer_types(reader, arch, n_layers, path),
                   attn_logit_softcapping=attn_cap or None, final_logit_softcapping=final_cap or None)
        return out
    # Gemma 3: no attention soft cap; a final one only where the file sets it; local layers only with a window.
    final_cap = float(opt("final_logit_softcapping", 0.0))
    out.update(attn_logit_softcapping=None, final_logit_softcapping=final_cap or None)
    if window > 0:
        out.update(sliding_window=window, layer_types=_sliding_layer_types(reader, arch, n_layers, path),
                   rope_local_base_freq=float(opt("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE)))
    else:
        out.update(sliding_window=None, layer_types=[FULL] * n_layers)
    return out


def _arch_key(key: str, arch: str) -> str:
    """A gguf-py key template (``gguf.Keys``: ``"{arch}.logit_scale"``) for architecture ``arch``."""
    return key.format(arch=arch)


def _granite_config(reader: Any, base: dict[str, Any], path: Path, arch: str = "granite") -> dict[str, Any]:
    """Granite's (and Granite MoE's) multipliers as llama.cpp reads them (llama_model_granite): an embedding or
    residual scale that is absent or 0 multiplies by 1, an attention scale that is absent or 0 is head_dim**-0.5, and
    the logit scale (the logits are divided by it) is required."""
    from gguf import Keys

    def scale(template: str, default: float) -> float:
        key = _arch_key(template, arch)
        value = gguf_field(reader, key)
        value = 0.0 if value is None else float(value)
        if not math.isfinite(value):
            raise ValueError(f"{path}: {key} = {value}; it must be a finite number")
        return value or default

    finetuned_key = _arch_key(Keys.Rope.SCALING_FINETUNED, arch)
    finetuned = gguf_field(reader, finetuned_key)
    if finetuned is not None and not bool(finetuned):
        raise ValueError(f"{path}: {finetuned_key} is false, which turns RoPE off on every layer in llama.cpp; "
                         "GraniteForCausalLM always applies RoPE (only files with RoPE are supported)")
    logit_key = _arch_key(Keys.LLM.LOGIT_SCALE, arch)
    if gguf_field(reader, logit_key) is None:
        raise ValueError(f"{path} is not a valid GGUF file: missing metadata key {logit_key!r} (Granite's logits "
                         "are divided by it; llama.cpp requires it)")
    logits_scaling = scale(Keys.LLM.LOGIT_SCALE, 0.0)
    if logits_scaling == 0.0:
        raise ValueError(f"{path}: {logit_key} is 0; Granite divides its logits by it, it must be non-zero")
    return {
        "embedding_multiplier": scale(Keys.LLM.EMBEDDING_SCALE, 1.0),
        "residual_multiplier": scale(Keys.LLM.RESIDUAL_SCALE, 1.0),
        "attention_multiplier": scale(Keys.Attention.SCALE, base["head_dim"] ** -0.5),
        "logits_scaling": logits_scaling,
    }


def _olmo2_config(reader: Any, base: dict[str, Any], path: Path) -> dict[str, Any]:
    """OLMo 2, or OLMo 3 where the file names a positive sliding window (llama.cpp runs both as `olmo2`): OLMo 3's
    layer types from attention.sliding_window_pattern (default: every fourth layer global), its local layers' RoPE
    at rope.freq_base_swa (default: the global base) without the global layers' scaling, as llama.cpp does."""
    from gguf import Keys

    window_key = _arch_key(Keys.Attention.SLIDING_WINDOW, "olmo2")
    window = int(gguf_field(reader, window_key, 0) or 0)
    if window <= 0:
        return base
    out = {k: v for k, v in base.items() if k not in ("rope_theta", "rope_scaling")}
    full: dict[str, Any] = {"rope_type": "default", **(base["rope_scaling"] or {}), "rope_theta": base["rope_theta"]}
    local_base = float(gguf_field(reader, _arch_key(Keys.Rope.FREQ_BASE_SWA, "olmo2"), base["rope_theta"]))
    out.update(
        architectures=["Olmo3ForCausalLM"], model_type="olmo3", sliding_window=window,
        layer_types=_sliding_layer_types(reader, "olmo2", base["num_hidden_layers"], path),
        rope_parameters={"full_attention": full, "sliding_attention": {"rope_type": "default",
                                                                       "rope_theta": local_base}},
    )
    return out


def _smollm3_config(base: dict[str, Any]) -> dict[str, Any]:
    """SmolLM3's layers without RoPE, as llama.cpp hard-codes them (no metadata key), and no window (llama.cpp's
    smollm3 attends to the whole context)."""
    n_layers = base["num_hidden_layers"]
    return {"no_rope_layers": [int((i + 1) % _SMOLLM3_NO_ROPE_STEP != 0) for i in range(n_layers)],
            "no_rope_layer_interval": _SMOLLM3_NO_ROPE_STEP, "use_sliding_window": False, "sliding_window": None}


def _layernorm_config(reader: Any, arch: str, base: dict[str, Any], tensor_names: set[str], n_rot: int | None,
                      path: Path) -> dict[str, Any]:
    """GPT-NeoX, Phi-2, StableLM and StarCoder2 as llama.cpp reads them: the LayerNorm epsilon (required), the rotated
    part of each head, and what llama.cpp tells from the tensors present (biases; StableLM's per-head q/k norms and,
    without ffn_norm, its parallel residual). GPT-NeoX's parallel residual is a required key. StarCoder2's files name
    no window: llama.cpp attends to the whole context (HF's StarCoder2 config has a 4096-token window)."""
    from gguf import Keys

    eps_key = _arch_key(Keys.Attention.LAYERNORM_EPS, arch)
    eps = gguf_field(reader, eps_key)
    if eps is None:
        raise ValueError(f"{path} is not a valid GGUF file: missing metadata key {eps_key!r}")
    out = {k: v for k, v in base.items() if k not in ("rms_norm_eps", "rope_theta", "rope_scaling")}
    head_dim = base["head_dim"]
    rotary = head_dim if n_rot is None else n_rot
    if not 0 < rotary <= head_dim or rotary % 2:
        raise ValueError(f"{path}: {arch}.rope.dimension_count = {rotary}; it must be even and at most head_dim "
                         f"({head_dim})")
    # Always named, in rope_parameters: these configs' defaults rotate part of each head (GPT-NeoX ¼, Phi ½,
    # StableLM ¼) and GPT-NeoX's reads its base from another key (rotary_emb_base).
    out["rope_parameters"] = {"rope_type": "default", **(base["rope_scaling"] or {}), "rope_theta": base["rope_theta"],
                              "partial_rotary_factor": rotary / head_dim}

    def has(name: str) -> bool:
        return f"blk.0.{name}" in tensor_names

    if arch == "gptneox":
        key = _arch_key(Keys.LLM.USE_PARALLEL_RESIDUAL, arch)
        parallel = gguf_field(reader, key)
        if parallel is None:
            raise ValueError(f"{path} is not a valid GGUF file: missing metadata key {key!r}")
        if base["num_key_value_heads"] != base["num_attention_heads"]:
            raise ValueError(f"{path}: GPT-NeoX has one KV head per query head; {arch}.attention.head_count_kv = "
                             f"{base['num_key_value_heads']} of {base['num_attention_heads']}")
        out.update(layer_norm_eps=float(eps), use_parallel_residual=bool(parallel),
                   attention_bias=has("attn_qkv.bias"))
    elif arch == "phi2":
        out.update(layer_norm_eps=float(eps), qk_layernorm=False)
    elif arch == "stablelm":
        out.update(layer_norm_eps=float(eps), use_qkv_bias=has("attn_q.bias"), qk_layernorm=has("attn_q_norm.weight"),
                   use_parallel_residual=not has("ffn_norm.weight"))
    else:  # starcoder2
        out.update(norm_epsilon=float(eps), use_bias=has("attn_output.bias"), sliding_window=None)
    return out


def _longrope_default_attention_factor(max_pos: int, original: int) -> float:
    """LongRoPE's cos/sin factor from the context extension (llama.cpp's converter and transformers agree)."""
    scale = max_pos / original
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0


def _phi3_config(reader: Any, base: dict[str, Any], n_rot: int | None, scaling_type: str | None,
                 path: Path) -> dict[str, Any]:
    """Phi-3 / Phi-3.5 / Phi-4-mini settings: the window, partial rotary (Phi-4-mini) and LongRoPE (128k models)."""
    head_dim = base["head_dim"]
    out: dict[str, Any] = {}
    # HF's Phi-3 attends within the window (llama.cpp currently ignores it); 0 marks Phi-4's files: no window.
    window = int(gguf_field(reader, "phi3.attention.sliding_window", 0) or 0)
    out["sliding_window"] = window if window > 0 else None
    rotary = head_dim if n_rot is None else n_rot
    if rotary != head_dim:
        if not 0 < rotary < head_dim or rotary % 2:
            raise ValueError(f"{path}: phi3.rope.dimension_count = {rotary}; it must be even and at most head_dim "
                             f"({head_dim})")
        out["partial_rotary_factor"] = rotary / head_dim
    original = gguf_field(reader, "phi3.rope.scaling.original_context_length")
    if original:
        out["original_max_position_embeddings"] = int(original)
    factors = {t.name: t for t in reader.tensors if t.name in ROPE_FACTOR_TENSORS}
    if not factors:
        if scaling_type == "longrope":
            raise ValueError(f"{path} names LongRoPE scaling but has no {' / '.join(ROPE_FACTOR_TENSORS)} tensors")
        return out
    long_name, short_name = ROPE_FACTOR_TENSORS
    if set(factors) != set(ROPE_FACTOR_TENSORS):
        raise ValueError(f"{path} has {', '.join(sorted(factors))} but LongRoPE needs both {long_name} and "
                         f"{short_name}")
    if base["rope_scaling"] is not None:
        raise ValueError(f"{path} has LongRoPE factor tensors and {base['rope_scaling']['rope_type']} RoPE scaling; "
                         "only one scaling can apply")
    if not original:
        raise ValueError(f"{path} has LongRoPE factor tensors but no phi3.rope.scaling.original_context_length "
                         "(the pretraining length that picks the long or short factors)")
    from gguf.quants import dequantize

    lists = {}
    for name, t in factors.items():
        values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-1)
        if values.size != rotary // 2:
            raise ValueError(f"{path}: {name} has {values.size} factors; LongRoPE needs rotated dimensions / 2 = "
                             f"{rotary // 2}")
        lists[name] = [float(v) for v in values]
    scaling: dict[str, Any] = {"rope_type": "longrope", "long_factor": lists[long_name],
                               "short_factor": lists[short_name]}
    attn_factor = gguf_field(reader, "phi3.rope.scaling.attn_factor")
    default = _longrope_default_attention_factor(base["max_position_embeddings"], int(original))
    # The file stores the factor as float32: keep transformers' own computation unless the file's differs from it.
    if attn_factor is not None and not math.isclose(float(attn_factor), default, rel_tol=1e-6):
        scaling["attention_factor"] = float(attn_factor)
    out["rope_scaling"] = scaling
    return out
