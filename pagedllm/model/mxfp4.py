"""MXFP4 weights (OCP microscaling FP4, as GPT-OSS checkpoints store their experts): dequantized at load.

A checkpoint's ``<name>_blocks`` [..., rows, K / 32, 16] uint8 hold two FP4 (E2M1) values per byte, the low nibble
first; ``<name>_scales`` [..., rows, K / 32] uint8 hold one E8M0 exponent per 32 values (2^(s - 127)). The result is
[..., rows, K], a row per output feature (GPT-OSS's gate_up rows interleave gate and up).
"""
from __future__ import annotations

import torch

# E2M1's sixteen codes: sign bit, two exponent bits, one mantissa bit.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values per scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[..., rows, G, 16] uint8 blocks and [..., rows, G] uint8 scales → [..., rows, G · 32] of `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match: blocks "
                         f"must be [..., G, {MXFP4_BLOCK // 2}] with scales [..., G]")
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).int()], lut[(blocks >> 4).int()]], dim=-1)  # [..., G, 16, 2]
    values = values.flatten(-2) * torch.exp2(scales.float() - 127.0).unsqueeze(-1)  # [..., G, 32]; exact in float32
    return values.flatten(-2).to(dtype)


def is_mxfp4_checkpoint(hf_config) -> bool:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    return bool(qc) and qc.get("quant_method") == "mxfp4"
