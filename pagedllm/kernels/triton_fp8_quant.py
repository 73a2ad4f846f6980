"""Per-token dynamic FP8 quantization of activations in one Triton launch (``--quantization fp8``).

One program per row: pass 1 reads the row for its amax, pass 2 reads it again (from L2: a row is at
most a few tens of KB), scales, saturates and casts to e4m3. The plain-torch version in
``fp8_linear.quantize_activation`` takes five kernels (abs, amax, divide, clamp, cast) and is this
kernel's oracle: same scale (amax / 448, amax floored at 1e-12), same saturation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_E4M3 = torch.float8_e4m3fn
_MAX = float(torch.finfo(_E4M3).max)  # 448
_MAX_BLOCK = 4096  # elements per loop iteration (longer rows take several)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q,
                       FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, K, BLOCK):
        m = start + offs < K
        x = tl.load(x_row + start + offs, mask=m, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / FP8_MAX
    tl.store(scale_ptr + row, scale)
    q_row = q_ptr + row * stride_q
    for start in range(0, K, BLOCK):
        m = start + offs < K
        x = tl.load(x_row + start + offs, mask=m, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_row + start + offs, q.to(q_ptr.dtype.element_ty), mask=m)


def quantize_activation_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] (bf16/fp16/fp32, unit stride along K) → (e4m3 [M, K], fp32 scale [M, 1]) with
    x ≈ q · scale row by row; one launch, no host sync (CUDA-graph capturable)."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [tokens, features], got shape {tuple(x.shape)}.")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=_E4M3, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block = min(triton.next_power_of_2(k), _MAX_BLOCK)
    num_warps = 4 if block <= 1024 else 8
    _quant_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), FP8_MAX=_MAX, BLOCK=block,
                             num_warps=num_warps)
    return q, scale
