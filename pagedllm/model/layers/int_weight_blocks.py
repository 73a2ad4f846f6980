"""The CPU's quantized path for integer weight-only checkpoints (GPTQ, AWQ, compressed-tensors W4A16 / W8A16; see
model/int_weight_checkpoint.py): each layer's groups become GGUF blocks, run by the Q4_0 / Q4_1 / Q8_0 kernels that
``--quantization gguf`` uses (kernels/cpu_quant.py), so the weights stay 4- or 8-bit in memory.

A group of g columns (g a multiple of 32) with scale s and zero point z holds w = s·(q − z) = s·q − s·z, so each
32-column slice of it is one block:
- 4-bit, asymmetric: Q4_1 (w = d·q + m) with d = s and m = −s·z;
- 4-bit, symmetric (z = 8 everywhere): Q4_0 (w = d·(q − 8)) with d = s: exact, and 18 bytes a block, not 20;
- 8-bit, symmetric (z = 128 everywhere): Q8_0 (w = d·c, c = q − 128 as int8) with d = s.
GGUF stores d and m as fp16 (as the kernels read them): d is exact for fp16 scales (GPTQ's and AWQ's); a bf16 or
fp32 scale is rounded to fp16 (relative error ≤ 2^-11, more for subnormal scales < 6.1e-5). m = −s·z needs up to
15 significant bits where fp16 keeps 11, so it is rounded: |Δw| ≤ 2^-11·|s·z| ≤ 0.0073·s at 4 bits, under 1 % of
one quantization step. A layer that cannot be blocked (act-order g_idx that permutes the groups, groups or rows
that are not whole blocks, asymmetric 8-bit) is dequantized into float32 instead, and the log says why.

``PAGEDLLM_INT_WEIGHT_QUANTIZATION`` = ``blocks`` (default) | ``none`` says what the CPU does with such a checkpoint
when ``--quantization`` is unset or names the checkpoint's method; ``--quantization none`` always dequantizes.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
from torch import nn

from pagedllm.kernels.cpu_quant import GGML_TYPES
from pagedllm.model.gguf_loader import GGUFRawTensor
from pagedllm.model.int_weight_checkpoint import (
    IntWeight,
    IntWeightFormat,
    IntWeightLoad,
    int_weight_checkpoint_weights,
)
from pagedllm.model.layers.quantized_linear import GGUF, GGUFAttachReport, attach_quantized_blocks

logger = logging.getLogger("pagedllm")

DEFAULT_ENV = "PAGEDLLM_INT_WEIGHT_QUANTIZATION"
BLOCKS, NONE = "blocks", "none"
QK = 32  # weights per GGUF block


def resolve_int_weight_quantization(fmt: IntWeightFormat, requested: str | None, device: str,
                                    dtype: torch.dtype, tensor_parallel_size: int = 1) -> str | None:
    """``gguf`` (the layers keep GGUF blocks: the CPU in float32 on one rank, unless ``DEFAULT_ENV`` or
    ``--quantization none`` says otherwise) or None (dequantized at load into `dtype`)."""
    default = os.environ.get(DEFAULT_ENV, BLOCKS).strip() or BLOCKS
    if default not in (BLOCKS, NONE):
        raise ValueError(f"{DEFAULT_ENV} must be {BLOCKS!r} or {NONE!r}, got {default!r}")
    if requested == NONE or default == NONE:
        return None
    if device != "cpu" or dtype != torch.float32 or tensor_parallel_size != 1:
        logger.info("%s checkpoint: weights dequantized to %s at load (the quantized kernels are the CPU's, with "
                    "float32 activations, on one rank)", fmt.method, dtype)
        return None
    return GGUF


def block_type(fmt: IntWeightFormat) -> str:
    """The GGUF block type that holds `fmt`'s groups (whether each layer fits is :func:`gguf_blocks`'s to say)."""
    if fmt.bits == 8:
        return "Q8_0"
    return "Q4_0" if fmt.symmetric else "Q4_1"


def gguf_blocks(name: str, w: IntWeight, qtype: str) -> tuple[GGUFRawTensor | None, str]:
    """`w` as GGUF blocks of `qtype` (uint8 [out, in/32 · block bytes]), or None and why it cannot be."""
    out, cols = w.shape
    if cols % QK:
        return None, f"{cols} input columns are not whole blocks of {QK}"
    if w.group_size % QK and w.group_size < cols:
        return None, f"groups of {w.group_size} columns are not whole blocks of {QK}"
    if not w.contiguous_groups():
        return None, "act-order g_idx: its groups are not contiguous columns"
    nb = cols // QK
    g = (torch.arange(nb) * QK) // w.group_size  # each block's group
    scale, zero = w.scale[:, g].to(torch.float32), w.zero[:, g]
    d = scale.to(torch.float16)
    q = w.q.reshape(out, nb, QK)
    if qtype == "Q8_0":
        if not bool((zero == 128).all()):
            return None, "8-bit zero points other than 128 (Q8_0 blocks have no minimum)"
        quants = (q.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
        parts = [d, quants]
    else:
        quants = q[:, :, :16] | (q[:, :, 16:] << 4)  # GGUF Q4: byte j holds weights j (low nibble) and j + 16
        if qtype == "Q4_0":
            if not bool((zero == 8).all()):
                return None, "zero points other than 8 in a symmetric scheme"
            parts = [d, quants]
        else:
            parts = [d, (-scale * zero.to(torch.float32)).to(torch.float16), quants]
    if not all(bool(torch.isfinite(p).all()) for p in parts if p.dtype == torch.float16):
        return None, "scales beyond fp16's range"
    raw = torch.cat([p.unsqueeze(-1).view(torch.uint8) if p.dtype == torch.float16 else p for p in parts], dim=-1)
    blocks = raw.reshape(out, -1).numpy()
    return GGUFRawTensor(name, qtype, GGML_TYPES[qtype], (out, cols), blocks), ""


@dataclass
class IntWeightBlocks:
    """Collects each streamed layer's GGUF blocks (the `on_layer` of int_weight_checkpoint_weights)."""

    qtype: str
    raw: dict[str, GGUFRawTensor] = field(default_factory=dict)
    dense: dict[str, str] = field(default_factory=dict)  # "<prefix>.weight" -> why it stays dense

    def __call__(self, name: str, weight: IntWeight) -> None:
        blocks, why = gguf_blocks(name, weight, self.qtype)
        if blocks is None:
            self.dense[name] = why
        else:
            self.raw[name] = blocks


