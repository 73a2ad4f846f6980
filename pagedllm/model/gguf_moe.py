"""Mixture-of-experts GGUF files (llama.cpp's layout): Mixtral (architecture ``llama`` with ``llama.expert_count``),
``qwen2moe``, ``qwen3moe`` and ``granitemoe``; ``deepseek2``'s experts too (its config: gguf_deepseek.py).

llama.cpp stores each layer's experts merged: ``ffn_gate_exps`` / ``ffn_up_exps`` [n_expert, n_ff_exp, n_embd] and
``ffn_down_exps`` [n_expert, n_embd, n_ff_exp] (numpy order; newer converters may fuse gate | up into one
``ffn_gate_up_exps`` [n_expert, 2 · n_ff_exp, n_embd]), the router ``ffn_gate_inp`` [n_expert, n_embd] and Qwen2-MoE's
shared expert ``ffn_{gate,up,down}_shexp`` with its sigmoid gate ``ffn_gate_inp_shexp`` [n_embd]. The conversion splits
the merged tensors into per-expert matrices (``mlp.experts.{e}.gate_proj`` …), which the MoE model classes
(models/moe.py) stack into their FusedMoE weights. Mixtral files from before April 2024 store one matrix per expert
(``blk.N.ffn_gate.E.weight``): those map to the per-expert names directly. With quantization='gguf' on the CPU,
experts in a type the quantized linears run keep their blocks instead (layers/quantized_linear.attach_gguf_experts);
the converted cache holds no float copy of those (:func:`keeps_blocks`): a float load (quantization='none', GPUs)
dequantizes them from the GGUF, one expert matrix at a time (:func:`dequantized_experts`).
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping

import numpy as np

logger = logging.getLogger("pagedllm")

#: llama.cpp's router and routed-expert tensors → pagedllm's names (``experts.<proj>`` is stacked: split per expert).
MOE_TENSORS: Mapping[str, str] = MappingProxyType({
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",  # gate rows, then up (convert_hf_to_gguf --fuse-gate-up-exps)
})
#: Qwen2-MoE's shared expert and its gate (one logit per token, through a sigmoid).
SHARED_EXPERT_TENSORS: Mapping[str, str] = MappingProxyType({
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
})
#: The MoE classes by llama.cpp architecture; ``llama`` files with experts are Mixtral's.
MOE_MODELS: Mapping[str, tuple[str, str]] = MappingProxyType({
    "llama": ("MixtralForCausalLM", "mixtral"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "granitemoe": ("GraniteMoeForCausalLM", "granitemoe"),
})
#: Whether llama.cpp renormalizes the top-k routing weights (build_moe_ffn's ``norm_w``), hard-coded per architecture:
#: these files record no key for it (llama.cpp does not read ``expert_weights_norm`` for them). Qwen2-MoE: no
#: (Qwen1.5-MoE's norm_topk_prob = false); Qwen3-MoE: yes. Mixtral and Granite MoE always renormalize (their HF classes
#: have no switch).
_NORM_TOPK_PROB: Mapping[str, bool] = MappingProxyType({"qwen2moe": False, "qwen3moe": True})
_STACKED_RE = re.compile(r"\.mlp\.experts\.(gate_proj|up_proj|down_proj|gate_up_proj)\.(weight|bias)$")
_PER_EXPERT_RE = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_BLOCK_RE = re.compile(
    r"^blk\.\d+\.(ffn_gate_inp|ffn_(gate|up|down|gate_up)_(exps|shexp)|ffn_gate_inp_shexp|ffn_(gate|up|down)\.\d+)\.")
_LEGACY_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")
_FLOAT_TYPES = ("F32", "F16", "BF16")


def is_stacked_experts(hf_name: str) -> bool:
    """True for the merged expert tensors (``...mlp.experts.gate_proj.weight``), which the conversion splits."""
    return _STACKED_RE.search(hf_name) is not None


def is_float_type(type_name: str) -> bool:
    """True for GGUF's float tensor types (no dequantization error)."""
    return type_name in _FLOAT_TYPES


def legacy_expert_name(gguf_name: str) -> str | None:
    """The HF name of one expert's matrix in a pre-April-2024 Mixtral file (``blk.N.ffn_gate.E.weight``), else None."""
    m = _LEGACY_EXPERT_RE.match(gguf_name)
    return None if m is None else f"model.layers.{m[1]}.mlp.experts.{m[3]}.{m[2]}_proj.weight"


def is_expert_tensor(hf_name: str) -> bool:
    """True for routed-expert weights, merged or one per expert."""
    return is_stacked_experts(hf_name) or _PER_EXPERT_RE.search(hf_name) is not None


def _num_experts(cfg: Mapping[str, Any]) -> int:
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)


def _expert_width(cfg: Mapping[str, Any]) -> int:
    return int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])


