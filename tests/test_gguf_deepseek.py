"""llama.cpp's `deepseek2` GGUF files (DeepSeek-V2 / V2-Lite / V2.5 / V3 / R1): tiny random DeepseekV2ForCausalLM /
DeepseekV3ForCausalLM models written as llama.cpp's converter (convert_hf_to_gguf.py, DeepseekV2Model) writes them,
served by pagedllm (MLA over the latent cache, DeepSeek MoE) and held to transformers on the same weights: greedy
tokens and log-probs, float32.

The converter's two forms are written: the older one (before llama.cpp's MLA absorption: attn_kv_b, head_count_kv =
heads, key/value_length the per-head sizes, no expert_gating_func: V2 files from before V3's support) and the newer
one (attn_kv_b split per head into attn_k_b [heads, kv_lora_rank, qk_nope] and attn_v_b [heads, v, kv_lora_rank],
head_count_kv 1, key/value_length the latent row's widths, the per-head sizes in key/value_length_mla). Tensor names
come from gguf-py's map (tests/gguf_writing.py); experts merged into ffn_{gate,up,down}_exps; V3's
e_score_correction_bias as exp_probs_b.bias; q/k not permuted. Q8_0 experts: served dequantized (quantization="none"),
transformers on the dequantized weights, and from their blocks (quantization="gguf").
"""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from gguf_writing import (
    ENGINE_KW,
    gguf,
    own_cache,  # noqa: F401 (autouse fixture: a cache directory per test)
    round_to,
    teacher_forced_ranks,
    write_gguf,
)
from test_gguf_gemma_phi3 import MAX_TOKENS, _assert_matches, _model, _ours
from test_gguf_more_families import VOCAB, _prompts
from test_models_hf import hf_greedy_reference

from pagedllm import LLM
from pagedllm.model.gguf_config import build_config
from pagedllm.model.gguf_loader import open_gguf
from pagedllm.model.layers.fused_moe import FusedMoE

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# 3 layers: a leading dense one, then MoE (8 experts of width 32, top 2); MLA with kv_lora_rank 32, heads of
# qk_nope 16 + qk_rope 8 (v 16).
_MLA = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
            first_k_dense_replace=1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            max_position_embeddings=128, rms_norm_eps=1e-6, attn_implementation="eager")
# Sequences of up to 30 + 10 tokens pass the original 32 positions. GGUF keeps one mscale (yarn_log_multiplier =
# 0.1 · mscale_all_dim): DeepSeek's configs have mscale = mscale_all_dim.
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32)

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # V2-Lite's layout: q_proj, greedy softmax top-2 of 8, two shared experts, plain RoPE.
    "v2-lite": ("DeepseekV2", {**_MLA, "q_lora_rank": None, "topk_method": "greedy", "n_shared_experts": 2}),
    # V2's: q LoRA, top-2 within the better of 2 groups (scored by the best expert), scaled weights, YaRN.
    "v2": ("DeepseekV2", {**_MLA, "q_lora_rank": 32, "topk_method": "group_limited_greedy", "n_group": 2,
                          "topk_group": 1, "routed_scaling_factor": 2.0, "n_shared_experts": 1,
                          "rope_parameters": {**_YARN, "mscale": 0.707, "mscale_all_dim": 0.707}}),
    # V3's: sigmoid scores, bias-corrected choice among the 2 best of 4 groups, renormalized and scaled weights, YaRN.
    "v3": ("DeepseekV3", {**_MLA, "q_lora_rank": 32, "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
                          "routed_scaling_factor": 2.5, "n_shared_experts": 1,
                          "rope_parameters": {**_YARN, "mscale": 1.0, "mscale_all_dim": 1.0}}),
}


def _hf_model(name: str, **overrides: Any) -> torch.nn.Module:
    """transformers' init at std 0.1, 1-D weights moved off 0 / 1, V3's correction bias (a buffer) randomized wide
    enough to change which experts are chosen."""
    family, kwargs = CASES[name]
    config = getattr(transformers, f"{family}Config")(vocab_size=VOCAB, initializer_range=0.1,
                                                       **{**kwargs, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=gen) * 0.3)
    model.generation_config.eos_token_id = None
    return model


