"""FP8 checkpoints: Hugging Face directories whose linear weights are stored as float8_e4m3fn with scales.

Two `quantization_config` kinds, as vLLM reads them:
- ``quant_method: "fp8"``: AutoFP8's per-tensor scales (``weight_scale``), or transformers' fine-grained FP8 with
  ``weight_block_size`` (``weight_scale_inv``, one scale per block);
- ``quant_method: "compressed-tensors"`` with 8-bit float weights (llm-compressor's FP8, FP8_DYNAMIC and FP8_BLOCK
  schemes): ``weight_scale`` per tensor, per output channel or per block.

How they load:
- Per-tensor and per-channel scales: the e4m3 values load unchanged through the layers' own weight loaders (every
  e4m3 value is exact in bf16, fp16 and fp32, so sharding and q/k/v or gate/up stacking work as for any weight),
  and each layer's scales load into a per-row ``weight_scale``. `finish_fp8_checkpoint` then keeps the layer as
  FP8 (CUDA: the values converted back to e4m3 bit for bit, run with ``_scaled_mm`` as ``--quantization fp8``)
  or multiplies the scales out (the CPU, which has no FP8 GEMM, or ``quantization="none"``).
- Block scales cannot be held per row: those weights, and an FP8 LM head, are dequantized as they stream in.
- Static activation scales (``input_scale``) and KV-cache scales (``k_scale``, ``v_scale``, ``output_scale``)
  are read and not used: activations are quantized per token at run time, and an FP8 KV pool has its own scales
  (``--calculate-kv-scales``).
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from pagedllm.model.meta_build import build_on_meta, materialize

logger = logging.getLogger("pagedllm")

_E4M3 = torch.float8_e4m3fn
_SCALE_NAMES = ("weight_scale", "weight_scale_inv")
_UNUSED_SCALES = ("input_scale", "k_scale", "v_scale", "kv_scale", "output_scale")
_SUPPORTED = ("quant_method 'fp8' (AutoFP8, transformers' fine-grained FP8) or 'compressed-tensors' with 8-bit "
              "float weights (llm-compressor's FP8 schemes); 4- and 8-bit integer weights load from GPTQ, AWQ and "
              "compressed-tensors pack-quantized checkpoints (model/int_weight_checkpoint.py) and GGUF files")


@dataclass(frozen=True)
class Fp8CheckpointFormat:
    """What a checkpoint's `quantization_config` says about its FP8 weights."""

    method: str  # "fp8" or "compressed-tensors"
    weight_strategy: str  # "tensor", "channel" or "block"
    block_size: tuple[int, int] | None  # (rows, columns) of a scale block, for "block"
    activation_scheme: str  # "dynamic" or "static" (static input scales are not used)

    def describe(self) -> str:
        block = f" {self.block_size[0]}×{self.block_size[1]}" if self.block_size else ""
        return f"{self.method}, {self.weight_strategy}{block} weight scales, {self.activation_scheme} activations"


