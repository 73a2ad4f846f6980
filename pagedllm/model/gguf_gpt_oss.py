"""llama.cpp's ``gpt-oss`` GGUF files (gpt-oss-20b / -120b as convert_hf_to_gguf.py's GptOssModel writes them) as
transformers' GptOssForCausalLM (models/gpt_oss.py).

What the converter writes: Llama-shaped tensors with biased q/k/v/o, ``post_attention_norm`` (HF's
post_attention_layernorm, the norm before the experts), ``attn_sinks.weight`` [heads] (HF's ``self_attn.sinks``),
the router ``ffn_gate_inp`` (weight and bias) and the experts merged per layer: gate and up de-interleaved from HF's
gate_up_proj into ``ffn_gate_exps`` / ``ffn_up_exps`` [experts, width, hidden] (or fused into ``ffn_gate_up_exps``,
gate rows then up), ``ffn_down_exps`` [experts, hidden, width], each with a ``.bias`` [experts, rows]; the released
checkpoints' MXFP4 experts stay MXFP4 (GGML type 39; on the CPU served from those blocks, like the other quantized
expert types: gguf_moe.py). Keys: ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length`` (the
experts' width), ``attention.sliding_window``, YaRN's ``rope.scaling.{type,factor,original_context_length}`` and
optionally ``rope.scaling.yarn_beta_fast`` / ``yarn_beta_slow``. llama.cpp hard-codes the rest for gpt-oss: every
other layer is local (``set_swa_pattern(2)``: layer 0 slides), the swigluoai limit 7.0 and alpha 1.702, softmax
routing over the top-k logits.

Where llama.cpp and transformers differ, transformers is followed (the tests compare with it): its gpt-oss YaRN does
not round the correction range to whole dimensions (``truncate`` false in every released config).
"""
from __future__ import annotations

import re
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping

ARCH = "gpt-oss"
#: Block tensors → HF names. Expert biases keep the expert tensors' names (``mlp.experts.gate_proj.bias`` [E, I]):
#: models/gpt_oss.py loads them; ``attn_sinks.weight`` becomes ``self_attn.sinks`` (:func:`hf_tensor_name`).
GPT_OSS_TENSORS: Mapping[str, str] = MappingProxyType({
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_sinks": "self_attn.sinks",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
})
_EXPERT_WEIGHT = re.compile(r"^blk\.\d+\.ffn_(gate|up|down|gate_up)_exps\.weight$")
#: What marks the converted config of a file whose experts are all MXFP4 (as the released HF checkpoints' config).
MXFP4_QUANTIZATION_CONFIG: Mapping[str, str] = MappingProxyType({"quant_method": "mxfp4"})
#: llama.cpp's hard-coded local / global period for gpt-oss (layer i is global when i % 2 == 1).
SLIDING_PERIOD = 2
_DEFAULT_WINDOW = 128
_YARN_BETA_FAST, _YARN_BETA_SLOW = 32.0, 1.0


def hf_tensor_name(hf_name: str) -> str:
    """The mapped name as models/gpt_oss.py loads it: the sinks are a parameter of the attention, not a module."""
    return hf_name.removesuffix(".weight") if hf_name.endswith(".self_attn.sinks.weight") else hf_name


def is_expert_bias(hf_name: str) -> bool:
    """True for a gpt-oss expert bias (``...mlp.experts.<proj>.bias``): a plain tensor, not blocks to split."""
    return ".mlp.experts." in hf_name and hf_name.endswith(".bias")