def moe_expected_shape(hf_name: str, cfg: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The shape (HF layout) a MoE tensor must have under ``cfg`` (None: not a MoE tensor)."""
    h = cfg["hidden_size"]
    if ".mlp.shared_expert." in hf_name:
        ff = int(cfg.get("shared_expert_intermediate_size") or 0)
        return (h, ff) if ".down_proj." in hf_name else (ff, h)
    if hf_name.endswith(".mlp.shared_expert_gate.weight"):
        return (1, h)
    n, ff = _num_experts(cfg), _expert_width(cfg)
    if hf_name.endswith(".mlp.gate.weight"):
        return (n, h)
    if (one := _PER_EXPERT_RE.search(hf_name)) is not None:
        return (h, ff) if one.group(1) == "down_proj" else (ff, h)
    m = _STACKED_RE.search(hf_name)
    if m is None:
        return None
    return {"gate_proj": (n, ff, h), "up_proj": (n, ff, h), "down_proj": (n, h, ff),
            "gate_up_proj": (n, 2 * ff, h)}[m.group(1)]


def keeps_blocks(hf_name: str, type_name: str) -> bool:
    """True for a routed-expert tensor in a type quantization='gguf' serves from its blocks: the conversion leaves it
    in the GGUF (no float copy in the cache) and a float load dequantizes it from there
    (:func:`dequantized_experts`)."""
    from pagedllm.kernels.cpu_quant import GGML_TYPES

    return is_expert_tensor(hf_name) and type_name in GGML_TYPES


def check_merged_experts(hf_name: str, shape: tuple[int, ...], cfg: Mapping[str, Any], gguf_name: str,
                         path: Path) -> None:
    """A ValueError naming ``gguf_name`` if the merged expert tensor ``hf_name`` of HF-order ``shape`` is an expert
    bias or disagrees with the metadata."""
    m = _STACKED_RE.search(hf_name)
    if m is None:
        raise ValueError(f"{hf_name!r} is not a merged expert tensor")
    if m.group(2) == "bias":
        raise ValueError(f"{path}: GGUF tensor {gguf_name!r} is an expert bias; the supported MoE architectures "
                         "(Mixtral, Qwen2-MoE, Qwen3-MoE, Granite MoE, DeepSeek-V2 / V3) have no expert "
                         "biases")
    want = moe_expected_shape(hf_name, cfg)
    if tuple(shape) != want:
        raise ValueError(f"{path}: GGUF tensor {gguf_name!r} has shape {list(shape)} (numpy order), expected "
                         f"{list(want)} = [experts, rows, columns] from the metadata (expert_count = "
                         f"{_num_experts(cfg)}, expert width {_expert_width(cfg)}, hidden size {cfg['hidden_size']})")


def _float32(data: np.ndarray, tensor_type: Any, gguf_name: str, path: Path) -> np.ndarray:
    """``data`` (one matrix's rows as stored) dequantized to a float32 array of its own: by the quantized linears'
    kernels where they serve the type (bit-exact with gguf-py, a few times faster), else by gguf-py."""
    from gguf.quants import dequantize

    from pagedllm.kernels.cpu_quant import GGML_TYPES

    if tensor_type.name in GGML_TYPES and data.ndim == 2 and (native := _dequantize_natively(data, int(tensor_type))) \
            is not None:
        return native
    try:
        return np.array(dequantize(data, tensor_type), dtype=np.float32)
    except NotImplementedError as e:
        raise ValueError(f"GGUF tensor {gguf_name!r} in {path} uses an unsupported type: {e}") from e


def _dequantize_natively(blocks: np.ndarray, qtype: int) -> np.ndarray | None:
    """uint8 [rows, row_bytes] blocks of ``qtype`` as float32 [rows, columns] by kernels/cpu_quant (None where those
    cannot be built: not x86-64, no compiler)."""
    import torch

    from pagedllm.kernels.cpu_quant import BLOCK_LAYOUT, GGUFWeight, load_quant_kernels

    try:
        kernels = load_quant_kernels()
    except (RuntimeError, OSError):
        return None
    elems, nbytes = BLOCK_LAYOUT[qtype]
    rows, cols = blocks.shape[0], blocks.shape[1] // nbytes * elems
    weight = GGUFWeight.from_gguf_blocks(torch.from_numpy(np.array(blocks)), qtype, rows, cols)
    return kernels.dequantize_rows(weight, torch.arange(rows)).numpy()


def dequantized_experts(tensor: Any, hf_name: str, cfg: Mapping[str, Any], path: Path,
                        wanted: Callable[[str], bool] = lambda name: True) -> Iterator[tuple[str, np.ndarray]]:
    """One GGUF expert ``tensor`` (a gguf ReaderTensor mapped to ``hf_name``: merged [experts, rows, columns], fused
    gate | up, or one expert's matrix of an old Mixtral file) as float32 per-expert matrices
    ``...mlp.experts.{e}.<proj>.weight``, dequantized one expert at a time; names not ``wanted`` are not dequantized."""
    shape = tuple(int(s) for s in reversed(tensor.shape.tolist()))  # GGUF lists ne0 (innermost) first
    if not is_stacked_experts(hf_name):  # one expert's matrix
        if tuple(shape) != moe_expected_shape(hf_name, cfg):
            raise ValueError(f"{path}: GGUF tensor {tensor.name!r} has shape {list(shape)}, expected "
                             f"{list(moe_expected_shape(hf_name, cfg) or ())} from the model metadata")
        if wanted(hf_name):
            yield hf_name, _float32(np.asarray(tensor.data).reshape(shape[0], -1), tensor.tensor_type, tensor.name,
                                    path)
        return
    check_merged_experts(hf_name, shape, cfg, tensor.name, path)
    m = _STACKED_RE.search(hf_name)
    prefix, proj, width = hf_name[: m.start()] + ".mlp.experts", m.group(1), _expert_width(cfg)
    stored = np.asarray(tensor.data).reshape(shape[0], shape[1], -1)
    for e in range(shape[0]):
        parts = ("gate_proj", "up_proj") if proj == "gate_up_proj" else (proj,)
        names = [f"{prefix}.{e}.{part}.weight" for part in parts]
        if not any(wanted(n) for n in names):
            continue
        arr = _float32(stored[e], tensor.tensor_type, tensor.name, path)
        for i, name in enumerate(names):
            if wanted(name):
                yield name, np.ascontiguousarray(arr[i * width:(i + 1) * width] if len(names) > 1 else arr)


def log_dequantized_experts(path: Path, types: list[str], why: str = "") -> None:
    """The one line saying a file's quantized expert tensors (of GGUF ``types``, one entry per tensor) run as float:
    by default, the conversion's float copy (what quantization='none' and GPUs serve); with ``why``, under
    quantization='gguf' on the CPU, the ones not served from their blocks and the reason."""
    if not types:
        return
    kinds = ", ".join(sorted(set(types)))
    if why:
        logger.info("GGUF %s: %d quantized expert tensors (%s) are served from their dequantized float copy: %s",
                    path.name, len(types), kinds, why)
    else:
        logger.info("GGUF %s: %d quantized expert tensors (%s) are dequantized to float at load (quantization='gguf' "
                    "on the CPU serves Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K / MXFP4 experts "
                    "from their blocks)", path.name, len(types), kinds)


def moe_config(field: Callable[[str, Any], Any], arch: str, base: Mapping[str, Any], tensor_names: set[str],
               path: Path) -> dict[str, Any]:
    """The HF config fields of a MoE GGUF as llama.cpp reads it (``field(key, default)``: the file's metadata); {} for
    a dense ``llama`` file. expert_count and expert_used_count are required (llama.cpp refuses a MoE file without
    them); Qwen's expert width defaults to feed_forward_length / expert_used_count and its shared expert's to
    feed_forward_length, as llama.cpp's; every layer routes (llama.cpp has no dense layers in these architectures)."""
    n_expert = int(field(f"{arch}.expert_count", 0) or 0)
    has_expert_tensors = any(_EXPERT_BLOCK_RE.match(n) for n in tensor_names)
    if arch == "llama" and not n_expert and not has_expert_tensors:
        return {}  # a dense Llama
    if n_expert <= 0:
        found = " (it has expert tensors)" if has_expert_tensors else ""
        raise ValueError(f"{path} is not a valid mixture-of-experts GGUF file: {arch}.expert_count is missing or 0"
                         f"{found}; {arch} MoE files need expert_count > 0 and expert_used_count > 0")
    n_used = int(field(f"{arch}.expert_used_count", 0) or 0)
    if not 0 < n_used <= n_expert:
        raise ValueError(f"{path}: {arch}.expert_used_count = {n_used or 'missing'}; it must lie in [1, "
                         f"{arch}.expert_count = {n_expert}]")
    if "blk.0.ffn_gate_inp.weight" not in tensor_names:
        raise ValueError(f"{path}: {arch}.expert_count = {n_expert} but there is no router tensor "
                         "'blk.0.ffn_gate_inp.weight'")
    hf_arch, model_type = MOE_MODELS[arch]
    n_ff = base["intermediate_size"]
    out: dict[str, Any] = {"architectures": [hf_arch], "model_type": model_type, "num_experts_per_tok": n_used}
    if arch in ("llama", "granitemoe"):  # their experts are feed_forward_length wide
        if arch == "granitemoe" and (field(f"{arch}.expert_shared_feed_forward_length", 0)
                                     or "blk.0.ffn_gate_shexp.weight" in tensor_names):
            raise ValueError(f"{path} is a Granite MoE with a shared expert (GraniteMoeSharedForCausalLM), which "
                             "pagedllm does not serve; supported: granitemoe files without ffn_*_shexp tensors")
        out["num_local_experts"] = n_expert
        if arch == "llama":
            out["sliding_window"] = None  # Mixtral's HF default is none; llama.cpp attends to the whole context
        return out
    moe_ff = int(field(f"{arch}.expert_feed_forward_length", 0) or 0) or n_ff // n_used
    shared = 0
    if "blk.0.ffn_gate_shexp.weight" in tensor_names:
        shared = int(field(f"{arch}.expert_shared_feed_forward_length", 0) or 0) or n_ff
    out.update(num_experts=n_expert, moe_intermediate_size=moe_ff, shared_expert_intermediate_size=shared,
               norm_topk_prob=_NORM_TOPK_PROB[arch], decoder_sparse_step=1, mlp_only_layers=[])
    return out