def attach_int_weight_blocks(model: nn.Module, blocks: IntWeightBlocks, load: IntWeightLoad,
                             gemm_method: str = "auto") -> GGUFAttachReport:
    """Give the model's linears their blocks (fused q/k/v and gate/up: the parts' rows concatenated) and drop their
    float32 weights; layers whose blocks are missing stay as loaded (dequantized)."""
    report = attach_quantized_blocks(model, blocks.raw, load.checkpoint_bytes, gemm_method)
    for name, why in blocks.dense.items():
        report.dense_tensors[name] = why
    return report


def log_int_weight_blocks(fmt: IntWeightFormat, blocks: IntWeightBlocks, load: IntWeightLoad,
                          report: GGUFAttachReport, model: nn.Module) -> None:
    """Layers served quantized, the resident bytes of their blocks against the checkpoint's packed tensors, and one
    line for the layers dequantized instead."""
    held = block_bytes(model)
    packed = sum(n for name, n in load.packed_bytes.items() if name in blocks.raw)
    logger.info("%s checkpoint (%s) served quantized on the CPU: %d linear layers as %s blocks, %.1f MB in memory "
                "vs %.1f MB of packed tensors in the checkpoint (%.2fx); all weights in memory %.1f MB vs %.1f MB of "
                "checkpoint tensors", fmt.method, fmt.describe(), report.quantized_layers, blocks.qtype, held / 1e6,
                packed / 1e6, held / max(packed, 1), report.weight_bytes / 1e6, load.checkpoint_bytes / 1e6)
    why = sorted({reason for name, reason in report.dense_tensors.items() if name in load.packed_bytes})
    dense = [name for name in report.dense_tensors if name in load.packed_bytes]
    if dense:
        logger.info("%s checkpoint: %d quantized tensors dequantized to float32 instead (%s), e.g. %s", fmt.method,
                    len(dense), "; ".join(why), dense[0])


def block_bytes(model: nn.Module) -> int:
    """Bytes of the GGUF blocks the model's layers hold (each block tensor once)."""
    weights = {id(w): w for m in model.modules() if (w := getattr(m, "gguf_weight", None)) is not None}
    return sum(w.nbytes for w in weights.values())


@dataclass
class IntCheckpointLoad:
    """Loading one integer checkpoint: :meth:`weights` streams it into the model's loaders (dequantized), keeping
    GGUF blocks of each layer on the side when `keep_blocks` (the CPU's quantized path); :meth:`attach` then hands
    the blocks to the layers."""

    fmt: IntWeightFormat
    keep_blocks: bool
    load: IntWeightLoad = field(default_factory=IntWeightLoad)
    blocks: IntWeightBlocks | None = None

    def __post_init__(self) -> None:
        if self.keep_blocks and self.blocks is None:
            self.blocks = IntWeightBlocks(block_type(self.fmt))

    def weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return int_weight_checkpoint_weights(weights, self.fmt, self.load, self.blocks)

    def attach(self, model: nn.Module, gemm_method: str = "auto") -> GGUFAttachReport:
        """The layers take their blocks (logged); the blocks read from the checkpoint are then released."""
        if self.blocks is None:
            raise ValueError("attach() needs an IntCheckpointLoad made with keep_blocks=True")
        report = attach_int_weight_blocks(model, self.blocks, self.load, gemm_method)
        log_int_weight_blocks(self.fmt, self.blocks, self.load, report, model)
        self.blocks.raw.clear()
        return report
