"""Integer weight-only checkpoints for tests, written from a float32 Hugging Face checkpoint in the on-disk layouts of
GPTQ, AWQ and compressed-tensors (model/int_weight_checkpoint.py reads them), each with a float32 twin holding the
dequantized weights (the model transformers runs as the reference).

The weights are quantized by round-to-nearest with GPTQ's min/max rule (gptq's Quantizer.find_params: the range
always includes 0; symmetric: zero point 2^(bits-1)). The packers are written from the real packers' code:
- GPTQ (AutoGPTQ auto_gptq/nn_modules/qlinear/qlinear_cuda.py, QuantLinear.pack; GPTQModel keeps the layout):
  qweight int32 [in·bits/32, out], element j of a word at bits·j along the input dim; qzeros int32
  [groups, out·bits/32] along the output dim, v1 ("gptq") storing `zeros -= 1`; scales fp16 [groups, out];
  g_idx int32 [in]; bias fp16.
- AWQ (AutoAWQ awq/modules/linear/gemm.py, WQLinear_GEMM.from_linear): qweight int32 [in, out/8] with nibble i of
  a word holding column order_map[i] = [0, 2, 4, 6, 1, 3, 5, 7][i] of its eight; qzeros [groups, out/8] the same;
  scales fp16 [groups, out]; bias fp16.
- compressed-tensors (compressed_tensors/compressors/pack_quantized/helpers.py, pack_to_int32, 0.20.x): signed
  values + 2^(bits-1), element i at bit i·bits along dim 1 (weight_packed [out, in·bits/32]); zero points
  (asymmetric) packed the same way along dim 0; weight_scale [out, groups] in the model's dtype; weight_shape.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class Kind:
    """One checkpoint variant."""

    method: str  # gptq, awq, compressed-tensors
    bits: int = 4
    group_size: int = 64  # -1: per output channel
    sym: bool = True
    checkpoint_format: str = "gptq"  # GPTQ: gptq (zeros minus one) or gptq_v2
    desc_act: bool = False  # GPTQ: shuffled g_idx

    @property
    def name(self) -> str:
        extra = f"-{self.checkpoint_format}" if self.method == "gptq" else ""
        return (f"{self.method}{extra}-{self.bits}bit-g{self.group_size}-{'sym' if self.sym else 'asym'}"
                f"{'-actorder' if self.desc_act else ''}")


@dataclass
class Quantized:
    q: torch.Tensor  # int64 [out, in] unsigned codes
    scale: torch.Tensor  # [out, groups] as stored
    zero: torch.Tensor  # int64 [out, groups] unsigned zero points
    g_idx: torch.Tensor  # int64 [in]
    deq: torch.Tensor  # float32 [out, in]: scale · (q − zero)


def rtn_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool, scale_dtype: torch.dtype,
                 perm: torch.Tensor | None = None) -> Quantized:
    """Round-to-nearest per group (GPTQ's min/max rule). `perm`: act-order, groups of consecutive columns of
    w[:, perm] (then g_idx[i] is the group of column i, as GPTQ writes it)."""
    out, cols = w.shape
    g = cols if group_size == -1 else group_size
    maxq = 2**bits - 1
    perm = torch.arange(cols) if perm is None else perm
    inv = torch.argsort(perm)
    wp = w[:, perm].reshape(out, cols // g, g)
    lo, hi = wp.amin(-1).clamp(max=0), wp.amax(-1).clamp(min=0)
    if sym:
        hi = torch.maximum(lo.abs(), hi)
        lo = -hi
    scale = ((hi - lo) / maxq).clamp(min=1e-8).to(scale_dtype)
    s = scale.float()
    zero = torch.full_like(lo, 2 ** (bits - 1), dtype=torch.int64) if sym else torch.round(-lo / s).to(torch.int64)
    q = torch.clamp(torch.round(wp / s[..., None]) + zero[..., None], 0, maxq).to(torch.int64)
    q = q.reshape(out, cols)[:, inv]
    g_idx = inv // g
    deq = (q.float() - zero[:, g_idx].float()) * s[:, g_idx]
    return Quantized(q, scale, zero, g_idx, deq)


def _int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 → int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along_cols(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int64 [R, C] → int32 [R, C·bits/32]: word c holds columns c·n … c·n + n − 1 (n = 32/bits), slot i (bits
    bits·i) holding column c·n + order[i]."""
    n = 32 // bits
    order = tuple(range(n)) if order is None else order
    v = values.reshape(values.shape[0], -1, n)[:, :, list(order)]
    return _int32((v << (torch.arange(n) * bits)).sum(-1))


def pack_gptq(qt: Quantized, kind: Kind, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
    zeros = qt.zero.t()  # [groups, out]
    if kind.checkpoint_format == "gptq":
        # v1 stores zeros - 1; AutoGPTQ's pack overflows a zero of 0 into its neighbours (a known issue, rare with
        # real data: the range always includes 0), so the test data must not have one.
        if int(zeros.min()) < 1:
            raise ValueError("a zero point of 0 cannot be stored in GPTQ v1")
        zeros = zeros - 1
    out = {"qweight": _pack_rows(qt.q.t(), kind.bits),
           "qzeros": pack_along_cols(zeros, kind.bits),
           "scales": qt.scale.t().contiguous(),
           "g_idx": qt.g_idx.to(torch.int32)}
    if bias is not None:
        out["bias"] = bias.to(torch.float16)
    return out


def _pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 [R, C] → int32 [R·bits/32, C]: word r of column c holds rows r·n … r·n + n − 1 at bits·j."""
    return pack_along_cols(values.t().contiguous(), bits).t().contiguous()


def pack_awq(qt: Quantized, kind: Kind, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
    out = {"qweight": pack_along_cols(qt.q.t().contiguous(), 4, AWQ_ORDER),
           "qzeros": pack_along_cols(qt.zero.t().contiguous(), 4, AWQ_ORDER),
           "scales": qt.scale.t().contiguous()}
    if bias is not None:
        out["bias"] = bias.to(torch.float16)
    return out


def pack_compressed_tensors(qt: Quantized, kind: Kind, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
    out = {"weight_packed": pack_along_cols(qt.q, kind.bits),  # signed value + 2^(bits-1) = our unsigned code
           "weight_scale": qt.scale,
           "weight_shape": torch.tensor(list(qt.q.shape))}
    if not kind.sym:
        out["weight_zero_point"] = _pack_rows(qt.zero, kind.bits)
    if bias is not None:
        out["bias"] = bias
    return out


def quantization_config(kind: Kind) -> dict:
    if kind.method == "gptq":
        return {"quant_method": "gptq", "bits": kind.bits, "group_size": kind.group_size, "desc_act": kind.desc_act,
                "sym": kind.sym, "checkpoint_format": kind.checkpoint_format, "damp_percent": 0.01,
                "true_sequential": True, "static_groups": False, "lm_head": False,
                "meta": {"quantizer": ["tests"]}}
    if kind.method == "awq":
        return {"quant_method": "awq", "bits": kind.bits, "group_size": kind.group_size, "version": "gemm",
                "zero_point": True, "modules_to_not_convert": None}
    weights = {"num_bits": kind.bits, "type": "int", "symmetric": kind.sym, "dynamic": False,
               "strategy": "channel" if kind.group_size == -1 else "group", "observer": "minmax", "actorder": None}
    if kind.group_size != -1:
        weights["group_size"] = kind.group_size
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}}}


_PACKERS = {"gptq": pack_gptq, "awq": pack_awq, "compressed-tensors": pack_compressed_tensors}


def write_int_checkpoint(src: Path, dst: Path, kind: Kind, seed: int = 0) -> Path:
    """Write `kind` of the float32 checkpoint in `src` to `dst`; returns the directory of its dequantized twin
    (float32; biases rounded to fp16 where the format stores them so)."""
    state = load_file(str(src / "model.safetensors"))
    twin = dst.parent / f"{dst.name}-dequantized"
    for d in (dst, twin):
        shutil.copytree(src, d)
    gen = torch.Generator().manual_seed(seed)
    scale_dtype = torch.float32 if kind.method == "compressed-tensors" else torch.float16
    quantized, dequantized = {}, {}
    for name, t in state.items():
        prefix, _, leaf = name.rpartition(".")
        module = prefix.rpartition(".")[2]
        if module not in LINEARS:
            quantized[name] = dequantized[name] = t
            continue
        if leaf == "bias":
            continue  # written with its layer
        perm = torch.randperm(t.shape[1], generator=gen) if kind.desc_act else None
        qt = rtn_quantize(t.float(), kind.bits, kind.group_size, kind.sym, scale_dtype, perm)
        bias = state.get(f"{prefix}.bias")
        for leaf_name, tensor in _PACKERS[kind.method](qt, kind, bias).items():
            quantized[f"{prefix}.{leaf_name}"] = tensor
        dequantized[name] = qt.deq
        if bias is not None:
            dequantized[f"{prefix}.bias"] = quantized[f"{prefix}.bias"].float()
    save_file(quantized, str(dst / "model.safetensors"))
    save_file(dequantized, str(twin / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(kind)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return twin
