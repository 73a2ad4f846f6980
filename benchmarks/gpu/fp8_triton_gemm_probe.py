"""A Triton FP8 GEMM (below; tried for issue 21 and not used by the engine: cuBLAS won, BENCHMARKS.md §42.2)
against cuBLAS's row-wise `_scaled_mm` (fast accumulation, as fp8_linear runs it) on a shape's four decode
linears (32 layers) at several row counts: per config the summed time, CUDA-graph replay with a read flush
(bench_graph), plus its error against an fp32 product of the same quantized operands.

    python benchmarks/gpu/fp8_triton_gemm_probe.py [l7b|l8b] [M,M,...] [OUT.json]
"""
import json
import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedllm.benchmarks.kernels import bench_graph, copy_bandwidth
from pagedllm.benchmarks.lower_bound import measure_matmul_peak
from pagedllm.kernels.fp8_linear import quantize_activation, quantize_weight, scaled_mm


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    num_stages: int = 4
    num_warps: int = 4
    use_tma: bool = False


@triton.jit
def _fp8_gemm_ptr(a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_n = pid // num_m
    pid_m = pid % num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    a_s = tl.load(a_scale_ptr + offs_m, mask=m_ok, other=0.0)
    b_s = tl.load(b_scale_ptr + offs_n, mask=n_ok, other=0.0)
    c = acc * a_s[:, None] * b_s[None, :]
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :], c.to(c_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _fp8_gemm_tma(a_desc, b_desc, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, stride_cm,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_n = pid // num_m
    pid_m = pid % num_m
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = a_desc.load([off_m, k])
        b = b_desc.load([off_n, k])
        acc = tl.dot(a, b.T, acc)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_s = tl.load(a_scale_ptr + offs_m, mask=m_ok, other=0.0)
    b_s = tl.load(b_scale_ptr + offs_n, mask=n_ok, other=0.0)
    c = acc * a_s[:, None] * b_s[None, :]
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :], c.to(c_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def fp8_gemm(xq: torch.Tensor, xs: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16, config: GemmConfig = GemmConfig(),
             out: torch.Tensor | None = None) -> torch.Tensor:
    """(xq · xs)(weight_fp8 · weight_scale)ᵀ: xq [M, K] and weight_fp8 [N, K] e4m3 with contiguous rows,
    xs [M, 1] and weight_scale [1, N] float32 (``fp8_linear``'s scales). K must be a multiple of block_k."""
    m, k = xq.shape
    n = weight_fp8.shape[0]
    if weight_fp8.shape[1] != k:
        raise ValueError(f"x has K = {k}, the weight {weight_fp8.shape[1]}.")
    if k % config.block_k:
        raise ValueError(f"K = {k} must be a multiple of block_k = {config.block_k}.")
    if xq.stride(1) != 1 or weight_fp8.stride(1) != 1:
        raise ValueError("x and the weight must be contiguous along K.")
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    meta = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                num_stages=config.num_stages, num_warps=config.num_warps)
    if config.use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_desc = TensorDescriptor.from_tensor(xq, [config.block_m, config.block_k])
        b_desc = TensorDescriptor.from_tensor(weight_fp8, [config.block_n, config.block_k])
        _fp8_gemm_tma[grid](a_desc, b_desc, out, xs, weight_scale, m, n, k, out.stride(0), **meta)
    else:
        _fp8_gemm_ptr[grid](xq, weight_fp8, out, xs, weight_scale, m, n, k, xq.stride(0), weight_fp8.stride(0),
                            out.stride(0), **meta)
    return out


SHAPES = {  # name: (K, N)
    "l7b": {"qkv": (4096, 12288), "o": (4096, 4096), "gate_up": (4096, 22016), "down": (11008, 4096)},
    "l8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)},
}
CONFIGS = [GemmConfig(bm, bn, bk, st, wp, tma) for tma in (False, True) for (bm, bn, bk, st, wp) in (
    (64, 128, 128, 4, 4), (64, 128, 128, 5, 4), (64, 256, 128, 3, 4), (64, 256, 128, 4, 8),
    (128, 128, 128, 4, 8), (128, 256, 128, 3, 8), (64, 64, 256, 4, 4), (64, 128, 256, 3, 4), (128, 128, 256, 3, 8))]


def label(c: GemmConfig) -> str:
    return f"{'tma' if c.use_tma else 'ptr'} {c.block_m}x{c.block_n}x{c.block_k} s{c.num_stages} w{c.num_warps}"


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "l7b"
    ms = [int(m) for m in (sys.argv[2] if len(sys.argv) > 2 else "188,299,472").split(",")]
    bw, peak8 = copy_bandwidth(), measure_matmul_peak(fp8=True)
    print(f"{torch.cuda.get_device_name()}: copy bw {bw / 1e12:.2f} TB/s, fp8 peak {peak8 / 1e12:.0f} TFLOP/s")
    results = []
    for m in ms:
        totals: dict[str, float] = {}
        errs: dict[str, float] = {}
        bound = 0.0
        for name, (k, n) in SHAPES[shape].items():
            g = torch.Generator(device="cuda").manual_seed(m * 7 + k)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
            wq, ws = quantize_weight(w)
            xq, xs = quantize_activation(x)
            ref = (xq.float() * xs) @ (wq.float() * ws.t()).t()
            bound += max(n * k / bw, 2 * m * n * k / peak8) * 32 * 1e3  # ms
            runs = {"cublas row fast": lambda: scaled_mm(xq, xs, wq, ws)}
            runs.update({label(c): (lambda c=c: fp8_gemm(xq, xs, wq, ws, config=c)) for c in CONFIGS})
            for lab, fn in runs.items():
                try:
                    y = fn()
                    t = bench_graph(fn, reps=50)[0] * 32
                except Exception as e:  # noqa: BLE001 (a config that does not compile or fit)
                    print(f"  {name} {lab}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    totals[lab] = float("inf")
                    continue
                totals[lab] = totals.get(lab, 0.0) + t
                errs[lab] = max(errs.get(lab, 0.0), ((y.float() - ref).norm() / ref.norm()).item())
        base = totals["cublas row fast"]
        print(f"M = {m}: bound {bound:.2f} ms; cuBLAS {base:.2f} ms ({bound / base:.0%} of bound)")
        for lab, t in sorted(totals.items(), key=lambda kv: kv[1])[:8]:
            print(f"   {lab:28s} {t:7.2f} ms  x{t / base:.2f} cuBLAS  {bound / t:5.1%} of bound  "
                  f"err {errs.get(lab, 0):.1e}", flush=True)
        results.append({"m": m, "bound_ms": bound, "totals_ms": totals, "max_rel_err": errs})
    if len(sys.argv) > 3:
        with open(sys.argv[3], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": shape, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
