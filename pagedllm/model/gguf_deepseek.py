"""llama.cpp's ``deepseek2`` GGUF files (DeepSeek-V2 / V2-Lite / V2.5 / V3 / R1 as convert_hf_to_gguf.py's
DeepseekV2Model writes them) as transformers' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM (models/deepseek_v2.py).

What the converter writes: MLA's ranks (``attention.q_lora_rank``, absent without q compression;
``attention.kv_lora_rank``) and head sizes, in one of two forms. Files from before llama.cpp's MLA absorption (spring
2025) store HF's ``kv_b_proj`` as ``attn_kv_b`` with ``attention.key_length`` = qk_nope + qk_rope and
``attention.value_length`` = v_head_dim per head; newer ones set ``attention.head_count_kv`` = 1,
``attention.key_length`` = kv_lora_rank + qk_rope and ``attention.value_length`` = kv_lora_rank (the latent MQA
llama.cpp runs), the per-head sizes in ``attention.key_length_mla`` / ``value_length_mla``, and split kv_b_proj
per head into ``attn_k_b`` [heads, kv_lora_rank, qk_nope] (W_UK transposed) and ``attn_v_b`` [heads, v_head_dim,
kv_lora_rank] (numpy order), which the conversion joins back into kv_b_proj [heads · (qk_nope + v), kv_lora_rank].
``rope.dimension_count`` is qk_rope_head_dim; q/k rows are not permuted (DeepSeek's RoPE rotates interleaved pairs,
as llama.cpp's NORM RoPE). MoE: ``leading_dense_block_count`` (first_k_dense_replace), ``expert_feed_forward_length``
(moe_intermediate_size), ``expert_count`` / ``expert_used_count`` / ``expert_shared_count``,
``expert_weights_scale`` (routed_scaling_factor, absent: 1), ``expert_weights_norm`` (norm_topk_prob, absent:
false), ``expert_gating_func`` (1 softmax: V2; 2 sigmoid: V3; absent: softmax, as llama.cpp reads V2 / V2.5 files
without it, but sigmoid for GLM-4.7 Lite's shape, as llama.cpp), ``expert_group_count`` / ``expert_group_used_count`` (n_group / topk_group); V3's
e_score_correction_bias as ``exp_probs_b.bias``. YaRN: ``rope.scaling.{type,factor,original_context_length}`` and
``rope.scaling.yarn_log_multiplier`` = 0.1 · mscale_all_dim (DeepSeek's mscale equals it in every released config:
the file keeps only the one).

Where transformers and llama.cpp differ, transformers (which the tests compare with) is followed: the latent norms'
epsilon is 1e-6 (llama.cpp: the file's rms epsilon; every DeepSeek config says 1e-6); DeepSeek-V2 with groups routes
group-limited greedy (a group scored by its best expert) where n_group > 1 and topk_group < n_group, greedy
otherwise (the file names no topk_method).
"""
from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

import numpy as np

from pagedllm.model.gguf_moe import MOE_TENSORS

#: Block tensors → HF names (DeepseekV2 / V3 modeling). ``attn_k_b`` / ``attn_v_b`` map to names no module has:
#: the conversion joins them into kv_b_proj (:func:`join_kv_b`).
DEEPSEEK2_TENSORS: Mapping[str, str] = MappingProxyType({
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",  # the leading dense layers
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    **MOE_TENSORS,
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
})
#: V3's router correction bias: ``blk.N.exp_probs_b.bias`` (the converter renames e_score_correction_bias to
#: e_score_correction.bias, which gguf-py maps to exp_probs_b).
CORRECTION_BIAS = ("exp_probs_b", "mlp.gate.e_score_correction_bias")
K_B, V_B = ".self_attn.k_b_proj.weight", ".self_attn.v_b_proj.weight"
_SOFTMAX, _SIGMOID = 1, 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE
_GLM47_LITE_VOCAB = 154880  # llama.cpp's test for GLM-4.7 Lite files without expert_gating_func (47 or 48 layers)


