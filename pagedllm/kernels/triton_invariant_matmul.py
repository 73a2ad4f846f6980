"""A GEMM whose rows do not depend on the row count: the CUDA path's linears under VLLM_BATCH_INVARIANT=1.

cuBLAS picks a kernel per problem shape, and with it the order in which each output sums over K (tile depth,
split-K), so a token's logits change with the number of rows its step has. Here every launch uses one tile
shape (`BLOCK_M` × `BLOCK_N`, `BLOCK_K` deep, the same warps and stages), no split-K, and each output element
sums its K tiles in order from zero: a row's result is the same bits whatever rows share the launch. vLLM's batch
invariance does the same with a persistent Triton matmul; this one is written here from that description.

It trades speed for that (no per-shape tuning); the mode is for reproducible outputs, not throughput.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N = 64, 64
# float32 operands sum in IEEE float32 (input_precision="ieee"), as cuBLAS does without TF32, in shallower tiles
# (their shared-memory tiles are twice as large).
BLOCK_K = {torch.float32: 32, torch.bfloat16: 64, torch.float16: 64}
NUM_WARPS, NUM_STAGES = 4, 3


# The row count is not specialised on (Triton would compile a variant for M == 1 and for M % 16 == 0): one compile
# per layer shape, which the engine's warm-up forward makes, so no request compiles.
@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + (k0 + rk)[:, None],
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x · weightᵀ (+ bias) over x's last dim, each row's bits independent of the other rows."""
    if x.dtype not in BLOCK_K or weight.dtype != x.dtype:
        raise ValueError(f"invariant_linear takes float32, bfloat16 or float16 x and weight of one dtype, got "
                         f"{x.dtype} and {weight.dtype}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must be [out, {x.shape[-1]}], got {tuple(weight.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    m, n = x2.shape[0], w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _invariant_matmul_kernel[grid](
            x2, w, bias if bias is not None else out, out, m, n, k,
            x2.stride(0), w.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, PREC="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K[x.dtype], num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        )
    return out.reshape(*lead, n)
