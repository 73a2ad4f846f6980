"""llama.cpp's state-space GGUF files: ``mamba`` (Mamba-1: MambaForCausalLM, or FalconMambaForCausalLM),
``mamba2`` (Mamba2ForCausalLM), ``granitehybrid`` (IBM Granite 4.0 "H": GraniteMoeHybridForCausalLM) and
``nemotron_h`` (NemotronHForCausalLM) and ``jamba`` (JambaForCausalLM), as convert_hf_to_gguf.py's MambaModel,
Mamba2Model, GraniteHybridModel, NemotronHModel and JambaModel write them. The conversion dequantizes every tensor to float32 (with
quantization='gguf' on the CPU the quantized matrices then run from their blocks, as for the other architectures).

What the converter writes: the mixer's geometry as ``{arch}.ssm.conv_kernel``, ``.ssm.inner_size`` (d_inner = heads ·
head_dim), ``.ssm.state_size``, ``.ssm.time_step_rank`` (the number of SSM heads) and ``.ssm.group_count``; each
layer's kind in the hybrids through per-layer arrays: ``attention.head_count_kv`` is 0 on a Mamba layer (and, for
nemotron_h, ``feed_forward_length`` is non-zero on an MLP layer). Tensors: ``ssm_in`` (in_proj), ``ssm_conv1d``
[conv_dim, d_conv] (HF's [conv_dim, 1, d_conv] squeezed) with its bias, ``ssm_dt.bias`` (dt_bias), ``ssm_a`` =
−exp(A_log) as [heads, 1], ``ssm_d`` [heads, 1], ``ssm_norm`` [groups, d_inner / groups] (the gated norm's weight)
and ``ssm_out`` (out_proj). The conversion undoes each: A_log = log(−A), the squeezed axes restored, the norm
flattened.

mamba (Mamba-1, e.g. state-spaces/mamba-130m-hf, tiiuae/falcon-mamba-7b; MambaModel): the same geometry keys with
``ssm.time_step_rank`` = dt_rank (x_proj's dt width) and no ``ssm.group_count``; ``feed_forward_length`` and
``attention.head_count`` are 0; ``ssm.dt_b_c_rms`` true marks FalconMamba (dt, B and C RMS-normalised without weights;
llama.cpp uses the file's one ``attention.layer_norm_rms_epsilon`` there, so that is ``mixer_rms_eps`` too: HF's
FalconMamba configs say 1e-6 beside a 1e-5 layer norm, which the file does not keep). Tensors: ``attn_norm``,
``ssm_in``, ``ssm_conv1d`` [d_inner, d_conv] and its bias, ``ssm_x`` (x_proj), ``ssm_dt`` (dt_proj weight and bias),
``ssm_a`` = −exp(A_log) as [d_inner, d_state] (A_log = log(−A), kept 2-D), ``ssm_d`` [d_inner], ``ssm_out``;
``output`` is left out when it equals the embeddings (tied).

granitehybrid: attention q/k rows permuted as Llama's (un-permuted here); the shared MLP split into ``ffn_gate`` /
``ffn_up`` / ``ffn_down`` (dense models) or ``ffn_{gate,up,down}_shexp`` (beside routed experts ``ffn_*_exps``),
joined back into ``shared_mlp.input_linear`` (gate rows, then up); ``rope.scaling.finetuned`` switches RoPE on
(absent: on, as llama.cpp; Granite 4.0 H files say false); Granite's four multipliers as for ``granite`` files, each
optional (absent or 0: 1; attention: head_dim**-0.5). Bamba files (also ``granitehybrid``) load where RoPE covers
whole heads; partial rotary (Bamba-9B's rope.dimension_count 64 of 128) is refused. nemotron_h (dense Nemotron-H;
not ``nemotron_h_moe``): attention without RoPE (its q/k are permuted by the converter too, which changes no score;
un-permuted here), ReLU² MLPs (``ffn_up`` / ``ffn_down``), one norm per block (``attn_norm``).

nemotron_h_moe (Nemotron 3, e.g. Nemotron-3-Nano-30B-A3B; NemotronHModel with is_moe): as nemotron_h, with MoE blocks
in place of the MLPs (per-layer ``feed_forward_length`` non-zero: the expert width). Tensors: the router
``ffn_gate_inp``, its correction bias ``exp_probs_b.bias`` (e_score_correction_bias), routed ReLU² experts stacked as
``ffn_up_exps`` [E, expert width, d] / ``ffn_down_exps`` [E, d, expert width] (d: moe_latent_size where the file has
one, else the hidden size; split here into ``mixer.experts.E.{up,down}_proj``), the shared expert ``ffn_{up,down}_shexp``
and the latent projections ``ffn_latent_down`` (fc1_latent_proj) / ``ffn_latent_up`` (fc2_latent_proj). Metadata:
``expert_count``, ``expert_used_count`` (required), ``expert_feed_forward_length`` / ``expert_shared_feed_forward_length``
(absent: the tensors' widths), ``expert_group_count`` (absent: 1), ``expert_group_used_count`` (the converter writes
none: every group may be chosen), ``expert_weights_norm`` (absent: false, as llama.cpp), ``expert_weights_scale``
(absent or 0: 1) and ``moe_latent_size``. Routing is sigmoid with the correction bias (DeepSeek-V3's, as HF's class).
The experts are always converted to float (quantization='gguf' does not serve this architecture's experts from their
blocks).

jamba (AI21 Jamba; JambaModel): Mamba-1 mixers as ``mamba`` files write them (``ssm_in``, ``ssm_conv1d`` squeezed with
its bias, ``ssm_x``, ``ssm_dt`` weight and bias, ``ssm_a`` = −exp(A_log) [d_inner, d_state], ``ssm_d``, ``ssm_out``)
plus the weighted dt / B / C RMS norms ``ssm_dt_norm`` / ``ssm_b_norm`` / ``ssm_c_norm``; NoPE attention
``attn_{q,k,v,output}`` stored as HF has them (JambaModel does not permute q/k); ``attn_norm`` (input_layernorm),
``ffn_norm`` (pre_ff_layernorm), ``output_norm`` (final_layernorm). Feed-forwards: the router ``ffn_gate_inp`` and
routed SwiGLU experts stacked as ``ffn_{gate,up,down}_exps`` (split here into ``feed_forward.experts.E.<proj>``) on MoE
layers, the dense ``ffn_{gate,up,down}`` elsewhere. Metadata: ``ssm.conv_kernel``, ``.ssm.inner_size`` (mamba_expand ·
hidden), ``.ssm.state_size``, ``.ssm.time_step_rank`` (dt_rank), one ``feed_forward_length`` (intermediate_size),
``attention.head_count``, per-layer ``attention.head_count_kv`` (0: a Mamba layer), ``expert_count``,
``expert_used_count`` and ``attention.layer_norm_rms_epsilon``. The attention layers (head_count_kv > 0) and the MoE
layers (those with ``ffn_gate_inp``) become JambaConfig's ``attn_layer_period / offset`` and ``expert_layer_period /
offset``; a pattern no period and offset describe is refused. The experts are always converted to float (as
nemotron_h_moe's).
"""
from __future__ import annotations

