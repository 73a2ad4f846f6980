"""A GEMM whose rows do not depend on the row count: the CUDA path's linears under VLLM_BATCH_INVARIANT=1.

cuBLAS picks a kernel per problem shape, and with it the order in which each output sums over K (tile depth,
split-K), so a token's logits change with the number of rows its step has. Here no launch splits K: each output
element sums its `BLOCK_K`-deep tiles in order from zero, and `BLOCK_K` is fixed per dtype, so a row's result is
the same bits whatever rows share the launch. vLLM's batch invariance does the same with a persistent Triton
matmul; this one is written here from that description.

The tile's rows, columns, warps and stages do not enter a row's sums: on an H200, 52 such configurations gave every
row of eight bf16 layer shapes at 1–1 000 rows, and of four float32 ones at 1–200 rows, the same bits as the 64 × 64
tile (BENCHMARKS.md §55). So launches take their tile by the row count (`tile_config`): small tiles that spread a
decode step's few rows over the SMs, 128-row tiles for prompts (float32: 16-row tiles up to 16 rows, else 64 × 64).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N = 64, 64
# float32 operands sum in IEEE float32 (input_precision="ieee"), as cuBLAS does without TF32, in shallower tiles
# (their shared-memory tiles are twice as large).
BLOCK_K = {torch.float32: 32, torch.bfloat16: 64, torch.float16: 64}
NUM_WARPS, NUM_STAGES = 4, 3
# 16-bit operands: (largest row count, (BLOCK_M, BLOCK_N, warps, stages)), the first class that holds the launch's
# rows. Chosen from the H200 sweep of §55 (benchmarks/gpu/invariant_gemm_configs.py) over the Llama-3-8B and SmolLM2
# layer shapes; none changes a row's bits.
TILES_16BIT = (
    (16, (16, 64, 4, 4)),
    (32, (32, 64, 4, 4)),
    (64, (64, 64, 4, 4)),
    (256, (128, 64, 8, 4)),
    (1 << 62, (128, 128, 8, 3)),
)
# float32 (IEEE products): 16-row tiles took 0.44-0.49x the 64 x 64 tile's time at 1-16 rows on four layer shapes;
# from 64 rows no other tile won on all of them (§55). All 52 configurations gave the 64 x 64 tile's bits here too.
TILES_32BIT = (
    (16, (16, 64, 4, 4)),
    (1 << 62, (BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES)),
)
# In the 65-256 row class a wide layer (enough 128 x 128 tiles to give every SM one) takes the larger tile: at 200 rows
# on the H200 gate_up and lm_head ran 1.14x and 1.34x faster so, while down, qkv and o (fewer column tiles) did not.
WIDE_TILE = (128, 128, 8, 3)


def tile_config(m: int, n: int, dtype: torch.dtype, num_sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a launch of `m` rows × `n` columns on a GPU of `num_sms` SMs;
    BLOCK_K is BLOCK_K[dtype] always, so no choice here changes a row's bits."""
    if dtype == torch.float32:
        return next(cfg for rows, cfg in TILES_32BIT if m <= rows)
    rows, cfg = next((rows, cfg) for rows, cfg in TILES_16BIT if m <= rows)
    if rows == 256 and triton.cdiv(m, WIDE_TILE[0]) * triton.cdiv(n, WIDE_TILE[1]) >= num_sms:
        return WIDE_TILE
    return cfg


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


# The row count is not specialised on (Triton would compile a variant for M == 1 and for M % 16 == 0): one compile
# per layer shape and tile class, which the engine's warm-up (graph capture, or its warm-up steps) makes.
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
        bm, bn, warps, stages = tile_config(m, n, x.dtype, _num_sms(x.device))
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _invariant_matmul_kernel[grid](
            x2, w, bias if bias is not None else out, out, m, n, k,
            x2.stride(0), w.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, PREC="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K[x.dtype], num_warps=warps, num_stages=stages,
        )
    return out.reshape(*lead, n)


def warm_up_row_counts(dtype: torch.dtype) -> list[int]:
    """Row counts that reach every tile of `dtype` (each class's largest, and one past the last bound): launching
    each compiles every variant a step can reach (the wide tile of the 65-256 class is the last class's tile)."""
    table = TILES_32BIT if dtype == torch.float32 else TILES_16BIT
    return [rows if rows < (1 << 62) else table[-2][0] + 1 for rows, _ in table]


def warm_up_invariant_linears(linears: list[tuple[torch.Tensor, torch.Tensor | None]]) -> int:
    """Compile the kernel for every (weight, bias) layer shape at every tile class by launching it on rows of zeros,
    so that no step compiles (an eager engine's first long prompt would otherwise wait ~1 s per class). Returns the
    number of launches."""
    seen: set[tuple] = set()
    for weight, bias in linears:
        key = (tuple(weight.shape), weight.dtype, weight.device, bias is not None)
        if key in seen:
            continue
        seen.add(key)
        for m in warm_up_row_counts(weight.dtype):
            invariant_linear(torch.zeros((m, weight.shape[1]), dtype=weight.dtype, device=weight.device), weight, bias)
    return sum(len(warm_up_row_counts(dtype)) for _, dtype, _, _ in seen)
