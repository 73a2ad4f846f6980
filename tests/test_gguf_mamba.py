"""llama.cpp's state-space GGUF files (`mamba`, `mamba2`, `granitehybrid`, `nemotron_h`, `jamba`): tiny random
transformers models written as convert_hf_to_gguf.py's MambaModel / Mamba2Model / GraniteHybridModel / NemotronHModel /
JambaModel write them,
served by pagedllm (float32, CPU) and held to transformers' greedy tokens on the same weights (one full forward per
token, no cache).

`mamba` (Mamba-1 and FalconMamba, MambaModel): A_log stored as A = -exp(A_log) [d_inner, d_state], the conv weight
squeezed to [d_inner, d_conv], x_proj as ssm_x, dt_proj as ssm_dt (weight and bias), lm_head left out when tied;
ssm.dt_b_c_rms true for FalconMamba, whose dt / B / C norm llama.cpp runs at the file's one RMS epsilon (so the
reference model's mixer_rms_eps is its layer_norm_epsilon).

The writer applies the converter's conversions: A_log stored as A = -exp(A_log) [heads, 1], D as [heads, 1], the
conv weight squeezed to [conv_dim, d_conv], dt_bias as ssm_dt.bias, the gated norm reshaped to [groups, d_inner /
groups]; Granite's shared MLP split into ffn_gate / ffn_up (or their _shexp twins beside experts), experts split from
gate_up_proj into ffn_gate_exps / ffn_up_exps, q/k permuted as Llama's; per-layer head_count_kv (0: Mamba) and, for
nemotron_h, per-layer feed_forward_length (non-zero: MLP). nemotron_h_moe (NemotronHModel with is_moe): experts stacked
as ffn_up_exps / ffn_down_exps, router ffn_gate_inp, exp_probs_b.bias, ffn_{up,down}_shexp, ffn_latent_{down,up},
feed_forward_length = the expert width on MoE layers and the converter's expert_* keys (no expert_group_used_count:
its case lets every group be chosen, topk_group = n_group). The reference's A_log is the value the file round-trips to
(log(-A) of the float32 A).

`jamba` (JambaModel): the Mamba-1 tensors as MambaModel's plus ssm_dt_norm / ssm_b_norm / ssm_c_norm, q/k as HF has
them, attn_norm / ffn_norm (input_layernorm / pre_ff_layernorm), experts stacked as ffn_{gate,up,down}_exps beside the
router ffn_gate_inp, dense layers' ffn_{gate,up,down}; per-layer head_count_kv, one feed_forward_length, expert_count
and expert_used_count.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
import transformers
from gguf_writing import (  # noqa: F401 (own_cache: autouse fixture)
    ENGINE_KW,
    gguf,
    llama_cpp_permute,
    own_cache,
    round_to,
    teacher_forced_ranks,
)
from test_gguf_gemma_phi3 import _model
from test_mamba2_layers import HYBRIDS, _mamba2_config

from pagedllm import LLM, SamplingParams
from pagedllm.model.gguf_config import build_config
from pagedllm.model.gguf_loader import iter_gguf_tensors, open_gguf
from pagedllm.model.models.hybrid import hybrid_layer_kinds
from pagedllm.model.models.nemotron_h import nemotron_layer_kinds

MAX_TOKENS = 8
#: Mamba-1 families: (config class, model class, tied embeddings)
MAMBA1 = {"mamba": (transformers.MambaConfig, transformers.MambaForCausalLM, False),
          "falcon-mamba": (transformers.FalconMambaConfig, transformers.FalconMambaForCausalLM, True)}
_KEPT_FLOAT = ("norm.weight", "ssm_conv1d.weight", "ffn_gate_inp.weight", "ssm_a.weight", "ssm_d.weight")
PROMPT_LENS = (1, 5, 12, 23)


def _hf_model(name: str) -> torch.nn.Module:
    """A tiny random model of `name` ("mamba2" or a key of HYBRIDS), weights widened so greedy margins are not ties,
    A_log set to what the GGUF file round-trips it to."""
    if name == "mamba2":
        config, model_cls = _mamba2_config(num_hidden_layers=3), transformers.Mamba2ForCausalLM
    elif name in MAMBA1:  # llama.cpp's converter asserts expand 2; FalconMamba's inner norm eps = the file's eps
        config_cls, model_cls, tied = MAMBA1[name]
        extra = {"mixer_rms_eps": 1e-5} if name == "falcon-mamba" else {}
        config = config_cls(vocab_size=96, hidden_size=64, state_size=16, num_hidden_layers=3, expand=2,
                            conv_kernel=4, time_step_rank=8, layer_norm_epsilon=1e-5, tie_word_embeddings=tied,
                            pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
    elif name == "jamba":  # Mamba-1 layers, NoPE attention at 1 and 3, 4-expert MoE feed-forwards there
        config = transformers.JambaConfig(
            vocab_size=96, hidden_size=64, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,
            expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=48, mamba_d_state=16, mamba_expand=2, mamba_dt_rank=8,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="eager", use_mamba_kernels=False)
        model_cls = transformers.JambaForCausalLM
    elif name == "nemotron-h-moe":  # llama.cpp's converter records no topk_group: every group may be chosen
        config_cls, model_name, kwargs, _ = HYBRIDS[name]
        kwargs = {**kwargs, "topk_group": kwargs["n_group"]}
        config, model_cls = getattr(transformers, config_cls)(**kwargs), getattr(transformers, model_name)
    else:
        config_cls, model_name, kwargs, _ = HYBRIDS[name]
        config, model_cls = getattr(transformers, config_cls)(**kwargs), getattr(transformers, model_name)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.05))
            if pname.endswith("A_log"):  # as the file stores it (numpy, as the writer) and the loader reads it back
                a = -np.exp(p.numpy().astype(np.float32))
                p.copy_(torch.from_numpy(np.log(-a.astype(np.float64)).astype(np.float32)))
    model.generation_config.eos_token_id = None
    return model


def _hf_greedy(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = list(p)
            for _ in range(MAX_TOKENS):
                ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
            out.append(ids[len(p):])
    return out


# -- what convert_hf_to_gguf.py writes -------------------------------------------------------------------------------

def _name(tensor: Any, bid: int | None = None, suffix: str = ".weight") -> str:
    """llama.cpp's name of `tensor` (a gguf.MODEL_TENSOR) in block `bid`."""
    return gguf.TENSOR_NAMES[tensor].format(bid=bid) + suffix