def detect_fp8_checkpoint(hf_config: Any) -> Fp8CheckpointFormat | None:
    """The FP8 format of a model directory's config, None if it has no `quantization_config`; a ValueError that
    names what is supported for any other quantization."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    method = qc.get("quant_method")
    if method == "mxfp4":  # GPT-OSS's experts, dequantized by its loader (model/mxfp4.py)
        return None
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config fmt={qc.get('fmt')!r} is not supported: FP8 weights must be e4m3.")
        block = qc.get("weight_block_size")
        return Fp8CheckpointFormat("fp8", "block" if block else "tensor", _block(block),
                                   str(qc.get("activation_scheme", "dynamic")))
    if method == "compressed-tensors":
        return _compressed_tensors_format(qc)
    raise ValueError(f"the checkpoint's quantization_config has quant_method={method!r}, which pagedllm cannot "
                     f"load. Supported: {_SUPPORTED}.")


def _block(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and v > 0 for v in value)):
        raise ValueError(f"an FP8 weight block size must be two positive ints [rows, columns], got {value!r}.")
    return int(value[0]), int(value[1])


def _compressed_tensors_format(qc: dict) -> Fp8CheckpointFormat:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported (pagedllm loads 'float-quantized' "
                         f"FP8 weights). Supported: {_SUPPORTED}.")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError("a compressed-tensors quantization_config without config_groups: nothing says how the "
                         "weights are quantized.")
    strategies, blocks, static = set(), set(), False
    for name, group in groups.items():
        w = group.get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ValueError(f"compressed-tensors group {name!r} stores {w.get('num_bits')}-bit {w.get('type')} "
                             f"weights, which pagedllm cannot load. Supported: {_SUPPORTED}.")
        strategies.add(w.get("strategy"))
        if w.get("block_structure") is not None:
            blocks.add(_block(w["block_structure"]))
        act = group.get("input_activations") or {}
        static = static or (bool(act) and not act.get("dynamic", False))
    if len(strategies) != 1 or not strategies <= {"tensor", "channel", "block"} or len(blocks) > 1:
        raise ValueError(f"compressed-tensors weight strategies {sorted(map(str, strategies))} with blocks "
                         f"{sorted(blocks)}: pagedllm loads one of 'tensor', 'channel' or 'block' for all groups.")
    strategy = strategies.pop()
    return Fp8CheckpointFormat("compressed-tensors", strategy, blocks.pop() if blocks else None,
                               "static" if static else "dynamic")


def fp8_checkpoint_weights(weights: Iterable[tuple[str, torch.Tensor]], fmt: Fp8CheckpointFormat,
                           counts: Counter | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as the model's loaders take them: an e4m3 ``X.weight`` as is, followed by its
    per-row ``X.weight_scale`` [rows] in float32 (per-tensor and per-channel scales); dequantized to float32
    where the scales are per block, and for the LM head (kept in the model's dtype, as in vLLM). Activation and
    KV-cache scales are dropped. `counts` (if given) tallies what happened to each tensor."""
    counts = counts if counts is not None else Counter()
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf in _UNUSED_SCALES:
            counts[f"unused {leaf}"] += 1
            continue
        if leaf == "weight" and tensor.dtype == torch.float8_e5m2:
            raise ValueError(f"{name} is float8_e5m2: FP8 checkpoints must store e4m3 weights.")
        if leaf in _SCALE_NAMES or (leaf == "weight" and tensor.dtype == _E4M3):
            parts = pending.setdefault(prefix, {})
            parts["scale" if leaf in _SCALE_NAMES else "weight"] = tensor
            if len(parts) == 2:
                del pending[prefix]
                yield from _with_scale(prefix, parts["weight"], parts["scale"], fmt, counts)
            continue
        yield name, tensor
    for prefix, parts in pending.items():
        if "weight" in parts:
            raise ValueError(f"{prefix}.weight is float8_e4m3fn but the checkpoint has no {prefix}.weight_scale.")
        raise ValueError(f"the checkpoint has a scale for {prefix} but no float8_e4m3fn {prefix}.weight "
                         f"(a scale applies to e4m3 weights only).")


def _with_scale(prefix: str, weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8CheckpointFormat,
                counts: Counter) -> Iterator[tuple[str, torch.Tensor]]:
    rows, cols = weight.shape
    scale = scale.float()
    if scale.numel() == 1:
        per_row = scale.reshape(1).expand(rows).clone()
    elif scale.numel() == rows and scale.shape in ((rows,), (rows, 1)):
        per_row = scale.reshape(rows)
    elif scale.dim() == 2:
        counts["dequantized (block scales)"] += 1
        yield f"{prefix}.weight", weight.float() * _expand_blocks(prefix, scale, rows, cols, fmt.block_size)
        return
    else:
        raise ValueError(f"{prefix}: a scale of shape {tuple(scale.shape)} fits neither per-tensor, per-channel "
                         f"({rows} rows) nor per-block scales of a {rows}×{cols} weight.")
    if prefix.rpartition(".")[2] == "lm_head":
        counts["dequantized (LM head)"] += 1
        yield f"{prefix}.weight", weight.float() * per_row[:, None]
        return
    counts["e4m3 with per-row scales"] += 1
    yield f"{prefix}.weight", weight
    yield f"{prefix}.weight_scale", per_row