import math
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

import numpy as np

SSM_ARCHITECTURES: tuple[str, ...] = ("mamba", "mamba2", "granitehybrid", "nemotron_h", "nemotron_h_moe", "jamba")
#: llama.cpp's architectures → (HF class, model_type); a ``mamba`` file with ``ssm.dt_b_c_rms`` true is FalconMamba
#: (:data:`FALCON_MAMBA`).
SSM_MODELS: Mapping[str, tuple[str, str]] = MappingProxyType({
    "mamba": ("MambaForCausalLM", "mamba"),
    "mamba2": ("Mamba2ForCausalLM", "mamba2"),
    "granitehybrid": ("GraniteMoeHybridForCausalLM", "granitemoehybrid"),
    "nemotron_h": ("NemotronHForCausalLM", "nemotron_h"),
    "nemotron_h_moe": ("NemotronHForCausalLM", "nemotron_h"),
    "jamba": ("JambaForCausalLM", "jamba"),
})
FALCON_MAMBA: tuple[str, str] = ("FalconMambaForCausalLM", "falcon_mamba")
_MAMBA1_TYPES = ("mamba", "falcon_mamba")
#: The Mamba-2 mixer's tensors (GGUF name, kind) → the mixer's parameter names.
_MIXER: Mapping[tuple[str, str], str] = MappingProxyType({
    ("ssm_in", "weight"): "in_proj.weight",
    ("ssm_conv1d", "weight"): "conv1d.weight",
    ("ssm_conv1d", "bias"): "conv1d.bias",
    ("ssm_dt", "bias"): "dt_bias",
    ("ssm_a", "weight"): "A_log",
    ("ssm_d", "weight"): "D",
    ("ssm_norm", "weight"): "norm.weight",
    ("ssm_out", "weight"): "out_proj.weight",
})
#: The Mamba-1 mixer's tensors (``mamba`` files): x_proj and dt_proj (weight and bias), no gated norm.
_MAMBA1_MIXER: Mapping[tuple[str, str], str] = MappingProxyType({
    ("ssm_in", "weight"): "in_proj.weight",
    ("ssm_conv1d", "weight"): "conv1d.weight",
    ("ssm_conv1d", "bias"): "conv1d.bias",
    ("ssm_x", "weight"): "x_proj.weight",
    ("ssm_dt", "weight"): "dt_proj.weight",
    ("ssm_dt", "bias"): "dt_proj.bias",
    ("ssm_a", "weight"): "A_log",
    ("ssm_d", "weight"): "D",
    ("ssm_out", "weight"): "out_proj.weight",
})
#: jamba: the Mamba-1 mixer with its dt / B / C RMS norms' weights.
_JAMBA_MIXER: Mapping[tuple[str, str], str] = MappingProxyType({
    **_MAMBA1_MIXER,
    ("ssm_dt_norm", "weight"): "dt_layernorm.weight",
    ("ssm_b_norm", "weight"): "b_layernorm.weight",
    ("ssm_c_norm", "weight"): "c_layernorm.weight",
})
_ATTENTION: Mapping[str, str] = MappingProxyType({
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
})
#: granitehybrid: the shared MLP's halves (joined into input_linear by :class:`SharedMlpJoiner`), routed experts.
_GATE, _UP = "shared_mlp.gate_half", "shared_mlp.up_half"
_GRANITE: Mapping[str, str] = MappingProxyType({
    **_ATTENTION,
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": _GATE, "ffn_up": _UP, "ffn_down": "shared_mlp.output_linear",
    "ffn_gate_shexp": _GATE, "ffn_up_shexp": _UP, "ffn_down_shexp": "shared_mlp.output_linear",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
})
_NEMOTRON: Mapping[str, str] = MappingProxyType({
    **{k: "mixer." + v.split(".", 1)[1] for k, v in _ATTENTION.items()},
    "attn_norm": "norm", "ffn_up": "mixer.up_proj", "ffn_down": "mixer.down_proj",
})
#: nemotron_h_moe: the MoE block's tensors (``mixer.experts.<proj>`` stacked: split per expert by :func:`ssm_outputs`).
_NEMOTRON_MOE: Mapping[str, str] = MappingProxyType({
    **_NEMOTRON,
    "ffn_gate_inp": "mixer.gate", "ffn_up_exps": "mixer.experts.up_proj", "ffn_down_exps": "mixer.experts.down_proj",
    "ffn_up_shexp": "mixer.shared_experts.up_proj", "ffn_down_shexp": "mixer.shared_experts.down_proj",
    "ffn_latent_down": "mixer.fc1_latent_proj", "ffn_latent_up": "mixer.fc2_latent_proj",
})
_STACKED_NEMOTRON_EXPERTS = (".mixer.experts.up_proj.weight", ".mixer.experts.down_proj.weight")
#: jamba: NoPE attention, the router, routed SwiGLU experts stacked (split per expert by :func:`ssm_outputs`) or the
#: dense SwiGLU MLP.
_JAMBA: Mapping[str, str] = MappingProxyType({
    **_ATTENTION,
    "attn_norm": "input_layernorm", "ffn_norm": "pre_ff_layernorm",
    "ffn_gate_inp": "feed_forward.router",
    "ffn_gate_exps": "feed_forward.experts.gate_proj", "ffn_up_exps": "feed_forward.experts.up_proj",
    "ffn_down_exps": "feed_forward.experts.down_proj",
    "ffn_gate": "feed_forward.gate_proj", "ffn_up": "feed_forward.up_proj", "ffn_down": "feed_forward.down_proj",
})
_STACKED_JAMBA_EXPERTS = tuple(f".feed_forward.experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj"))
#: Per architecture: the HF prefix of layer N, of the mixer inside it, and the global tensors' names.
_LAYOUT: Mapping[str, tuple[str, str, Mapping[str, str]]] = MappingProxyType({
    "mamba": ("backbone.layers", "mixer", MappingProxyType(
        {"token_embd": "backbone.embeddings", "output_norm": "backbone.norm_f", "output": "lm_head"})),
    "mamba2": ("backbone.layers", "mixer", MappingProxyType(
        {"token_embd": "backbone.embeddings", "output_norm": "backbone.norm_f", "output": "lm_head"})),
    "granitehybrid": ("model.layers", "mamba", MappingProxyType(
        {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"})),
    "nemotron_h": ("backbone.layers", "mixer", MappingProxyType(
        {"token_embd": "backbone.embeddings", "output_norm": "backbone.norm_f", "output": "lm_head"})),
    "nemotron_h_moe": ("backbone.layers", "mixer", MappingProxyType(
        {"token_embd": "backbone.embeddings", "output_norm": "backbone.norm_f", "output": "lm_head"})),
    "jamba": ("model.layers", "mamba", MappingProxyType(
        {"token_embd": "model.embed_tokens", "output_norm": "model.final_layernorm", "output": "lm_head"})),
})
_BLOCK_TENSORS: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "mamba": MappingProxyType({"attn_norm": "norm"}), "mamba2": MappingProxyType({"attn_norm": "norm"}),
    "granitehybrid": _GRANITE, "nemotron_h": _NEMOTRON,
    "nemotron_h_moe": _NEMOTRON_MOE, "jamba": _JAMBA,
})


def map_ssm_tensor_name(gguf_name: str, arch: str) -> str:
    """The HF name of GGUF tensor ``gguf_name`` in a file of SSM architecture ``arch`` (ValueError if it has none)."""
    layers, mixer, globals_ = _LAYOUT[arch]
    mixer_tensors = {"mamba": _MAMBA1_MIXER, "jamba": _JAMBA_MIXER}.get(arch, _MIXER)
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in globals_ and parts[1] == "weight":
        return f"{globals_[parts[0]]}.weight"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit():
        _, layer, base, kind = parts
        if (base, kind) in mixer_tensors:
            return f"{layers}.{layer}.{mixer}.{mixer_tensors[base, kind]}"
        if arch == "nemotron_h_moe" and (base, kind) == ("exp_probs_b", "bias"):
            return f"{layers}.{layer}.mixer.gate.e_score_correction_bias"
        if kind == "weight" and base in _BLOCK_TENSORS[arch]:
            return f"{layers}.{layer}.{_BLOCK_TENSORS[arch][base]}.weight"
    known = sorted({b for b, _ in mixer_tensors} | set(_BLOCK_TENSORS[arch]))
    raise ValueError(f"Unsupported tensor {gguf_name!r} in a GGUF file of architecture {arch!r}; expected "
                     f"{', '.join(f'{g}.weight' for g in globals_)} and blk.N.{{{', '.join(known)}}}.weight (biases: "
                     f"ssm_conv1d.bias, ssm_dt.bias{', exp_probs_b.bias' if arch == 'nemotron_h_moe' else ''})")


def ssm_config(field: Callable[[str, Any], Any], array: Callable[[str], list[Any] | None], arch: str,
               tensor_shapes: Mapping[str, tuple[int, ...]], path: Path) -> dict[str, Any]:
    """The HF config of an SSM file (``field(key, default)``: scalar metadata, ``array(key)``: array metadata or None;
    ``tensor_shapes``: each tensor's shape in numpy order), as llama.cpp reads it."""

    def req(key: str) -> Any:
        v = field(f"{arch}.{key}", None)
        if v is None:
            raise ValueError(f"{path} is not a valid GGUF file: missing metadata key '{arch}.{key}'")
        return v

    if arch == "mamba":
        return _mamba1_config(field, req, tensor_shapes, path)
    if arch == "jamba":
        return _jamba_config(field, array, req, tensor_shapes, path)
    hidden, n_layers = int(req("embedding_length")), int(req("block_count"))
    inner, heads = int(req("ssm.inner_size")), int(req("ssm.time_step_rank"))
    groups, d_state, d_conv = int(req("ssm.group_count")), int(req("ssm.state_size")), int(req("ssm.conv_kernel"))
    if heads <= 0 or inner % heads:
        raise ValueError(f"{path}: {arch}.ssm.inner_size = {inner} is not a multiple of {arch}.ssm.time_step_rank = "
                         f"{heads} (the number of SSM heads)")
    if groups <= 0 or heads % groups:
        raise ValueError(f"{path}: {arch}.ssm.group_count = {groups}; it must divide the {heads} SSM heads")
    eps = float(req("attention.layer_norm_rms_epsilon"))
    if "token_embd.weight" not in tensor_shapes:
        raise ValueError(f"{path} is not a valid GGUF file: no 'token_embd.weight' tensor")
    vocab = tensor_shapes["token_embd.weight"][0]
    tied = "output.weight" not in tensor_shapes
    hf_arch, model_type = SSM_MODELS[arch]
    base: dict[str, Any] = {"architectures": [hf_arch], "model_type": model_type, "vocab_size": vocab,
                            "hidden_size": hidden, "num_hidden_layers": n_layers, "tie_word_embeddings": tied,
                            "torch_dtype": "float32",
                            "max_position_embeddings": int(field(f"{arch}.context_length", 2048) or 2048)}
    conv_bias = any(n.endswith(".ssm_conv1d.bias") for n in tensor_shapes)
    if inner % hidden:
        raise ValueError(f"{path}: {arch}.ssm.inner_size = {inner} is not a multiple of {arch}.embedding_length = "
                         f"{hidden} (the configs' expand factor is an integer)")
    if arch == "mamba2":
        base.update(num_heads=heads, head_dim=inner // heads, n_groups=groups, state_size=d_state, conv_kernel=d_conv,
                    expand=inner // hidden, use_conv_bias=conv_bias, use_bias=False, layer_norm_epsilon=eps,
                    residual_in_fp32=True)
        return base

    kv = _per_layer(field, array, f"{arch}.attention.head_count_kv", n_layers, path)
    n_head = int(req("attention.head_count"))
    n_kv = max(kv)
    if n_kv <= 0 or n_head <= 0 or n_head % n_kv:
        raise ValueError(f"{path}: {arch}.attention.head_count = {n_head}, head_count_kv = {kv}; a hybrid needs an "
                         "attention layer (head_count_kv > 0) and head_count a multiple of head_count_kv")
    if any(k not in (0, n_kv) for k in kv):
        raise ValueError(f"{path}: {arch}.attention.head_count_kv = {kv}; every attention layer must have the same "
                         "number of KV heads")
    head_dim = int(field(f"{arch}.attention.key_length", 0) or 0) or hidden // n_head
    base.update(num_attention_heads=n_head, num_key_value_heads=n_kv, head_dim=head_dim, attention_bias=False)
    if arch == "granitehybrid":
        return _granite_hybrid(field, base, kv, tensor_shapes, dict(heads=heads, inner=inner, groups=groups,
                                                                     d_state=d_state, d_conv=d_conv, eps=eps,
                                                                     conv_bias=conv_bias), path)
    ff = _per_layer(field, array, f"{arch}.feed_forward_length", n_layers, path)
    kinds = ["attention" if k else "mlp" if f else "mamba" for k, f in zip(kv, ff)]
    widths = {f for f in ff if f}
    if arch == "nemotron_h_moe":
        kinds = ["moe" if kind == "mlp" else kind for kind in kinds]
        base.update(_nemotron_moe(field, arch, kinds, tensor_shapes, hidden, path))
        widths = set()
    if len(widths) > 1:
        raise ValueError(f"{path}: {arch}.feed_forward_length = {ff}; every MLP layer must have the same width")
    base.update(layers_block_type=kinds, intermediate_size=widths.pop() if widths else 4 * hidden,
                mamba_num_heads=heads, mamba_head_dim=inner // heads, n_groups=groups, ssm_state_size=d_state,
                conv_kernel=d_conv, expand=inner // hidden, use_conv_bias=conv_bias, use_bias=False,
                mamba_proj_bias=False, mlp_bias=False, mlp_hidden_act="relu2", layer_norm_epsilon=eps)
    return base


def _mamba1_config(field: Callable[[str, Any], Any], req: Callable[[str], Any],
                   tensor_shapes: Mapping[str, tuple[int, ...]], path: Path) -> dict[str, Any]:
    """MambaConfig (or FalconMambaConfig, where ``mamba.ssm.dt_b_c_rms`` is true) of a ``mamba`` file.
    llama.cpp normalises FalconMamba's dt / B / C with the file's one RMS epsilon (``build_norm``'s
    ``f_norm_rms_eps``), so that is the config's ``mixer_rms_eps`` too."""
    hidden, n_layers = int(req("embedding_length")), int(req("block_count"))
    inner, dt_rank = int(req("ssm.inner_size")), int(req("ssm.time_step_rank"))
    d_state, d_conv = int(req("ssm.state_size")), int(req("ssm.conv_kernel"))
    eps = float(req("attention.layer_norm_rms_epsilon"))
    for key, value in (("embedding_length", hidden), ("block_count", n_layers), ("ssm.inner_size", inner),
                       ("ssm.time_step_rank", dt_rank), ("ssm.state_size", d_state), ("ssm.conv_kernel", d_conv)):
        if value <= 0:
            raise ValueError(f"{path}: mamba.{key} = {value}; it must be positive")
    if inner % hidden:
        raise ValueError(f"{path}: mamba.ssm.inner_size = {inner} is not a multiple of mamba.embedding_length = "
                         f"{hidden} (the configs' expand factor is an integer)")
    if "token_embd.weight" not in tensor_shapes:
        raise ValueError(f"{path} is not a valid GGUF file: no 'token_embd.weight' tensor")
    falcon = bool(field("mamba.ssm.dt_b_c_rms", False))
    hf_arch, model_type = FALCON_MAMBA if falcon else SSM_MODELS["mamba"]
    config: dict[str, Any] = {
        "architectures": [hf_arch], "model_type": model_type, "vocab_size": tensor_shapes["token_embd.weight"][0],
        "hidden_size": hidden, "num_hidden_layers": n_layers,
        "tie_word_embeddings": "output.weight" not in tensor_shapes, "torch_dtype": "float32",
        "max_position_embeddings": int(field("mamba.context_length", 2048) or 2048),
        "intermediate_size": inner, "expand": inner // hidden, "state_size": d_state, "conv_kernel": d_conv,
        "time_step_rank": dt_rank, "use_conv_bias": any(n.endswith(".ssm_conv1d.bias") for n in tensor_shapes),
        "use_bias": False, "layer_norm_epsilon": eps, "residual_in_fp32": True, "hidden_act": "silu",
    }
    if falcon:
        config["mixer_rms_eps"] = eps
    return config


def _mamba1_mixer_shape(hf_name: str, inner: int, n: int, d_conv: int) -> tuple[int, ...] | None:
    """The HF shape of a Mamba-1 mixer's A_log, D, conv and dt bias (None: another tensor)."""
    if hf_name.endswith(".A_log"):
        return (inner, n)
    if hf_name.endswith((".D", ".conv1d.bias", ".dt_proj.bias")):
        return (inner,)
    if hf_name.endswith(".conv1d.weight"):
        return (inner, 1, d_conv)
    return None


def _mamba1_expected_shape(hf_name: str, cfg: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The HF shape of a ``mamba`` file's tensor under its MambaConfig (None: not checked)."""
    h, vocab, inner = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    n, rank, d_conv = cfg["state_size"], cfg["time_step_rank"], cfg["conv_kernel"]
    mixer = _mamba1_mixer_shape(hf_name, inner, n, d_conv)
    if mixer is not None:
        return mixer
    if hf_name.endswith(("norm.weight", "norm_f.weight")):
        return (h,)
    shapes = {"in_proj": (2 * inner, h), "x_proj": (rank + 2 * n, inner), "dt_proj": (inner, rank),
              "out_proj": (h, inner), "embeddings": (vocab, h), "lm_head": (vocab, h)}
    return shapes.get(hf_name.split(".")[-2]) if hf_name.endswith(".weight") else None


def _period_of(flags: list[bool]) -> tuple[int, int] | None:
    """The smallest (period, offset), offset < period, with flags[i] == (i % period == offset) for every layer; None
    where no such pattern fits (or no flag is set)."""
    n = len(flags)
    for period in range(1, n + 1):
        for offset in range(period):
            if all(f == (i % period == offset) for i, f in enumerate(flags)):
                return period, offset
    return None


def _jamba_config(field: Callable[[str, Any], Any], array: Callable[[str], list[Any] | None], req: Callable[[str], Any],
                  tensor_shapes: Mapping[str, tuple[int, ...]], path: Path) -> dict[str, Any]:
    """JambaConfig of a ``jamba`` file (JambaModel): attention layers where ``attention.head_count_kv`` is non-zero,
    MoE feed-forwards where the layer has ``ffn_gate_inp``; both must be periodic (JambaConfig's
    ``{attn,expert}_layer_{period,offset}``)."""
    arch = "jamba"
    hidden, n_layers = int(req("embedding_length")), int(req("block_count"))
    inner, dt_rank = int(req("ssm.inner_size")), int(req("ssm.time_step_rank"))
    d_state, d_conv = int(req("ssm.state_size")), int(req("ssm.conv_kernel"))
    n_head = int(req("attention.head_count"))
    eps = float(req("attention.layer_norm_rms_epsilon"))
    for key, value in (("embedding_length", hidden), ("block_count", n_layers), ("ssm.inner_size", inner),
                       ("ssm.time_step_rank", dt_rank), ("ssm.state_size", d_state), ("ssm.conv_kernel", d_conv),
                       ("attention.head_count", n_head)):
        if value <= 0:
            raise ValueError(f"{path}: {arch}.{key} = {value}; it must be positive")
    if inner % hidden:
        raise ValueError(f"{path}: {arch}.ssm.inner_size = {inner} is not a multiple of {arch}.embedding_length = "
                         f"{hidden} (JambaConfig's mamba_expand is an integer)")
    if hidden % n_head:
        raise ValueError(f"{path}: {arch}.attention.head_count = {n_head} does not divide {arch}.embedding_length = "
                         f"{hidden} (Jamba's head_dim)")
    if "token_embd.weight" not in tensor_shapes:
        raise ValueError(f"{path} is not a valid GGUF file: no 'token_embd.weight' tensor")
    for bias in ("ssm_in", "ssm_out"):
        if any(n.endswith(f".{bias}.bias") for n in tensor_shapes):
            raise ValueError(f"{path}: blk.N.{bias}.bias (mamba_proj_bias) is not supported for {arch} files "
                             "(llama.cpp loads none)")
    kv = _per_layer(field, array, f"{arch}.attention.head_count_kv", n_layers, path)
    n_kv = max(kv)
    if n_kv <= 0 or n_head % n_kv or any(k not in (0, n_kv) for k in kv):
        raise ValueError(f"{path}: {arch}.attention.head_count = {n_head}, head_count_kv = {kv}; Jamba needs an "
                         "attention layer (head_count_kv > 0), the same KV heads on each, dividing head_count")
    ff = _per_layer(field, array, f"{arch}.feed_forward_length", n_layers, path)
    if len(set(ff)) != 1 or ff[0] <= 0:
        raise ValueError(f"{path}: {arch}.feed_forward_length = {ff}; Jamba's feed-forwards share one positive width")
    attn = _period_of([k > 0 for k in kv])
    if attn is None:
        raise ValueError(f"{path}: {arch}.attention.head_count_kv = {kv}; the attention layers (head_count_kv > 0) "
                         "must recur with a fixed period and offset (JambaConfig's attn_layer_period / "
                         "attn_layer_offset)")
    moe_flags = [f"blk.{i}.ffn_gate_inp.weight" in tensor_shapes for i in range(n_layers)]
    config: dict[str, Any] = {
        "architectures": [SSM_MODELS[arch][0]], "model_type": SSM_MODELS[arch][1],
        "vocab_size": tensor_shapes["token_embd.weight"][0], "hidden_size": hidden, "num_hidden_layers": n_layers,
        "tie_word_embeddings": "output.weight" not in tensor_shapes, "torch_dtype": "float32",
        "max_position_embeddings": int(field(f"{arch}.context_length", 2048) or 2048),
        "intermediate_size": ff[0], "num_attention_heads": n_head, "num_key_value_heads": n_kv,
        "attn_layer_period": attn[0], "attn_layer_offset": attn[1], "rms_norm_eps": eps, "hidden_act": "silu",
        "mamba_d_state": d_state, "mamba_d_conv": d_conv, "mamba_expand": inner // hidden, "mamba_dt_rank": dt_rank,
        "mamba_conv_bias": any(n.endswith(".ssm_conv1d.bias") for n in tensor_shapes), "mamba_proj_bias": False,
        "use_mamba_kernels": False,
    }
    if not any(moe_flags):
        config.update(num_experts=1, num_experts_per_tok=1, expert_layer_period=1, expert_layer_offset=0)
        return config
    n_expert = int(field(f"{arch}.expert_count", 0) or 0)
    used = int(field(f"{arch}.expert_used_count", 0) or 0)
    if n_expert <= 1 or not 0 < used <= n_expert:
        raise ValueError(f"{path}: {arch}.expert_count = {n_expert or 'missing'}, {arch}.expert_used_count = "
                         f"{used or 'missing'}; a jamba file with MoE layers (ffn_gate_inp) needs 1 <= "
                         "expert_used_count <= expert_count, expert_count > 1")
    moe = _period_of(moe_flags)
    if moe is None:
        raise ValueError(f"{path}: the MoE layers (those with ffn_gate_inp) are "
                         f"{[i for i, f in enumerate(moe_flags) if f]}; they must recur with a fixed period and offset "
                         "(JambaConfig's expert_layer_period / expert_layer_offset)")
    for i, is_moe in enumerate(moe_flags):
        need = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps") if is_moe else ("ffn_gate", "ffn_up", "ffn_down")
        missing = [b for b in need if f"blk.{i}.{b}.weight" not in tensor_shapes]
        if missing:
            raise ValueError(f"{path}: layer {i} is {'an MoE' if is_moe else 'a dense MLP'} layer "
                             f"({'with' if is_moe else 'without'} ffn_gate_inp) but has no "
                             f"{', '.join(f'blk.{i}.{b}.weight' for b in missing)}")
    config.update(num_experts=n_expert, num_experts_per_tok=used, expert_layer_period=moe[0],
                  expert_layer_offset=moe[1])
    return config


def _jamba_expected_shape(hf_name: str, cfg: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The HF shape of a ``jamba`` file's tensor under its JambaConfig (None: not checked)."""
    h, vocab, ff = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    inner, n, rank, d_conv = cfg["mamba_expand"] * h, cfg["mamba_d_state"], cfg["mamba_dt_rank"], cfg["mamba_d_conv"]
    head_dim = h // cfg["num_attention_heads"]
    q, kv, experts = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim, cfg["num_experts"]
    mixer = _mamba1_mixer_shape(hf_name, inner, n, d_conv)
    if mixer is not None:
        return mixer
    if hf_name.endswith(".dt_layernorm.weight"):
        return (rank,)
    if hf_name.endswith((".b_layernorm.weight", ".c_layernorm.weight")):
        return (n,)
    if hf_name.endswith("layernorm.weight"):
        return (h,)
    if ".feed_forward.experts." in hf_name:
        return (experts, h, ff) if hf_name.endswith(".down_proj.weight") else (experts, ff, h)
    shapes = {"in_proj": (2 * inner, h), "x_proj": (rank + 2 * n, inner), "dt_proj": (inner, rank),
              "out_proj": (h, inner), "embed_tokens": (vocab, h), "lm_head": (vocab, h), "q_proj": (q, h),
              "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "router": (experts, h), "gate_proj": (ff, h),
              "up_proj": (ff, h), "down_proj": (h, ff)}
    return shapes.get(hf_name.split(".")[-2]) if hf_name.endswith(".weight") else None


def _nemotron_moe(field: Callable[[str, Any], Any], arch: str, kinds: list[str],
                  tensor_shapes: Mapping[str, tuple[int, ...]], hidden: int, path: Path) -> dict[str, Any]:
    """NemotronHConfig's MoE fields of a nemotron_h_moe file (``kinds``: each layer's block, "moe" where
    feed_forward_length is non-zero)."""
    moe_layers = [i for i, kind in enumerate(kinds) if kind == "moe"]
    if not moe_layers:
        raise ValueError(f"{path}: {arch}.feed_forward_length is 0 on every non-attention layer; a nemotron_h_moe file "
                         "marks its MoE layers with their expert width there")
    n_expert = int(field(f"{arch}.expert_count", 0) or 0)
    used = int(field(f"{arch}.expert_used_count", 0) or 0)
    if n_expert <= 0 or not 0 < used <= n_expert:
        raise ValueError(f"{path}: {arch}.expert_count = {n_expert or 'missing'}, {arch}.expert_used_count = "
                         f"{used or 'missing'}; a nemotron_h_moe file needs 1 <= expert_used_count <= expert_count")
    first = moe_layers[0]

    def shape(base: str, required: bool = True) -> tuple[int, ...] | None:
        s = tensor_shapes.get(f"blk.{first}.{base}.weight")
        if s is None and required:
            raise ValueError(f"{path}: layer {first} is an MoE layer (feed_forward_length > 0) but has no "
                             f"blk.{first}.{base}.weight tensor")
        return s

    down, shared, router = shape("ffn_down_exps"), shape("ffn_down_shexp"), shape("ffn_gate_inp")
    latent_down = shape("ffn_latent_down", required=False)
    if len(down) != 3 or down[0] != n_expert or router != (n_expert, hidden):
        raise ValueError(f"{path}: blk.{first}.ffn_down_exps has shape {list(down)} and ffn_gate_inp {list(router)} "
                         f"(numpy order); {arch}.expert_count = {n_expert} with hidden size {hidden} needs "
                         f"[{n_expert}, d, expert width] and [{n_expert}, {hidden}]")
    latent = int(field(f"{arch}.moe_latent_size", 0) or 0) or (latent_down[0] if latent_down else 0)
    if (latent_down is not None) != bool(latent) or (latent_down is not None and latent_down != (latent, hidden)):
        raise ValueError(f"{path}: {arch}.moe_latent_size = {latent or 'missing'} but blk.{first}.ffn_latent_down is "
                         f"{list(latent_down) if latent_down else 'missing'}; a latent MoE needs both")
    width = int(field(f"{arch}.expert_feed_forward_length", 0) or 0) or down[2]
    groups = int(field(f"{arch}.expert_group_count", 0) or 0) or 1
    groups_used = int(field(f"{arch}.expert_group_used_count", 0) or 0) or groups
    if n_expert % groups or not 1 <= groups_used <= groups:
        raise ValueError(f"{path}: {arch}.expert_group_count = {groups}, expert_group_used_count = {groups_used}; the "
                         f"groups must divide the {n_expert} experts and at most all of them be used")
    scale = float(field(f"{arch}.expert_weights_scale", 0.0) or 0.0)
    if not math.isfinite(scale):
        raise ValueError(f"{path}: {arch}.expert_weights_scale = {scale}; it must be a finite number")
    shared_width = int(field(f"{arch}.expert_shared_feed_forward_length", 0) or 0) or shared[1]
    return {"n_routed_experts": n_expert, "num_experts_per_tok": used, "moe_intermediate_size": width,
            "moe_shared_expert_intermediate_size": shared_width,
            "n_shared_experts": int(field(f"{arch}.expert_shared_count", 1) or 1), "n_group": groups,
            "topk_group": groups_used, "norm_topk_prob": bool(field(f"{arch}.expert_weights_norm", False)),
            "routed_scaling_factor": scale or 1.0, "moe_latent_size": latent or None}


def _per_layer(field: Callable[[str, Any], Any], array: Callable[[str], list[Any] | None], key: str, n_layers: int,
               path: Path) -> list[int]:
    """A per-layer metadata value, one entry per layer (a scalar applies to every layer, as llama.cpp's
    get_key_or_arr)."""
    values = array(key)
    if values is None:
        scalar = field(key, None)
        if scalar is None:
            raise ValueError(f"{path} is not a valid GGUF file: missing metadata key '{key}' (a hybrid's per-layer "
                             "array: 0 marks a Mamba layer)")
        return [int(scalar)] * n_layers
    if len(values) != n_layers:
        raise ValueError(f"{path}: {key} has {len(values)} entries for {n_layers} layers")
    return [int(v) for v in values]


def _granite_hybrid(field: Callable[[str, Any], Any], base: dict[str, Any], kv: list[int],
                    tensor_shapes: Mapping[str, tuple[int, ...]], ssm: dict[str, Any], path: Path) -> dict[str, Any]:
    """GraniteMoeHybridConfig's own fields: layer kinds, the shared MLP, experts, multipliers and RoPE."""
    arch = "granitehybrid"

    def scale(key: str, default: float) -> float:
        value = float(field(f"{arch}.{key}", 0.0) or 0.0)
        if not math.isfinite(value):
            raise ValueError(f"{path}: {arch}.{key} = {value}; it must be a finite number")
        return value or default

    hidden = base["hidden_size"]
    n_expert = int(field(f"{arch}.expert_count", 0) or 0)
    shexp = "ffn_down_shexp" if n_expert else "ffn_down"
    down = next((s for n, s in tensor_shapes.items() if n.endswith(f".{shexp}.weight")), None)
    if down is None:
        raise ValueError(f"{path}: no blk.N.{shexp}.weight tensor (Granite's shared MLP"
                         f"{' beside the routed experts' if n_expert else ''})")
    shared = int(field(f"{arch}.expert_shared_feed_forward_length", 0) or 0) or down[1]
    out = dict(base)
    if n_expert:
        used = int(field(f"{arch}.expert_used_count", 0) or 0)
        if not 0 < used <= n_expert:
            raise ValueError(f"{path}: {arch}.expert_used_count = {used or 'missing'}; it must lie in [1, "
                             f"{arch}.expert_count = {n_expert}]")
        exps = next((s for n, s in tensor_shapes.items() if n.endswith(".ffn_down_exps.weight")), None)
        if exps is None or len(exps) != 3:
            raise ValueError(f"{path}: {arch}.expert_count = {n_expert} but no merged expert tensor "
                             "blk.N.ffn_down_exps.weight [experts, hidden, expert width]")
        out.update(num_local_experts=n_expert, num_experts_per_tok=used, intermediate_size=exps[2])
    else:
        out.update(num_local_experts=0, num_experts_per_tok=1, intermediate_size=shared)
    rope = field(f"{arch}.rope.scaling.finetuned", None)
    use_rope = True if rope is None else bool(rope)
    n_rot = field(f"{arch}.rope.dimension_count", None)
    if use_rope and n_rot is not None and int(n_rot) != base["head_dim"]:
        raise ValueError(f"{path}: {arch}.rope.dimension_count = {n_rot} rotates part of each {base['head_dim']}-wide "
                         "head; only whole-head RoPE is supported for granitehybrid")
    out.update(
        layer_types=["attention" if k else "mamba" for k in kv], shared_intermediate_size=shared,
        rms_norm_eps=ssm["eps"], hidden_act="silu", position_embedding_type="rope" if use_rope else "nope",
        rope_parameters={"rope_type": "default", "rope_theta": float(field(f"{arch}.rope.freq_base", 10000.0))},
        embedding_multiplier=scale("embedding_scale", 1.0), residual_multiplier=scale("residual_scale", 1.0),
        attention_multiplier=scale("attention.scale", base["head_dim"] ** -0.5),
        logits_scaling=scale("logit_scale", 1.0),
        mamba_n_heads=ssm["heads"], mamba_d_head=ssm["inner"] // ssm["heads"], mamba_n_groups=ssm["groups"],
        mamba_d_state=ssm["d_state"], mamba_d_conv=ssm["d_conv"], mamba_expand=ssm["inner"] // hidden,
        mamba_conv_bias=ssm["conv_bias"], mamba_proj_bias=False,
    )
    return out


def ssm_expected_shape(hf_name: str, cfg: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The shape (HF layout, after :func:`ssm_tensor`) a non-expert tensor must have under ``cfg`` (None: not
    checked)."""
    if cfg.get("model_type") in _MAMBA1_TYPES:
        return _mamba1_expected_shape(hf_name, cfg)
    if cfg.get("model_type") == "jamba":
        return _jamba_expected_shape(hf_name, cfg)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    if "num_heads" in cfg:  # Mamba2Config
        heads, head_dim, groups, d_state, d_conv = (cfg["num_heads"], cfg["head_dim"], cfg["n_groups"],
                                                    cfg["state_size"], cfg["conv_kernel"])
    elif "mamba_n_heads" in cfg:  # GraniteMoeHybridConfig
        heads, head_dim, groups, d_state, d_conv = (cfg["mamba_n_heads"], cfg["mamba_d_head"], cfg["mamba_n_groups"],
                                                    cfg["mamba_d_state"], cfg["mamba_d_conv"])
    else:  # NemotronHConfig
        heads, head_dim, groups, d_state, d_conv = (cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["n_groups"],
                                                    cfg["ssm_state_size"], cfg["conv_kernel"])
    inner = heads * head_dim
    conv_dim = inner + 2 * groups * d_state
    q = cfg.get("num_attention_heads", 0) * cfg.get("head_dim", 0)
    kv = cfg.get("num_key_value_heads", 0) * cfg.get("head_dim", 0)
    ff = cfg.get("shared_intermediate_size") or cfg.get("intermediate_size", 0)
    if hf_name.endswith((".dt_bias", ".A_log", ".D")):
        return (heads,)
    if hf_name.endswith((".mixer.norm.weight", ".mamba.norm.weight")):  # the gated norm over d_inner
        return (inner,)
    if hf_name.endswith("norm.weight") or hf_name.endswith("norm_f.weight"):  # a block's or the final norm
        return (h,)
    shapes = {
        "in_proj": (2 * inner + 2 * groups * d_state + heads, h), "out_proj": (h, inner),
        "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
        "embed_tokens": (vocab, h), "embeddings": (vocab, h), "lm_head": (vocab, h),
        "input_linear": (2 * ff, h), "output_linear": (h, ff), "gate_half": (ff, h), "up_half": (ff, h),
        "up_proj": (ff, h), "down_proj": (h, ff), "gate": (cfg.get("num_local_experts", 0), h),
    }
    if cfg.get("n_routed_experts") and ".mixer." in hf_name:  # nemotron_h_moe's MoE block
        n, width, latent = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg.get("moe_latent_size") or h
        shared = cfg["moe_shared_expert_intermediate_size"]
        moe = {"mixer.gate.weight": (n, h), "mixer.gate.e_score_correction_bias": (n,),
               "mixer.experts.up_proj.weight": (n, width, latent), "mixer.experts.down_proj.weight": (n, latent, width),
               "mixer.shared_experts.up_proj.weight": (shared, h), "mixer.shared_experts.down_proj.weight": (h, shared),
               "mixer.fc1_latent_proj.weight": (latent, h), "mixer.fc2_latent_proj.weight": (h, latent)}
        for suffix, want in moe.items():
            if hf_name.endswith("." + suffix):
                return want
    if hf_name.endswith(".conv1d.weight"):
        return (conv_dim, 1, d_conv)
    if hf_name.endswith(".conv1d.bias"):
        return (conv_dim,)
    return shapes.get(hf_name.split(".")[-2]) if hf_name.endswith(".weight") else None


def ssm_tensor(hf_name: str, arr: np.ndarray, arch: str = "mamba2") -> np.ndarray:
    """A GGUF SSM tensor (float32, numpy order) in HF's layout: A_log = log(−A) from ssm_a [heads, 1] (Mamba-1's
    ``mamba``: [d_inner, d_state], kept 2-D), D from [heads, 1], the conv weight [conv_dim, d_conv] → [conv_dim, 1,
    d_conv], the gated norm [groups, d_inner / groups] flattened."""
    if hf_name.endswith(".A_log"):
        a = arr.astype(np.float64)
        if not np.all(a < 0):
            raise ValueError(f"{hf_name}: ssm_a holds A = -exp(A_log), which is negative; found values >= 0")
        a_log = np.log(-a).astype(np.float32)
        return a_log if arch in ("mamba", "jamba") else a_log.reshape(-1)
    if hf_name.endswith((".D", ".dt_bias")) or (hf_name.endswith(".norm.weight") and arr.ndim == 2):
        return np.ascontiguousarray(arr.reshape(-1))
    if hf_name.endswith(".conv1d.weight") and arr.ndim == 2:
        return np.ascontiguousarray(arr[:, None, :])
    return arr


def ssm_outputs(hf_name: str, arr: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """What the checkpoint holds for a converted SSM tensor: nemotron_h_moe's stacked experts (``mixer.experts.<proj>``
    [E, rows, columns], shape already checked) split into ``mixer.experts.E.<proj>.weight`` (jamba's
    ``feed_forward.experts.<proj>`` likewise); any other as is."""
    if not hf_name.endswith(_STACKED_NEMOTRON_EXPERTS + _STACKED_JAMBA_EXPERTS):
        return [(hf_name, arr)]
    proj = hf_name.split(".")[-2]
    prefix = hf_name[: -len(f".{proj}.weight")]
    return [(f"{prefix}.{e}.{proj}.weight", np.ascontiguousarray(arr[e])) for e in range(arr.shape[0])]


class SharedMlpJoiner:
    """granitehybrid's shared MLP: the converter's gate and up halves (``ffn_gate`` / ``ffn_up`` or their _shexp
    twins) joined back into ``shared_mlp.input_linear`` (gate rows, then up), per layer."""

    def __init__(self) -> None:
        self.pending: dict[str, dict[str, np.ndarray]] = {}

    @staticmethod
    def is_half(hf_name: str) -> bool:
        return hf_name.endswith((f"{_GATE}.weight", f"{_UP}.weight"))

    def add(self, hf_name: str, arr: np.ndarray) -> tuple[str, np.ndarray] | None:
        """The joined tensor once both halves of a layer are in, else None."""
        prefix = hf_name[: -len(".weight")]
        prefix, half = prefix[: prefix.rindex(".shared_mlp.")], prefix[prefix.rindex(".shared_mlp.") + 1:]
        pair = self.pending.setdefault(prefix, {})
        pair[half] = arr
        if len(pair) < 2:
            return None
        del self.pending[prefix]
        joined = np.concatenate([pair[_GATE], pair[_UP]])
        return f"{prefix}.shared_mlp.input_linear.weight", np.ascontiguousarray(joined)

    def check_complete(self, path: Path) -> None:
        if self.pending:
            prefix, pair = next(iter(self.pending.items()))
            have = "gate" if _GATE in pair else "up"
            missing = "up" if have == "gate" else "gate"
            raise ValueError(f"{path}: layer {prefix.rsplit('.', 1)[-1]} has the shared MLP's ffn_{have}(_shexp) "
                             f"but no ffn_{missing}(_shexp); Granite's shared MLP needs both")