def expected_shape(hf_name: str, cfg: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The HF shape of a gpt-oss-only tensor (router, sinks, expert biases); None for the others."""
    if not (".mlp.router." in hf_name or hf_name.endswith(".self_attn.sinks") or is_expert_bias(hf_name)):
        return None
    n, h, ff = int(cfg["num_local_experts"]), int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    if hf_name.endswith(".self_attn.sinks"):
        return (int(cfg["num_attention_heads"]),)
    if ".mlp.router." in hf_name:
        return (n, h) if hf_name.endswith(".weight") else (n,)
    proj = hf_name.rsplit(".", 2)[-2]
    return (n, {"gate_proj": ff, "up_proj": ff, "gate_up_proj": 2 * ff, "down_proj": h}[proj])


def gpt_oss_config(field: Callable[[str, Any], Any], base: Mapping[str, Any], tensor_types: Mapping[str, str],
                   layer_types: list[str], path: Path) -> dict[str, Any]:
    """The GptOssConfig fields of a gpt-oss GGUF beyond the shared ones in ``base`` (``field(key, default)``: the
    file's metadata; ``tensor_types``: each tensor's GGML type name; ``layer_types``: each layer's attention,
    llama.cpp's pattern). A file whose experts are all MXFP4 gets the released checkpoints' quantization_config: on
    CUDA they then stay MXFP4 (:func:`mxfp4_expert_weights`)."""
    tensor_names = set(tensor_types)
    n_expert = int(field(f"{ARCH}.expert_count", 0) or 0)
    n_used = int(field(f"{ARCH}.expert_used_count", 0) or 0)
    if n_expert <= 0 or not 0 < n_used <= n_expert:
        raise ValueError(f"{path} is not a valid gpt-oss GGUF file: {ARCH}.expert_count = {n_expert or 'missing'} "
                         f"and {ARCH}.expert_used_count = {n_used or 'missing'}; both must be set, with "
                         "0 < expert_used_count <= expert_count")
    if "blk.0.attn_sinks.weight" not in tensor_names:
        raise ValueError(f"{path}: gpt-oss files carry each layer's attention sinks (blk.N.attn_sinks.weight); "
                         "this one has none")
    width = int(field(f"{ARCH}.expert_feed_forward_length", 0) or 0) or int(base["intermediate_size"])
    window = int(field(f"{ARCH}.attention.sliding_window", _DEFAULT_WINDOW) or 0)
    if window <= 0:
        raise ValueError(f"{path}: {ARCH}.attention.sliding_window = {window}; gpt-oss's local layers need a "
                         "positive window")
    out: dict[str, Any] = {
        "num_local_experts": n_expert, "num_experts_per_tok": n_used, "intermediate_size": width,
        "sliding_window": window, "layer_types": layer_types, "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "swiglu_limit": 7.0, "mlp_bias": False,
    }
    # Explicit RoPE parameters: GptOssConfig's default (without them) is gpt-oss's YaRN, not the file's RoPE.
    scaling = base.get("rope_scaling") or {}
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(base["rope_theta"])}
    if scaling.get("rope_type") == "yarn":
        rope.update(scaling, beta_fast=float(field(f"{ARCH}.rope.scaling.yarn_beta_fast", _YARN_BETA_FAST)),
                    beta_slow=float(field(f"{ARCH}.rope.scaling.yarn_beta_slow", _YARN_BETA_SLOW)), truncate=False)
    elif scaling:
        raise ValueError(f"{path}: {ARCH} with RoPE scaling {scaling['rope_type']!r}; gpt-oss files use yarn or none")
    out.update(rope_parameters=rope, rope_scaling=None)
    experts = [t for name, t in tensor_types.items() if _EXPERT_WEIGHT.match(name)]
    if experts and all(t == "MXFP4" for t in experts):
        out["quantization_config"] = dict(MXFP4_QUANTIZATION_CONFIG)
    return out


def mxfp4_expert_weights(gguf_path: str | Path, num_experts: int
                         ) -> tuple[frozenset[str], Iterator[tuple[str, Any]]]:
    """A gpt-oss GGUF's MXFP4 experts as the released checkpoints name and lay them out (``mlp.experts.gate_up_proj
    _blocks`` [E, 2I, G, 16] with gate / up rows interleaved, ``_scales`` [E, 2I, G], ``down_proj_blocks`` /
    ``_scales``), for a model that holds its experts MXFP4 (FusedMoE.hold_mxfp4); and the per-expert names
    (``mlp.experts.{e}.gate_proj.weight`` …) the load must then skip (else it dequantizes them from the file)."""
    import numpy as np
    import torch

    from pagedllm.model.gguf_loader import read_gguf_raw_tensors
    from pagedllm.model.mxfp4 import from_ggml_blocks

    raw, _ = read_gguf_raw_tensors(gguf_path)
    layers = sorted({name.rsplit(".mlp.experts.", 1)[0] for name in raw if ".mlp.experts." in name
                     and name.endswith("_proj.weight")})
    held = frozenset(f"{layer}.mlp.experts.{e}.{p}_proj.weight" for layer in layers for e in range(num_experts)
                     for p in ("gate", "up", "down"))

    def pairs(layer: str) -> Iterator[tuple[str, Any]]:
        prefix = f"{layer}.mlp.experts"
        if f"{prefix}.gate_up_proj.weight" in raw:  # fused: gate rows, then up
            fused = torch.from_numpy(np.array(raw[f"{prefix}.gate_up_proj.weight"].blocks))
            gate, up = fused.chunk(2, dim=1)
        else:
            gate, up = (torch.from_numpy(np.array(raw[f"{prefix}.{p}_proj.weight"].blocks)) for p in ("gate", "up"))
        (gb, gs), (ub, us) = from_ggml_blocks(gate), from_ggml_blocks(up)
        yield f"{prefix}.gate_up_proj_blocks", torch.stack([gb, ub], dim=2).flatten(1, 2)  # rows interleaved
        yield f"{prefix}.gate_up_proj_scales", torch.stack([gs, us], dim=2).flatten(1, 2)
        db, ds = from_ggml_blocks(torch.from_numpy(np.array(raw[f"{prefix}.down_proj.weight"].blocks)))
        yield f"{prefix}.down_proj_blocks", db
        yield f"{prefix}.down_proj_scales", ds

    def weights() -> Iterator[tuple[str, Any]]:
        for layer in layers:
            yield from pairs(layer)

    return held, weights()