def _mixer_tensors(prefix: str, bid: int, sd: dict[str, torch.Tensor], groups: int) -> dict[str, np.ndarray]:
    """Mamba2Model.modify_tensors: squeezed conv weight, A = -exp(A_log) and D as [heads, 1], grouped norm."""
    T = gguf.MODEL_TENSOR
    get = lambda n: sd[f"{prefix}.{n}"].float().numpy()  # noqa: E731
    out = {_name(T.SSM_IN, bid): get("in_proj.weight"), _name(T.SSM_CONV1D, bid): get("conv1d.weight")[:, 0],
           _name(T.SSM_DT, bid, ".bias"): get("dt_bias"), _name(T.SSM_A, bid): -np.exp(get("A_log")).reshape(-1, 1),
           _name(T.SSM_D, bid): get("D").reshape(-1, 1),
           _name(T.SSM_NORM, bid): get("norm.weight").reshape(groups, -1),
           _name(T.SSM_OUT, bid): get("out_proj.weight")}
    if f"{prefix}.conv1d.bias" in sd:
        out[_name(T.SSM_CONV1D, bid, ".bias")] = get("conv1d.bias")
    return out


def _mamba1_tensors(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """MambaModel.modify_tensors: A = -exp(A_log) [d_inner, d_state], the conv weight squeezed, lm_head left out
    when it equals the embeddings (tied)."""
    T, cfg, sd = gguf.MODEL_TENSOR, model.config, model.state_dict()
    get = lambda n: sd[n].float().numpy()  # noqa: E731
    out = {_name(T.TOKEN_EMBD): get("backbone.embeddings.weight"), _name(T.OUTPUT_NORM): get("backbone.norm_f.weight")}
    if not cfg.tie_word_embeddings:
        out[_name(T.OUTPUT)] = get("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        m = f"backbone.layers.{i}.mixer"
        out.update({_name(T.ATTN_NORM, i): get(f"backbone.layers.{i}.norm.weight"),
                    _name(T.SSM_IN, i): get(f"{m}.in_proj.weight"),
                    _name(T.SSM_CONV1D, i): get(f"{m}.conv1d.weight").squeeze(),
                    _name(T.SSM_CONV1D, i, ".bias"): get(f"{m}.conv1d.bias"),
                    _name(T.SSM_X, i): get(f"{m}.x_proj.weight"), _name(T.SSM_DT, i): get(f"{m}.dt_proj.weight"),
                    _name(T.SSM_DT, i, ".bias"): get(f"{m}.dt_proj.bias"),
                    _name(T.SSM_A, i): -np.exp(get(f"{m}.A_log")), _name(T.SSM_D, i): get(f"{m}.D"),
                    _name(T.SSM_OUT, i): get(f"{m}.out_proj.weight")})
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def _jamba_tensors(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """JambaModel.modify_tensors: the Mamba-1 mixer as MambaModel's (A = -exp(A_log) [d_inner, d_state], the conv
    weight squeezed) with ssm_dt_norm / ssm_b_norm / ssm_c_norm, q/k as HF has them (no permutation), the experts
    stacked per projection into ffn_{gate,up,down}_exps (transformers' fused gate_up_proj: gate rows, then up)."""
    T, cfg, sd = gguf.MODEL_TENSOR, model.config, model.state_dict()
    get = lambda n: sd[n].float().numpy()  # noqa: E731
    out = {_name(T.TOKEN_EMBD): get("model.embed_tokens.weight"),
           _name(T.OUTPUT_NORM): get("model.final_layernorm.weight")}
    if not cfg.tie_word_embeddings:
        out[_name(T.OUTPUT)] = get("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        layer = f"model.layers.{i}"
        out[_name(T.ATTN_NORM, i)] = get(f"{layer}.input_layernorm.weight")
        out[_name(T.FFN_NORM, i)] = get(f"{layer}.pre_ff_layernorm.weight")
        if cfg.layers_block_type[i] == "mamba":
            m = f"{layer}.mamba"
            out.update({_name(T.SSM_IN, i): get(f"{m}.in_proj.weight"),
                        _name(T.SSM_CONV1D, i): get(f"{m}.conv1d.weight").squeeze(),
                        _name(T.SSM_CONV1D, i, ".bias"): get(f"{m}.conv1d.bias"),
                        _name(T.SSM_X, i): get(f"{m}.x_proj.weight"), _name(T.SSM_DT, i): get(f"{m}.dt_proj.weight"),
                        _name(T.SSM_DT, i, ".bias"): get(f"{m}.dt_proj.bias"),
                        _name(T.SSM_A, i): -np.exp(get(f"{m}.A_log")), _name(T.SSM_D, i): get(f"{m}.D"),
                        _name(T.SSM_DT_NORM, i): get(f"{m}.dt_layernorm.weight"),
                        _name(T.SSM_B_NORM, i): get(f"{m}.b_layernorm.weight"),
                        _name(T.SSM_C_NORM, i): get(f"{m}.c_layernorm.weight"),
                        _name(T.SSM_OUT, i): get(f"{m}.out_proj.weight")})
        else:
            a = f"{layer}.self_attn"
            out.update({_name(T.ATTN_Q, i): get(f"{a}.q_proj.weight"), _name(T.ATTN_K, i): get(f"{a}.k_proj.weight"),
                        _name(T.ATTN_V, i): get(f"{a}.v_proj.weight"),
                        _name(T.ATTN_OUT, i): get(f"{a}.o_proj.weight")})
        f = f"{layer}.feed_forward"
        if cfg.layers_num_experts[i] > 1:
            out[_name(T.FFN_GATE_INP, i)] = get(f"{f}.router.weight")
            gate, up = np.split(get(f"{f}.experts.gate_up_proj"), 2, axis=1)
            out[_name(T.FFN_GATE_EXP, i)] = gate
            out[_name(T.FFN_UP_EXP, i)] = up
            out[_name(T.FFN_DOWN_EXP, i)] = get(f"{f}.experts.down_proj")
        else:
            out.update({_name(T.FFN_GATE, i): get(f"{f}.gate_proj.weight"),
                        _name(T.FFN_UP, i): get(f"{f}.up_proj.weight"),
                        _name(T.FFN_DOWN, i): get(f"{f}.down_proj.weight")})
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def _tensors(model: torch.nn.Module, arch: str) -> dict[str, np.ndarray]:
    """Every tensor as the converter stores it for `arch` (numpy order)."""
    if arch == "mamba":
        return _mamba1_tensors(model)
    if arch == "jamba":
        return _jamba_tensors(model)
    T, cfg = gguf.MODEL_TENSOR, model.config
    sd = model.state_dict()
    np_ = lambda n: sd[n].float().numpy()  # noqa: E731
    root = "backbone" if arch == "mamba2" else "model"
    embedding = "embed_tokens" if arch == "granitehybrid" else "embeddings"
    out: dict[str, np.ndarray] = {_name(T.TOKEN_EMBD): np_(f"{root}.{embedding}.weight")}
    out[_name(T.OUTPUT_NORM)] = np_({"mamba2": "backbone.norm_f.weight", "granitehybrid": "model.norm.weight",
                                           "nemotron_h": "model.norm_f.weight",
                                     "nemotron_h_moe": "model.norm_f.weight"}[arch])
    if not cfg.tie_word_embeddings:
        out[_name(T.OUTPUT)] = np_("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        layer = f"{root}.layers.{i}"
        if arch == "mamba2":
            out[_name(T.ATTN_NORM, i)] = np_(f"{layer}.norm.weight")
            out.update(_mixer_tensors(f"{layer}.mixer", i, sd, cfg.n_groups))
        elif arch in ("nemotron_h", "nemotron_h_moe"):
            out[_name(T.ATTN_NORM, i)] = np_(f"{layer}.norm.weight")
            kind = nemotron_layer_kinds(cfg)[i]
            if kind == "mamba":
                out.update(_mixer_tensors(f"{layer}.mixer", i, sd, cfg.n_groups))
            elif kind == "moe":
                m = f"{layer}.mixer"
                out[_name(T.FFN_GATE_INP, i)] = np_(f"{m}.gate.weight")
                out[_name(T.FFN_EXP_PROBS_B, i, ".bias")] = np_(f"{m}.gate.e_score_correction_bias")
                out[_name(T.FFN_UP_EXP, i)] = np_(f"{m}.experts.up_proj")
                out[_name(T.FFN_DOWN_EXP, i)] = np_(f"{m}.experts.down_proj")
                out[_name(T.FFN_UP_SHEXP, i)] = np_(f"{m}.shared_experts.up_proj.weight")
                out[_name(T.FFN_DOWN_SHEXP, i)] = np_(f"{m}.shared_experts.down_proj.weight")
                if cfg.moe_latent_size:
                    out[_name(T.MOE_LATENT_DOWN, i)] = np_(f"{m}.fc1_latent_proj.weight")
                    out[_name(T.MOE_LATENT_UP, i)] = np_(f"{m}.fc2_latent_proj.weight")
            elif kind == "mlp":
                out[_name(T.FFN_UP, i)] = np_(f"{layer}.mixer.up_proj.weight")
                out[_name(T.FFN_DOWN, i)] = np_(f"{layer}.mixer.down_proj.weight")
            else:
                out.update(_attention(f"{layer}.mixer", i, sd, cfg))
        else:
            out[_name(T.ATTN_NORM, i)] = np_(f"{layer}.input_layernorm.weight")
            out[_name(T.FFN_NORM, i)] = np_(f"{layer}.post_attention_layernorm.weight")
            if hybrid_layer_kinds(cfg)[i] == "mamba":
                out.update(_mixer_tensors(f"{layer}.mamba", i, sd, cfg.mamba_n_groups))
            else:
                out.update(_attention(f"{layer}.self_attn", i, sd, cfg))
            moe = bool(cfg.num_local_experts)
            gate, up = np.split(np_(f"{layer}.shared_mlp.input_linear.weight"), 2)
            out[_name(T.FFN_GATE_SHEXP if moe else T.FFN_GATE, i)] = gate
            out[_name(T.FFN_UP_SHEXP if moe else T.FFN_UP, i)] = up
            out[_name(T.FFN_DOWN_SHEXP if moe else T.FFN_DOWN, i)] = np_(f"{layer}.shared_mlp.output_linear.weight")
            if moe:
                moe_p = f"{layer}.block_sparse_moe"
                out[_name(T.FFN_GATE_INP, i)] = np_(f"{moe_p}.router.weight")
                g, u = np.split(np_(f"{moe_p}.experts.gate_up_proj"), 2, axis=1)
                out[_name(T.FFN_GATE_EXP, i)] = np.ascontiguousarray(g)
                out[_name(T.FFN_UP_EXP, i)] = np.ascontiguousarray(u)
                out[_name(T.FFN_DOWN_EXP, i)] = np_(f"{moe_p}.experts.down_proj")
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def _attention(prefix: str, bid: int, sd: dict[str, torch.Tensor], cfg: Any) -> dict[str, np.ndarray]:
    """LlamaModel.modify_tensors with undo_permute (GraniteHybridModel and NemotronHModel set it): q/k permuted."""
    T = gguf.MODEL_TENSOR
    get = lambda n: sd[f"{prefix}.{n}_proj.weight"].float().numpy()  # noqa: E731
    return {_name(T.ATTN_Q, bid): llama_cpp_permute(get("q"), cfg.num_attention_heads),
            _name(T.ATTN_K, bid): llama_cpp_permute(get("k"), cfg.num_key_value_heads),
            _name(T.ATTN_V, bid): get("v"), _name(T.ATTN_OUT, bid): get("o")}


def _metadata(w: Any, model: torch.nn.Module, arch: str, rope: bool) -> None:
    """The converter's keys (Mamba2Model / GraniteHybridModel / NemotronHModel set_gguf_parameters); `rope`: the
    granitehybrid file's rope.scaling.finetuned (the converter writes true for Bamba only)."""
    cfg = model.config
    n = cfg.num_hidden_layers
    w.add_block_count(n)
    w.add_embedding_length(cfg.hidden_size)
    if arch == "jamba":  # JambaModel.set_gguf_parameters
        w.add_context_length(cfg.max_position_embeddings)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv([cfg.num_key_value_heads if t == "attention" else 0 for t in cfg.layers_block_type])
        w.add_ssm_conv_kernel(cfg.mamba_d_conv)
        w.add_ssm_inner_size(cfg.mamba_expand * cfg.hidden_size)
        w.add_ssm_state_size(cfg.mamba_d_state)
        w.add_ssm_time_step_rank(cfg.mamba_dt_rank)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        return
    if arch == "mamba":  # MambaModel.set_gguf_parameters
        w.add_context_length(2**20)
        w.add_feed_forward_length(0)
        w.add_head_count(0)
        w.add_ssm_conv_kernel(cfg.conv_kernel)
        w.add_ssm_inner_size(cfg.intermediate_size)
        w.add_ssm_state_size(cfg.state_size)
        w.add_ssm_time_step_rank(cfg.time_step_rank)
        w.add_layer_norm_rms_eps(cfg.layer_norm_epsilon)
        w.add_ssm_dt_b_c_rms(cfg.model_type == "falcon_mamba")
        return
    if arch == "mamba2":
        w.add_context_length(2**20)
        w.add_feed_forward_length(0)
        w.add_head_count(0)
        w.add_ssm_conv_kernel(cfg.conv_kernel)
        w.add_ssm_inner_size(cfg.num_heads * cfg.head_dim)
        w.add_ssm_state_size(cfg.state_size)
        w.add_ssm_time_step_rank(cfg.num_heads)
        w.add_ssm_group_count(cfg.n_groups)
        w.add_layer_norm_rms_eps(cfg.layer_norm_epsilon)
        return
    if arch == "granitehybrid":
        attn = [i for i, t in enumerate(hybrid_layer_kinds(cfg)) if t == "attention"]
        w.add_context_length(cfg.max_position_embeddings if rope else 2**20)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_expert_count(cfg.num_local_experts)
        if cfg.num_local_experts:
            w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
        w.add_expert_shared_feed_forward_length(cfg.shared_intermediate_size)
        w.add_ssm_conv_kernel(cfg.mamba_d_conv)
        w.add_ssm_state_size(cfg.mamba_d_state)
        w.add_ssm_group_count(cfg.mamba_n_groups)
        w.add_ssm_inner_size(cfg.mamba_expand * cfg.hidden_size)
        w.add_ssm_time_step_rank(cfg.mamba_n_heads)
        w.add_rope_scaling_finetuned(rope)
    else:
        attn = [i for i, t in enumerate(nemotron_layer_kinds(cfg)) if t == "attention"]
        w.add_context_length(2**20)
        w.add_layer_norm_rms_eps(cfg.layer_norm_epsilon)
        w.add_layer_norm_eps(cfg.layer_norm_epsilon)
        w.add_ssm_conv_kernel(cfg.conv_kernel)
        w.add_ssm_state_size(cfg.ssm_state_size)
        w.add_ssm_group_count(cfg.n_groups)
        w.add_ssm_inner_size(cfg.mamba_num_heads * cfg.mamba_head_dim)
        w.add_ssm_time_step_rank(cfg.mamba_num_heads)
        w.add_rope_scaling_finetuned(False)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        if arch == "nemotron_h":
            w.add_feed_forward_length([cfg.intermediate_size if t == "mlp" else 0 for t in nemotron_layer_kinds(cfg)])
        else:  # NemotronHModel.set_gguf_parameters with is_moe
            w.add_feed_forward_length([cfg.moe_intermediate_size if t == "moe" else 0
                                       for t in nemotron_layer_kinds(cfg)])
            w.add_expert_used_count(cfg.num_experts_per_tok)
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
            w.add_expert_shared_feed_forward_length(cfg.moe_shared_expert_intermediate_size)
            w.add_expert_count(cfg.n_routed_experts)
            w.add_expert_shared_count(cfg.n_shared_experts)
            w.add_expert_weights_norm(cfg.norm_topk_prob)
            w.add_expert_weights_scale(cfg.routed_scaling_factor)
            w.add_expert_group_count(cfg.n_group)
            if cfg.moe_latent_size is not None:
                w.add_moe_latent_size(cfg.moe_latent_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([cfg.num_key_value_heads if i in attn else 0 for i in range(n)])


def _write(model: torch.nn.Module, arch: str, path: Path, rope: bool = False,
           edit: Callable[[dict[str, np.ndarray]], None] | None = None, skip_keys: tuple[str, ...] = (),
           q8_0: bool = False, tokenizer: Callable[[Any], None] | None = None) -> Path:
    """`model` as a GGUF file of `arch`; `edit` changes the tensors before writing, `skip_keys` leaves out metadata;
    `tokenizer(writer)` writes tokenizer keys (default: a bare token list); `q8_0`: the matrices (rows a multiple of 32 long; not norms, conv or routers, which the converter keeps float) as
    Q8_0 blocks."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_key_value = _skipping(w.add_key_value, skip_keys)
    _metadata(w, model, arch, rope)
    if tokenizer is None:
        w.add_token_list([f"t{i}" for i in range(model.config.vocab_size)])
    else:
        tokenizer(w)
    tensors = _tensors(model, arch)
    if edit is not None:
        edit(tensors)
    for name, arr in tensors.items():
        if q8_0 and arr.ndim >= 2 and arr.shape[-1] % 32 == 0 and not name.endswith(_KEPT_FLOAT):
            w.add_tensor(name, gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _skipping(add: Callable[..., None], skip: tuple[str, ...]) -> Callable[..., None]:
    def wrapped(key: str, *args: Any, **kw: Any) -> None:
        if key not in skip:
            add(key, *args, **kw)
    return wrapped


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _ours(path: Path, prompts: list[list[int]]) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model=str(path), **{**ENGINE_KW, "quantization": "none", "block_size": 4, "max_num_batched_tokens": 8,
                                  "max_model_len": 64, "max_num_seqs": 8})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outs]


# (case, llama.cpp architecture, rope.scaling.finetuned)
CASES = [("mamba", "mamba", False), ("falcon-mamba", "mamba", False), ("mamba2", "mamba2", False), ("granite-moe-nope", "granitehybrid", False),
         ("granite-dense-rope", "granitehybrid", True), ("nemotron-h", "nemotron_h", False),
         ("nemotron-h-moe", "nemotron_h_moe", False), ("jamba", "jamba", False)]


@pytest.mark.parametrize("name,arch,rope", CASES, ids=[c[0] for c in CASES])
def test_gguf_generates_what_transformers_does(name: str, arch: str, rope: bool, tmp_path: Path) -> None:
    model = _hf_model(name)
    prompts = _prompts(model.config.vocab_size)
    want = _hf_greedy(model, prompts)
    src = _write(model, arch, tmp_path / f"{name}.gguf", rope=rope)
    llm, ours = _ours(src, prompts)
    assert ours == want, name
    assert type(_model(llm)).__name__ == type(model).__name__


@pytest.mark.parametrize("name,arch,rope", CASES, ids=[c[0] for c in CASES])
def test_conversion_restores_transformers_weights(name: str, arch: str, rope: bool, tmp_path: Path) -> None:
    """Every tensor the conversion yields equals transformers' (q/k un-permuted, the shared MLP joined, shapes
    restored; A_log = log(-A) to float32 rounding), and every non-expert parameter of transformers' model is among
    them."""
    model = _hf_model(name)
    src = _write(model, arch, tmp_path / f"{name}.gguf", rope=rope)
    reader = open_gguf(src)
    ours = dict(iter_gguf_tensors(reader, build_config(reader, src), src))
    # transformers' in-memory names: Nemotron-H's `model.` is the checkpoints' `backbone.`; experts are stacked
    theirs = {k.replace("model.", "backbone.", 1) if arch.startswith("nemotron_h") else k: v.numpy()
              for k, v in model.state_dict().items() if ".experts." not in k and "router" not in k}
    if model.config.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    assert set(theirs) <= set(ours), sorted(set(theirs) - set(ours))
    for key, want in theirs.items():
        if key.endswith("A_log"):  # log(-(-exp(A_log))) in float32: within an ulp or so
            np.testing.assert_allclose(ours[key], want, rtol=0, atol=1e-6, err_msg=key)
        else:
            assert np.array_equal(ours[key], want), key
    if arch == "jamba":  # the fused experts, split one matrix per expert
        sd, inter = model.state_dict(), model.config.intermediate_size
        for key, stacked in sd.items():
            if key.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                prefix = key.rsplit(".", 1)[0]
                for e in range(stacked.shape[0]):
                    if key.endswith(".down_proj"):
                        assert np.array_equal(ours[f"{prefix}.{e}.down_proj.weight"], stacked[e].numpy()), (key, e)
                    else:
                        assert np.array_equal(ours[f"{prefix}.{e}.gate_proj.weight"], stacked[e, :inter].numpy())
                        assert np.array_equal(ours[f"{prefix}.{e}.up_proj.weight"], stacked[e, inter:].numpy())
    if arch == "nemotron_h_moe":  # the stacked experts, split one matrix per expert
        for key, stacked in model.state_dict().items():
            if key.endswith((".mixer.experts.up_proj", ".mixer.experts.down_proj")):
                prefix, proj = key.replace("model.", "backbone.", 1).rsplit(".", 1)
                for e in range(stacked.shape[0]):
                    assert np.array_equal(ours[f"{prefix}.{e}.{proj}.weight"], stacked[e].numpy()), (key, e)


def _q8_0_rounded(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every matrix the Q8_0 file stores as blocks (rows a multiple of 32 long; not the conv weights
    or routers) at its Q8_0 values, so that the file holds exactly these weights (Q8_0 of Q8_0 values is lossless)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and p.shape[-1] % 32 == 0 and "conv1d" not in name and "router" not in name:
                p.copy_(torch.from_numpy(round_to(p.detach().numpy().reshape(-1, p.shape[-1]), "Q8_0")).view_as(p))
    return model


Q8_CASES = [c for c in CASES if not c[2] and c[1] != "nemotron_h_moe"]


@pytest.mark.parametrize("name,arch", [c[:2] for c in Q8_CASES], ids=[c[0] for c in Q8_CASES])
def test_q8_0_file(name: str, arch: str, tmp_path: Path) -> None:
    """A file with Q8_0 matrices: quantization="none" dequantizes them (transformers' tokens on the dequantized
    weights); quantization="gguf" (the CPU's default outside the tests) serves them from their blocks, holding the
    greedy path teacher-forced at >= 90 %."""
    model = _q8_0_rounded(_hf_model(name))
    prompts = _prompts(model.config.vocab_size)
    want = _hf_greedy(model, prompts)
    src = _write(model, arch, tmp_path / f"{name}-q8.gguf", q8_0=True)
    assert {t.tensor_type.name for t in gguf.GGUFReader(src).tensors if t.name.endswith("ssm_in.weight")} == {"Q8_0"}
    dense, ours = _ours(src, prompts)
    assert ours == want, name
    del dense
    quantized = LLM(model=str(src), **{**ENGINE_KW, "quantization": "gguf", "block_size": 4, "max_model_len": 64})
    assert quantized.llm_engine.executor.driver_worker.quantization == "gguf"
    in_projs = [m for n, m in _model(quantized).named_modules() if n.endswith((".mixer.in_proj", ".mamba.in_proj"))]
    assert in_projs and all(getattr(m, "gguf_weight", None) is not None for m in in_projs)
    ranks = teacher_forced_ranks(quantized, prompts, want)
    assert sum(r == 1 for r in ranks) >= 0.9 * len(ranks), ranks


def _load_error(model: Any, arch: str, path: Path, **kw: Any) -> str:
    """The ValueError's message from loading `model` written as `arch` with `_write`'s edits `kw`."""
    bad = _write(model, arch, path, **kw)
    with pytest.raises(ValueError) as e:
        LLM(model=str(bad), **{**ENGINE_KW, "quantization": "none"})
    bad.unlink()
    return str(e.value)


def test_missing_pieces_are_clear_errors(tmp_path: Path) -> None:
    model = _hf_model("granite-moe-nope")

    def error(**kw: Any) -> str:
        return _load_error(model, "granitehybrid", tmp_path / "bad.gguf", **kw)

    assert "missing metadata key 'granitehybrid.ssm.state_size'" in error(skip_keys=("granitehybrid.ssm.state_size",))
    assert "granitehybrid.attention.head_count_kv" in error(skip_keys=("granitehybrid.attention.head_count_kv",))
    assert "has the shared MLP's ffn_gate(_shexp) but no ffn_up(_shexp)" in error(
        edit=lambda t: t.pop("blk.1.ffn_up_shexp.weight"))
    assert "'blk.0.ssm_a.weight'" in error(edit=lambda t: t.update({"blk.0.ssm_a.weight": t["blk.0.ssm_a.weight"][:4]}))
    mamba = _hf_model("mamba2")
    bad = _write(mamba, "mamba2", tmp_path / "m.gguf", skip_keys=("mamba2.ssm.group_count",))
    with pytest.raises(ValueError, match="missing metadata key 'mamba2.ssm.group_count'"):
        LLM(model=str(bad), **{**ENGINE_KW, "quantization": "none"})


def test_mamba1_missing_pieces_are_clear_errors(tmp_path: Path) -> None:
    model = _hf_model("mamba")

    def error(**kw: Any) -> str:
        return _load_error(model, "mamba", tmp_path / "bad.gguf", **kw)

    assert "missing metadata key 'mamba.ssm.time_step_rank'" in error(skip_keys=("mamba.ssm.time_step_rank",))
    assert "'blk.1.ssm_x.weight'" in error(edit=lambda t: t.update({"blk.1.ssm_x.weight": t["blk.1.ssm_x.weight"][:8]}))
    assert "Unsupported tensor 'blk.0.ssm_norm.weight'" in error(
        edit=lambda t: t.update({"blk.0.ssm_norm.weight": t["blk.0.attn_norm.weight"]}))
    assert "ssm_a holds A = -exp(A_log)" in error(
        edit=lambda t: t.update({"blk.2.ssm_a.weight": -t["blk.2.ssm_a.weight"]}))


def test_mamba1_config_from_the_file(tmp_path: Path) -> None:
    """The FalconMamba flag (ssm.dt_b_c_rms) picks the class; its inner norm runs at the file's RMS epsilon."""
    for name, want in (("mamba", "MambaForCausalLM"), ("falcon-mamba", "FalconMambaForCausalLM")):
        src = _write(_hf_model(name), "mamba", tmp_path / f"{name}.gguf")
        reader = open_gguf(src)
        cfg = build_config(reader, src).config
        assert cfg["architectures"] == [want]
        geometry = (cfg["intermediate_size"], cfg["state_size"], cfg["conv_kernel"], cfg["time_step_rank"])
        assert geometry == (128, 16, 4, 8)
        assert cfg["use_conv_bias"] and not cfg["use_bias"] and cfg["tie_word_embeddings"] == (name == "falcon-mamba")
        if name == "falcon-mamba":  # float32 in the file
            assert cfg["mixer_rms_eps"] == cfg["layer_norm_epsilon"] == pytest.approx(1e-5)
        else:
            assert "mixer_rms_eps" not in cfg


def test_nemotron_h_moe_missing_pieces_are_clear_errors(tmp_path: Path) -> None:
    model = _hf_model("nemotron-h-moe")

    def error(**kw: Any) -> str:
        return _load_error(model, "nemotron_h_moe", tmp_path / "bad.gguf", **kw)

    assert "nemotron_h_moe.expert_count = missing" in error(skip_keys=("nemotron_h_moe.expert_count",))
    assert "has no blk.1.ffn_down_shexp.weight tensor" in error(edit=lambda t: t.pop("blk.1.ffn_down_shexp.weight"))
    assert "a latent MoE needs both" in error(edit=lambda t: t.pop("blk.1.ffn_latent_down.weight"))
    assert "'blk.3.ffn_up_exps.weight'" in error(
        edit=lambda t: t.update({"blk.3.ffn_up_exps.weight": t["blk.3.ffn_up_exps.weight"][:, :8]}))


def test_jamba_config_and_clear_errors(tmp_path: Path) -> None:
    """The layer pattern comes back as JambaConfig's periods / offsets (attention from head_count_kv, MoE from
    ffn_gate_inp); non-periodic patterns, missing expert keys and missing expert tensors are clear errors."""
    model = _hf_model("jamba")
    src = _write(model, "jamba", tmp_path / "jamba.gguf")
    cfg = build_config(open_gguf(src), src).config
    assert (cfg["attn_layer_period"], cfg["attn_layer_offset"], cfg["expert_layer_period"],
            cfg["expert_layer_offset"]) == (2, 1, 2, 1)
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["mamba_dt_rank"], cfg["intermediate_size"]) == (
        4, 2, 8, 48)
    assert transformers.AutoConfig.for_model(**cfg).layers_block_type == model.config.layers_block_type

    def error(**kw: Any) -> str:
        return _load_error(model, "jamba", tmp_path / "bad.gguf", **kw)

    def dense_layer_3(t: dict[str, np.ndarray]) -> None:  # layer 3's experts replaced by a dense MLP: MoE only at 1
        for proj in ("gate", "up", "down"):
            t[f"blk.3.ffn_{proj}.weight"] = t.pop(f"blk.3.ffn_{proj}_exps.weight")[0]
        t.pop("blk.3.ffn_gate_inp.weight")

    assert "jamba.expert_count" in error(skip_keys=("jamba.expert_count",))
    assert "missing metadata key 'jamba.ssm.time_step_rank'" in error(skip_keys=("jamba.ssm.time_step_rank",))
    assert "no blk.1.ffn_up_exps.weight" in error(edit=lambda t: t.pop("blk.1.ffn_up_exps.weight"))
    assert "'blk.0.ssm_b_norm.weight'" in error(
        edit=lambda t: t.update({"blk.0.ssm_b_norm.weight": t["blk.0.ssm_b_norm.weight"][:4]}))
    # MoE at 1 only (of 4 layers) is periodic (period 2 would put one at 3 too: period 3, offset 1 fits it)
    dense = _write(model, "jamba", tmp_path / "dense3.gguf", edit=dense_layer_3)
    cfg = build_config(open_gguf(dense), dense).config
    assert (cfg["expert_layer_period"], cfg["expert_layer_offset"]) == (3, 1)

    def moe_at_0_1(t: dict[str, np.ndarray]) -> None:  # layers 0 and 1 MoE, 2 and 3 dense: no period fits
        dense_layer_3(t)
        t["blk.0.ffn_gate_inp.weight"] = t["blk.1.ffn_gate_inp.weight"]
        for proj in ("gate", "up", "down"):
            t[f"blk.0.ffn_{proj}_exps.weight"] = t[f"blk.1.ffn_{proj}_exps.weight"]
            t.pop(f"blk.0.ffn_{proj}.weight")

    assert "must recur with a fixed period and offset" in error(edit=moe_at_0_1)


def _byte_level_bpe(w: Any) -> None:
    """A 96-token byte-level BPE vocabulary (printable ASCII and one merge), as a `gpt2` tokenizer."""
    tokens = [chr(c) for c in range(33, 33 + 95)] + ['!"']
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    w.add_token_merges(['! "'])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def test_tokenizer_from_the_file(tmp_path: Path) -> None:
    """A granitehybrid file with a tokenizer (which transformers builds although it has no config for the
    architecture) serves text prompts."""
    model = _hf_model("granite-moe-nope")
    src = _write(model, "granitehybrid", tmp_path / "tok.gguf", tokenizer=_byte_level_bpe)
    llm = LLM(model=str(src), **{**ENGINE_KW, "skip_tokenizer_init": False, "quantization": "none", "block_size": 4,
                                  "max_model_len": 64})
    ids = llm.get_tokenizer().encode("hello", add_special_tokens=False)
    assert ids == [ord(c) - 33 for c in "hello"]
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                       use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == _hf_greedy(model, [list(out.prompt_token_ids)])[0]