def deepseek2_config(field: Callable[[str, Any], Any], base: dict[str, Any], tensor_names: set[str],
                     path: Path) -> dict[str, Any]:
    """The DeepseekV2Config / DeepseekV3Config fields of a ``deepseek2`` file (``field(key, default)``: its
    metadata), over the common ones in ``base``."""
    arch = "deepseek2"

    def opt(key: str, default: Any = None) -> Any:
        return field(f"{arch}.{key}", default)

    def req(key: str) -> Any:
        v = opt(key)
        if v is None:
            raise ValueError(f"{path} is not a valid GGUF file: missing metadata key '{arch}.{key}'")
        return v

    def has(name: str) -> bool:
        return f"blk.0.{name}.weight" in tensor_names

    n_head, hidden = base["num_attention_heads"], base["hidden_size"]
    kv_lora = int(req("attention.kv_lora_rank"))
    rope = int(req("rope.dimension_count"))
    key_length = int(opt("attention.key_length", 0) or 0)
    value_length = int(opt("attention.value_length", 0) or 0)
    key_mla = int(opt("attention.key_length_mla", 0) or 0)
    if key_mla:  # the latent-MQA form: key/value_length are the cached row's widths, the per-head sizes are _mla
        if key_length and key_length != kv_lora + rope:
            raise ValueError(f"{path}: {arch}.attention.key_length = {key_length} with key_length_mla set; the "
                             f"MLA form's key is the latent row, kv_lora_rank + rope.dimension_count = "
                             f"{kv_lora + rope}")
        qk_head, v_head = key_mla, int(opt("attention.value_length_mla", 0) or 0) or key_mla
    else:  # the older form: per-head sizes (llama.cpp's defaults where absent: hidden / heads, the key's size)
        qk_head = key_length or hidden // n_head
        v_head = value_length or qk_head
    nope = qk_head - rope
    if rope <= 0 or rope % 2 or nope <= 0:
        raise ValueError(f"{path}: {arch}.rope.dimension_count = {rope} with a query/key head of {qk_head}; MLA needs "
                         f"an even rotary part smaller than the head (qk_nope_head_dim = head - rotary > 0)")
    n_head_kv = int(opt("attention.head_count_kv", n_head) or n_head)
    if n_head_kv not in (1, n_head):
        raise ValueError(f"{path}: {arch}.attention.head_count_kv = {n_head_kv}; DeepSeek's MLA files have 1 (the "
                         f"latent MQA of newer converters) or head_count = {n_head}")
    q_lora = int(opt("attention.q_lora_rank", 0) or 0)
    if has("attn_q_a") != bool(q_lora) or has("attn_q_a") == has("attn_q"):
        found = "attn_q_a / attn_q_b" if has("attn_q_a") else "attn_q" if has("attn_q") else "no query projection"
        raise ValueError(f"{path}: {arch}.attention.q_lora_rank = {q_lora or 'absent'} but blk.0 has {found}; "
                         "q compression means attn_q_a, attn_q_a_norm and attn_q_b, without it one attn_q")
    if not has("attn_kv_b") and not (has("attn_k_b") and has("attn_v_b")):
        raise ValueError(f"{path}: blk.0 has neither attn_kv_b nor the pair attn_k_b / attn_v_b (MLA's kv_b_proj)")

    n_expert = int(opt("expert_count", 0) or 0)
    if n_expert <= 0:
        raise ValueError(f"{path}: {arch}.expert_count is missing or 0; only DeepSeek MoE files (routed experts) are "
                         "supported")
    n_used = int(opt("expert_used_count", 0) or 0)
    if not 0 < n_used <= n_expert:
        raise ValueError(f"{path}: {arch}.expert_used_count = {n_used or 'missing'}; it must lie in [1, "
                         f"{arch}.expert_count = {n_expert}]")
    moe_ff = int(req("expert_feed_forward_length"))
    shared = int(opt("expert_shared_count", 0) or 0)
    has_shexp = any(n.endswith("ffn_gate_shexp.weight") for n in tensor_names)
    if bool(shared) != has_shexp:
        raise ValueError(f"{path}: {arch}.expert_shared_count = {shared} but the file has "
                         f"{'' if has_shexp else 'no '}ffn_*_shexp tensors")
    dense = int(opt("leading_dense_block_count", 0) or 0)
    gating = int(opt("expert_gating_func", 0) or 0)
    if not gating:  # llama.cpp: V2 / V2.5 files have none (softmax); GLM-4.7 Lite's, told by shape, route by sigmoid
        glm_lite = base["num_hidden_layers"] in (47, 48) and base["vocab_size"] == _GLM47_LITE_VOCAB
        gating = _SIGMOID if glm_lite else _SOFTMAX
    if gating not in (_SOFTMAX, _SIGMOID):
        raise ValueError(f"{path}: {arch}.expert_gating_func = {gating}; DeepSeek routes with 1 (softmax, V2) or 2 "
                         "(sigmoid, V3)")
    v3 = gating == _SIGMOID
    groups = int(opt("expert_group_count", 0) or 0) or 1
    topk_group = int(opt("expert_group_used_count", 0) or 0) or groups
    if v3 and not any(n.endswith(f"{CORRECTION_BIAS[0]}.bias") for n in tensor_names):
        raise ValueError(f"{path}: sigmoid routing (DeepSeek-V3) without the routers' correction biases "
                         f"(blk.N.{CORRECTION_BIAS[0]}.bias)")

    out = {k: v for k, v in base.items() if k not in ("head_dim", "rope_theta", "rope_scaling")}
    out.update(
        architectures=["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        model_type="deepseek_v3" if v3 else "deepseek_v2",
        num_key_value_heads=n_head,  # MLA: every head its own k_nope and v (kv_b_proj)
        q_lora_rank=q_lora or None, kv_lora_rank=kv_lora, qk_rope_head_dim=rope, qk_nope_head_dim=nope,
        v_head_dim=v_head, head_dim=rope,
        n_routed_experts=n_expert, num_experts_per_tok=n_used, moe_intermediate_size=moe_ff,
        n_shared_experts=shared, first_k_dense_replace=dense,
        routed_scaling_factor=float(opt("expert_weights_scale", 1.0) or 1.0),
        norm_topk_prob=bool(opt("expert_weights_norm", False)),
        n_group=groups, topk_group=topk_group, attention_bias=False, mlp_bias=False,
        rope_parameters=_rope_parameters(field, base, path),
    )
    if v3:
        out["rope_interleave"] = True  # llama.cpp's deepseek2 RoPE rotates interleaved pairs
    else:
        out["topk_method"] = "group_limited_greedy" if groups > 1 and topk_group < groups else "greedy"
    return out


def _rope_parameters(field: Callable[[str, Any], Any], base: dict[str, Any], path: Path) -> dict[str, Any]:
    """transformers' rope_parameters: the base, and YaRN with DeepSeek's mscale = mscale_all_dim = the file's
    yarn_log_multiplier / 0.1 (absent: transformers' plain YaRN) and beta_fast / beta_slow where the file has them."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": base["rope_theta"]}
    scaling = base["rope_scaling"]
    if scaling is None:
        return params
    if scaling["rope_type"] != "yarn":
        raise ValueError(f"{path}: {scaling['rope_type']} RoPE scaling in a deepseek2 file; DeepSeek uses YaRN")
    if "original_max_position_embeddings" not in scaling:
        raise ValueError(f"{path}: YaRN RoPE scaling without deepseek2.rope.scaling.original_context_length")
    params.update(scaling)
    log_mul = float(field("deepseek2.rope.scaling.yarn_log_multiplier", 0.0) or 0.0)
    if log_mul:
        params.update(mscale=log_mul / 0.1, mscale_all_dim=log_mul / 0.1)
    for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if (v := field(f"deepseek2.rope.scaling.{key}", None)) is not None:
            params[name] = float(v)
    return params


def mla_expected_shape(hf_name: str, cfg: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The HF shape an MLA attention tensor, a shared expert or the correction bias must have under ``cfg`` (None:
    not one of those, or not a DeepSeek config)."""
    if "kv_lora_rank" not in cfg:
        return None
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    rank, rope, nope, v = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    q_rank = cfg.get("q_lora_rank") or 0
    if ".mlp.shared_experts." in hf_name:
        ff = cfg["moe_intermediate_size"] * cfg["n_shared_experts"]
        return (h, ff) if ".down_proj." in hf_name else (ff, h)
    if hf_name.endswith(CORRECTION_BIAS[1]):
        return (cfg["n_routed_experts"],)
    module = hf_name.split(".")[-2]
    return {"q_proj": (heads * (nope + rope), h), "q_a_proj": (q_rank, h), "q_a_layernorm": (q_rank,),
            "q_b_proj": (heads * (nope + rope), q_rank), "kv_a_proj_with_mqa": (rank + rope, h),
            "kv_a_layernorm": (rank,), "kv_b_proj": (heads * (nope + v), rank), "o_proj": (h, heads * v),
            "k_b_proj": (heads, rank, nope), "v_b_proj": (heads, v, rank)}.get(module)


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """HF's kv_b_proj [heads · (qk_nope + v), kv_lora_rank] from the converter's attn_k_b [heads, kv_lora_rank,
    qk_nope] (each head's k_nope rows transposed) and attn_v_b [heads, v, kv_lora_rank]."""
    kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
    return np.ascontiguousarray(kv_b.reshape(-1, k_b.shape[1]), dtype=np.float32)