# -- what convert_hf_to_gguf.py's DeepseekV2Model (and TextModel.set_gguf_parameters) writes ------------------------

def _metadata(w, cfg, split_kv_b: bool) -> None:
    """The metadata of the newer converter (``split_kv_b``: head_count_kv 1, the latent row's key/value lengths,
    the per-head ones as _mla keys, gating func from config.json's scoring_func, expert_weights_norm only when
    true) or of the older one (the per-head sizes, head_count_kv = heads, expert_weights_norm always; for V2 no gating
    func, as in files written before V3's support)."""
    v3 = isinstance(cfg, transformers.DeepseekV3Config)
    rope_params = cfg.rope_parameters
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1 if split_kv_b else cfg.num_key_value_heads)
    if rope_params.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope_params["factor"])
        w.add_rope_scaling_orig_ctx_len(rope_params["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope_params["mscale_all_dim"])
    w.add_rope_freq_base(rope_params["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if cfg.n_group is not None:
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    if split_kv_b or v3:  # (older files of V3 have it: the converter wrote it from V3's support on)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    qk_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if split_kv_b:
        w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(qk_head)
        w.add_value_length_mla(cfg.v_head_dim)
    else:
        w.add_key_length(qk_head)
        w.add_value_length(cfg.v_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob or not split_kv_b:
        w.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)


def _llama_cpp_tensors(model: torch.nn.Module, split_kv_b: bool) -> dict[str, torch.Tensor]:
    """transformers' tensors as the converter writes them, under names gguf-py's map knows: experts merged per
    projection ([E, I, H] gate / up, [E, H, I] down), e_score_correction_bias renamed to e_score_correction.bias
    (exp_probs_b.bias) and, with ``split_kv_b``, kv_b_proj split per head into k_b_proj (each head's k_nope rows
    transposed: [heads, kv_lora_rank, qk_nope]) and v_b_proj ([heads, v, kv_lora_rank])."""
    cfg = model.config
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name.endswith(".experts.gate_up_proj"):
            width = t.shape[1] // 2
            out[f"{name[: -len('gate_up_proj')]}gate_proj.weight"] = t[:, :width]
            out[f"{name[: -len('gate_up_proj')]}up_proj.weight"] = t[:, width:]
        elif name.endswith(".experts.down_proj"):
            out[f"{name}.weight"] = t
        elif name.endswith(".e_score_correction_bias"):
            out[name.replace("e_score_correction_bias", "e_score_correction.bias")] = t
        elif name.endswith("kv_b_proj.weight") and split_kv_b:
            heads, nope, v = cfg.num_key_value_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
            kv_b = t.view(heads, nope + v, t.shape[-1])
            k_b, v_b = torch.split(kv_b, [nope, v], dim=1)
            out[name.replace("kv_b_proj", "k_b_proj")] = k_b.transpose(1, 2)
            out[name.replace("kv_b_proj", "v_b_proj")] = v_b
        else:
            out[name] = t
    return out


def _write(model: torch.nn.Module, path: Path, split_kv_b: bool, **kw: Any) -> Path:
    return write_gguf(model, "deepseek2", path, partial(_metadata, cfg=model.config, split_kv_b=split_kv_b),
                      state_dict=_llama_cpp_tensors(model, split_kv_b), **kw)


def _tensor_names(path: Path) -> set[str]:
    return {t.name for t in gguf.GGUFReader(path).tensors}


# (case, the converter's newer form: attn_k_b / attn_v_b)
_FORMS = [("v2-lite", False), ("v2-lite", True), ("v2", True), ("v3", True), ("v3", False)]


@pytest.mark.parametrize("name,split_kv_b", _FORMS, ids=[f"{n}-{'k_b_v_b' if s else 'kv_b'}" for n, s in _FORMS])
def test_gguf_generates_what_transformers_does(name: str, split_kv_b: bool, tmp_path: Path) -> None:
    model = _hf_model(name)
    prompts = _prompts()
    want, logprobs = hf_greedy_reference(model, prompts, MAX_TOKENS)
    src = _write(model, tmp_path / f"{name}.gguf", split_kv_b)
    names = _tensor_names(src)
    assert ("blk.0.attn_k_b.weight" in names) == split_kv_b and ("blk.0.attn_kv_b.weight" in names) != split_kv_b
    assert ("blk.1.exp_probs_b.bias" in names) == (name == "v3")
    llm = LLM(model=str(src), **ENGINE_KW, quantization="none", block_size=4)
    ours = _model(llm)
    assert type(ours).__name__ == type(model).__name__
    kv_b = model.model.layers[2].self_attn.kv_b_proj.weight
    assert torch.equal(ours.model.layers[2].self_attn.kv_b_proj.weight.data, kv_b.detach())  # joined exactly
    _assert_matches(_ours(llm, prompts), want, logprobs)


def test_config_as_the_converter_wrote_it(tmp_path: Path) -> None:
    """build_config's DeepSeek fields from each form's metadata: the per-head sizes from key/value_length or their
    _mla keys, routing (V2: greedy, group-limited with groups; V3: sigmoid, correction bias, groups), YaRN's
    mscale from yarn_log_multiplier."""
    want = {"num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
            "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "first_k_dense_replace": 1, "intermediate_size": 128}
    for name, split_kv_b, extra in [
        ("v2-lite", False, {"model_type": "deepseek_v2", "q_lora_rank": None, "topk_method": "greedy",
                            "n_shared_experts": 2, "norm_topk_prob": False, "routed_scaling_factor": 1.0}),
        ("v2", True, {"model_type": "deepseek_v2", "q_lora_rank": 32, "topk_method": "group_limited_greedy",
                      "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.0}),
        ("v3", True, {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "n_group": 4,
                      "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
                      "rope_interleave": True}),
    ]:
        model = _hf_model(name)
        src = _write(model, tmp_path / f"{name}.gguf", split_kv_b)
        config = build_config(open_gguf(src), src).config
        assert {k: config[k] for k in {**want, **extra}} == {**want, **extra}, name
        rope = config["rope_parameters"]
        if name == "v2-lite":
            assert rope == {"rope_type": "default", "rope_theta": 10000.0}
        else:
            mscale = model.config.rope_parameters["mscale_all_dim"]
            assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0
            assert rope["original_max_position_embeddings"] == 32
            assert rope["mscale"] == rope["mscale_all_dim"] == pytest.approx(mscale, rel=1e-6)


def _q8_0_reference(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with what a file of Q8_0 layers stores: every layer matrix but the routers (kept float32 by the
    converter) at its Q8_0 values, kv_b_proj rounded as attn_k_b (along qk_nope, each head's k rows transposed) and
    attn_v_b (along kv_lora_rank) store it."""
    cfg = model.config
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layers." not in name or p.dim() == 1 or name.endswith(".mlp.gate.weight"):
                continue
            arr = p.detach().numpy()
            if name.endswith("kv_b_proj.weight"):
                nope = cfg.qk_nope_head_dim
                kv_b = arr.reshape(cfg.num_attention_heads, nope + cfg.v_head_dim, -1)
                k_b = round_to(np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)), "Q8_0").transpose(0, 2, 1)
                arr = np.concatenate([k_b, round_to(np.ascontiguousarray(kv_b[:, nope:]), "Q8_0")], axis=1)
            else:
                arr = round_to(arr, "Q8_0")
            p.copy_(torch.from_numpy(np.ascontiguousarray(arr).reshape(p.shape)))
    return model


def test_q8_0_file(tmp_path: Path) -> None:
    """V3 (newer form, qk_nope 32 so that attn_k_b's rows are whole Q8_0 blocks) with every layer matrix Q8_0 but
    the routers, attn_k_b / attn_v_b and the merged experts too: quantization="none" dequantizes them and is
    transformers on the dequantized weights; quantization="gguf" keeps the linears' and every expert's blocks (no
    float expert weights; kv_b_proj, absorbed, is served float) and holds the greedy path teacher-forced at >= 90 %
    of 8 prompts x 16 tokens (120 of 128 here: the misses are the Q8_0 linears' int8 activations, near ties but one;
    with the experts alone quantized, all 128 hold)."""
    model = _hf_model("v3", qk_nope_head_dim=32)
    prompts = _prompts((3, 7, 11, 15, 19, 23, 27, 30))
    src = _write(model, tmp_path / "v3-f32.gguf", True, q8_linears=True, experts_type="Q8_0")
    src = _rewrite(src, tmp_path / "v3-q8.gguf", q8={n for n in _tensor_names(src) if "attn_k_b" in n or "attn_v_b" in n})
    types = {t.name.split(".", 2)[-1]: t.tensor_type.name for t in gguf.GGUFReader(src).tensors if ".1." in t.name}
    assert {types[n] for n in ("attn_k_b.weight", "attn_v_b.weight", "ffn_gate_exps.weight", "attn_q_b.weight",
                               "ffn_down_shexp.weight")} == {"Q8_0"} and types["ffn_gate_inp.weight"] == "F32"
    want, logprobs = hf_greedy_reference(_q8_0_reference(model), prompts, 16)
    dense = LLM(model=str(src), **ENGINE_KW, quantization="none", block_size=4)
    _assert_matches(_ours(dense, prompts), [w[:MAX_TOKENS] for w in want], logprobs)
    del dense
    quantized = LLM(model=str(src), **ENGINE_KW, quantization="gguf", block_size=4)
    ours = _model(quantized)
    moes = [m for m in ours.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == 2 and all(m.w13_gguf and m.w2_gguf and m.w13_weight.numel() == 0 for m in moes)
    attn = ours.model.layers[1].self_attn
    assert all(getattr(m, "gguf_weight", None) is not None for m in (attn.q_a_proj, attn.q_b_proj,
                                                                      attn.kv_a_proj_with_mqa, attn.o_proj))
    ranks = teacher_forced_ranks(quantized, prompts, want)
    assert sum(r == 1 for r in ranks) >= 0.9 * len(ranks), ranks


def _rewrite(src: Path, dst: Path, drop: set[str] = frozenset(), meta: dict[str, Any] | None = None,
             q8: set[str] = frozenset()) -> Path:
    """``src`` less the tensors ``drop``, with the metadata values ``meta`` (key → value, None: removed) and the
    float tensors ``q8`` as Q8_0 blocks."""
    reader = gguf.GGUFReader(src)
    meta = meta or {}
    w = gguf.GGUFWriter(str(dst), "deepseek2")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in meta:
            continue
        value_type = field.types[0]
        if value_type == gguf.GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        else:
            w.add_key_value(key, field.contents(), value_type)
    for key, value in meta.items():
        if value is not None:
            w.add_uint32(key, value)
    for t in reader.tensors:
        if t.name in drop:
            continue
        data = np.asarray(t.data)
        if t.name in q8:
            w.add_tensor(t.name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_malformed_files_are_clear_errors(tmp_path: Path) -> None:
    model = _hf_model("v2")
    src = _write(model, tmp_path / "v2.gguf", True)

    def error(**kw: Any) -> str:
        bad = _rewrite(src, tmp_path / "bad.gguf", **kw)
        with pytest.raises(ValueError) as e:
            LLM(model=str(bad), **ENGINE_KW, quantization="none", block_size=4)
        return str(e.value)

    assert "has attn_k_b but no attn_v_b" in error(drop={"blk.1.attn_v_b.weight"})
    assert "q_lora_rank = absent but blk.0 has attn_q_a" in error(meta={"deepseek2.attention.q_lora_rank": None})
    assert "expert_count is missing" in error(meta={"deepseek2.expert_count": None})
    assert "key_length = 40 with key_length_mla set" in error(meta={"deepseek2.attention.kv_lora_rank": 16})
    assert "'blk.0.attn_q_b.weight'" in error(meta={"deepseek2.attention.key_length_mla": 32})  # the shape check
    assert "sigmoid routing (DeepSeek-V3) without the routers' correction biases" in error(
        meta={"deepseek2.expert_gating_func": 2})