def _expand_blocks(prefix: str, scale: torch.Tensor, rows: int, cols: int,
                   block: tuple[int, int] | None) -> torch.Tensor:
    """[⌈rows/b0⌉, ⌈cols/b1⌉] block scales → [rows, cols]."""
    if block is None:
        block = (math.ceil(rows / scale.shape[0]), math.ceil(cols / scale.shape[1]))
    want = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale.shape) != want:
        raise ValueError(f"{prefix}: block scales of shape {tuple(scale.shape)} do not tile a {rows}×{cols} weight "
                         f"in {block[0]}×{block[1]} blocks (expected {want}).")
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def keeps_fp8(device_type: str, dtype: torch.dtype, quantization: str | None) -> bool:
    """Whether an FP8 checkpoint's per-tensor / per-channel layers stay FP8: on CUDA in bfloat16 (``_scaled_mm``
    with row-wise scales gives bf16 outputs), unless quantization="none"; elsewhere they are dequantized (the CPU
    has no FP8 GEMM)."""
    return device_type == "cuda" and dtype == torch.bfloat16 and quantization != "none"


def checkpoint_linears(model: nn.Module) -> list[nn.Module]:
    """The linear layers that can hold an FP8 checkpoint's per-row scales (every PackableGemm but the LM head)."""
    from pagedllm.model.layers.embedding import ParallelLMHead
    from pagedllm.model.layers.linear import PackableGemm

    return [m for m in model.modules() if isinstance(m, PackableGemm) and not isinstance(m, ParallelLMHead)]


def build_for_fp8_checkpoint(build: Callable[[], nn.Module], device: torch.device, fmt: Fp8CheckpointFormat,
                             keep_fp8: bool) -> nn.Module:
    """`build()` on the meta device, then memory on `device` for every parameter: in e4m3 for the weights of the
    linears that will stay FP8 (`keep_fp8`, per-tensor or per-channel scales, shapes `_scaled_mm` takes), so an
    FP8 model loads without ever taking its bf16 size; in their own dtype for the rest (model/meta_build.py)."""
    from pagedllm.kernels import fp8_linear

    model = build_on_meta(build)
    fp8 = set()
    if keep_fp8 and fmt.weight_strategy != "block":
        fp8 = {id(m.weight) for m in checkpoint_linears(model) if fp8_linear.can_quantize(m.weight)}
    return materialize(model, device, lambda p: _E4M3 if id(p) in fp8 else p.dtype)


def prepare_for_fp8_checkpoint(model: nn.Module) -> None:
    """Before loading: give every checkpoint linear an optional per-row `weight_scale` to load into."""
    if not getattr(model, "loads_fp8_checkpoints", False):
        raise ValueError(f"{type(model).__name__} cannot load FP8 checkpoints (Llama, Mistral, Qwen2 and OPT can); "
                         f"use a bf16 checkpoint of this model.")
    for layer in checkpoint_linears(model):
        layer.expect_checkpoint_scales()


def finish_fp8_checkpoint(model: nn.Module, keep_fp8: bool) -> Counter:
    """After loading: each layer that received scales becomes FP8 (`keep_fp8`: CUDA) or dequantized; returns
    how many layers ended each way."""
    return Counter(layer.finish_checkpoint_scales(keep_fp8) for layer in checkpoint_linears(model))


def log_fp8_checkpoint(fmt: Fp8CheckpointFormat, tensors: Counter, layers: Counter, dtype: torch.dtype) -> None:
    """One line on what became of the checkpoint's FP8 layers, one on the scales it does not use."""
    logger.info("FP8 checkpoint (%s): linear layers: %d kept in e4m3 (run with _scaled_mm), %d dequantized to %s, "
                "%d in %s as loaded (stored unquantized, or block-scaled and dequantized while loading: %d tensors)",
                fmt.describe(), layers.get("fp8", 0), layers.get("dequantized", 0), dtype, layers.get("plain", 0),
                dtype, tensors.get("dequantized (block scales)", 0))
    unused = sorted(k.split(" ", 1)[1] for k in tensors if k.startswith("unused "))
    if unused:
        logger.info("FP8 checkpoint: its %s tensors are not used (activations are quantized per token at run "
                    "time; an FP8 KV pool has its own scales, see --calculate-kv-scales)", ", ".join(unused))
