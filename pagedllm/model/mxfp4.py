"""MXFP4 weights (OCP microscaling FP4, as GPT-OSS checkpoints store their experts): served as such on CUDA
(``Mxfp4Weight``, read by the fused-MoE kernel, kernels/triton_fused_moe.py) or dequantized at load.

A checkpoint's ``<name>_blocks`` [..., rows, K / 32, 16] uint8 hold two FP4 (E2M1) values per byte, the low nibble
first; ``<name>_scales`` [..., rows, K / 32] uint8 hold one E8M0 exponent per 32 values (2^(s - 127)). The result is
[..., rows, K], a row per output feature (GPT-OSS's gate_up rows interleave gate and up).
"""
from __future__ import annotations

from dataclasses import dataclass

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


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, K] float → (blocks [..., rows, K / 32, 16], scales [..., rows, K / 32]) uint8, the files' layout:
    each 32 values' E8M0 exponent from their largest magnitude (which lands in [4, 8)), each value rounded to the
    nearest E2M1 code (for test and benchmark checkpoints; released gpt-oss files come quantized)."""
    *lead, k = w.shape
    if k % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 rows need a length in multiples of {MXFP4_BLOCK}, got {k}")
    g = w.reshape(*lead, k // MXFP4_BLOCK, MXFP4_BLOCK).float()
    exp = torch.floor(torch.log2(g.abs().amax(-1).clamp_min(2.0**-100))) - 2
    magnitudes = torch.tensor(FP4_E2M1_VALUES[:8], device=w.device)
    scaled = (g / torch.exp2(exp).unsqueeze(-1)).clamp(-6, 6)
    codes = ((scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1) + 8 * (scaled < 0)).to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), (exp + 127).to(torch.uint8)


def to_ggml_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Rows of MXFP4 as checkpoints store them (`blocks` [N, K / 2], value 2j in byte j's low nibble; `scales`
    [N, K / 32]) → GGML's MXFP4 blocks [N, K / 32 · 17] (type 39, what llama.cpp's files hold and the CPU kernels
    read: per 32 values the E8M0 byte, then 16 bytes with value j in the low nibble of byte j and value j + 16 in
    its high nibble). The codes and exponents are the same numbers: only the nibbles move."""
    n, groups = scales.shape
    if blocks.shape != (n, groups * MXFP4_BLOCK // 2) or blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 rows: blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype} do not match ([N, K / 2] and [N, K / 32], uint8)")
    pairs = blocks.reshape(n, groups, MXFP4_BLOCK // 2)
    values = torch.stack([pairs & 0x0F, pairs >> 4], dim=-1).reshape(n, groups, MXFP4_BLOCK)  # in order
    qs = values[..., :16] | (values[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), qs], dim=-1).reshape(n, groups * 17).contiguous()


def from_ggml_blocks(ggml: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGML's MXFP4 blocks [..., N, G · 17] (llama.cpp's files) → the checkpoints' (blocks [..., N, G, 16], scales
    [..., N, G]): the inverse of :func:`to_ggml_blocks`."""
    if ggml.dtype != torch.uint8 or ggml.dim() < 2 or ggml.shape[-1] % 17:
        raise ValueError(f"GGML MXFP4 rows must be uint8 [..., N, G * 17], got {ggml.dtype} {tuple(ggml.shape)}")
    blocks = ggml.reshape(*ggml.shape[:-1], ggml.shape[-1] // 17, 17)
    qs = blocks[..., 1:]
    values = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # the 32 codes in order
    return (values[..., 0::2] | (values[..., 1::2] << 4)).contiguous(), blocks[..., 0].contiguous()


def is_mxfp4_checkpoint(hf_config) -> bool:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    return bool(qc) and qc.get("quant_method") == "mxfp4"


@dataclass(frozen=True)
class Mxfp4Weight:
    """One stacked expert projection held as MXFP4: `blocks` [E, N, K / 2] uint8 (value 2j of a row in byte j's low
    nibble, 2j + 1 in its high one) and `scales` [E, N, K / 32] uint8 (E8M0), rows as the float weight's [E, N, K]."""

    blocks: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, half = self.blocks.shape
        return e, n, 2 * half

    def dequantize_expert(self, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `expert`'s rows [N, K] in `dtype`."""
        n, groups = self.scales.shape[1:]
        return dequantize_mxfp4(self.blocks[expert].view(n, groups, MXFP4_BLOCK // 2), self.scales[expert], dtype)


MXFP4 = "mxfp4"


def resolve_mxfp4(requested: str | None, hf_config, device_type: str, dtype: torch.dtype) -> bool:
    """Whether the experts are held as MXFP4: by default for a checkpoint that stores them so (vLLM serves gpt-oss
    that way) on CUDA, and on the CPU in float32 (the quantized linears' int8 kernels run them: faster than float32
    experts, at a sixth of their bytes; BENCHMARKS.md §86.2); wherever `requested` is "mxfp4" (elsewhere, the CPU in
    bfloat16, the torch experts dequantize an expert per product: the memory of the file, not the speed); "none"
    dequantizes at load."""
    stored = is_mxfp4_checkpoint(hf_config)
    if requested == MXFP4 and not stored:
        raise ValueError("quantization='mxfp4' serves the MXFP4 experts of checkpoints that store them so (gpt-oss: "
                         "quantization_config quant_method 'mxfp4'); this checkpoint has none: leave quantization "
                         "unset")
    by_default = device_type == "cuda" or device_type == "cpu" and dtype == torch.float32
    return stored and (requested == MXFP4 or requested is None and by_default)


def build_with_mxfp4_experts(build, device: torch.device):
    """`build()` on the meta device, then memory on `device` for every parameter but the experts' float weights, which
    FusedMoE.hold_mxfp4 replaces by MXFP4 bytes and scales: the model never takes its dequantized size."""
    from pagedllm.model.layers.fused_moe import FusedMoE
    from pagedllm.model.meta_build import build_on_meta, materialize

    model = materialize(build_on_meta(build), device,
                        released=lambda m, name: isinstance(m, FusedMoE) and name in ("w13_weight", "w2_weight"))
    for m in model.modules():
        if isinstance(m, FusedMoE):
            m.hold_mxfp4()
    return model
