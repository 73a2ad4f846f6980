"""FP8 weight GEMMs (issue 21): the decode-step linears of a shape at several batch sizes, timed as bf16
``F.linear`` and as ``torch._scaled_mm`` variants (row-wise scales as ``fp8_linear`` runs them, with and
without fast accumulation; one scale per tensor), each against its roofline (bytes at copy bandwidth vs
FLOPs at the matmul peak, whichever is longer), plus each variant's error against a float32 product of the
same quantized operands.

    python benchmarks/gpu/fp8_gemm_variants.py [l7b|l8b] [M,M,...]
"""
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from pagedllm.benchmarks.kernels import copy_bandwidth
from pagedllm.benchmarks.lower_bound import measure_matmul_peak
from pagedllm.kernels.fp8_linear import quantize_activation, quantize_weight

SHAPES = {  # name: (K, N)
    "l7b": {"qkv": (4096, 12288), "o": (4096, 4096), "gate_up": (4096, 22016), "down": (11008, 4096)},
    "l8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)},
}


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "l7b"
    ms = [int(m) for m in (sys.argv[2] if len(sys.argv) > 2 else "188,299,472,1024").split(",")]
    bw, peak16, peak8 = copy_bandwidth(), measure_matmul_peak(), measure_matmul_peak(fp8=True)
    print(f"copy bw {bw / 1e12:.2f} TB/s, bf16 peak {peak16 / 1e12:.0f}, fp8 row-wise peak {peak8 / 1e12:.0f} TFLOP/s")
    one = torch.ones((), device="cuda", dtype=torch.float32)
    for m in ms:
        totals: dict[str, float] = {}
        bounds = {"bf16": 0.0, "fp8": 0.0}
        for name, (k, n) in SHAPES[shape].items():
            g = torch.Generator(device="cuda").manual_seed(m * 7 + k)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
            wq, ws = quantize_weight(w)
            xq, xs = quantize_activation(x)
            ref = (xq.float() * xs) @ (wq.float() * ws.t()).t()
            variants = {
                "bf16": lambda: F.linear(x, w),
                "fp8 row": lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16),
                "fp8 row fast": lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16,
                                                         use_fast_accum=True),
                "fp8 tensor": lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                "fp8 tensor fast": lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one,
                                                            out_dtype=torch.bfloat16, use_fast_accum=True),
            }
            line = []
            for label, fn in variants.items():
                us = do_bench(fn, warmup=10, rep=40) * 1e3
                totals[label] = totals.get(label, 0.0) + us
                err = ""
                if label.startswith("fp8 row"):
                    err = f" err {((fn().float() - ref).norm() / ref.norm()).item():.1e}"
                line.append(f"{label} {us:.0f}{err}")
            b16 = max(2 * n * k / bw, 2 * m * n * k / peak16) * 1e6
            b8 = max(n * k / bw, 2 * m * n * k / peak8) * 1e6
            bounds["bf16"] += b16
            bounds["fp8"] += b8
            print(f"M={m} {name} (bound bf16 {b16:.0f} / fp8 {b8:.0f} µs): " + ", ".join(line))
        summary = ", ".join(f"{lbl} {us * 32 / 1e3:.2f} ms ({bounds['bf16' if lbl == 'bf16' else 'fp8'] / us:.0%})"
                            for lbl, us in totals.items())
        print(f"M={m} per step (32 layers): {summary}")


if __name__ == "__main__":
    main()
