"""FP8 linear layers on the GPU (``--quantization fp8``, issue 21): bf16 ``F.linear`` against the FP8 path
(per-token activation quantization + ``torch._scaled_mm`` with per-channel weight scales), the
quantization done by five torch kernels or by the fused Triton kernel, at Llama-3-8B's linear shapes.
Per point: ms (CUDA-graph replay, L2 flushed), fp8 ÷ bf16, and the quantization alone.

    python -m pagedllm.benchmarks.fp8_gemm --tokens 1 64 256 1024 4096 --out fp8_gemm.json
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from pagedllm.benchmarks.kernels import bench_graph
from pagedllm.kernels import fp8_linear
from pagedllm.kernels.triton_fp8_quant import quantize_activation_rows

#: Llama-3-8B linears: name → (in features K, out features N).
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def _mm(xq, xs, w, ws):
    return fp8_linear.scaled_mm(xq, xs, w, ws)


def bench_point(m: int, k: int, n: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(m * 31 + n)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02)
    wq, ws = fp8_linear.quantize_weight(w)
    fns = {
        "bf16": lambda: F.linear(x, w),
        "fp8_torch_quant": lambda: _mm(*fp8_linear.quantize_activation(x), wq, ws),
        "fp8_fused_quant": lambda: _mm(*quantize_activation_rows(x), wq, ws),
        "quant_torch": lambda: fp8_linear.quantize_activation(x),
        "quant_fused": lambda: quantize_activation_rows(x),
    }
    row: dict = {"tokens": m, "k": k, "n": n}
    for name, fn in fns.items():
        row[name + "_ms"] = bench_graph(fn)[0]
    row["fp8_fused_over_bf16"] = row["fp8_fused_quant_ms"] / row["bf16_ms"]
    row["fp8_torch_over_bf16"] = row["fp8_torch_quant_ms"] / row["bf16_ms"]
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 1024, 4096])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    print(f"{'shape':<8} {'M':>5} {'bf16 ms':>8} {'fp8 torch-q':>11} {'fp8 fused-q':>11} {'fused/bf16':>10} "
          f"{'q torch':>8} {'q fused':>8}")
    for name in args.shapes:
        k, n = SHAPES[name]
        for m in args.tokens:
            r = {"shape": name, **bench_point(m, k, n)}
            rows.append(r)
            print(f"{name:<8} {m:>5} {r['bf16_ms']:>8.4f} {r['fp8_torch_quant_ms']:>11.4f} "
                  f"{r['fp8_fused_quant_ms']:>11.4f} {r['fp8_fused_over_bf16']:>10.2f} {r['quant_torch_ms']:>8.4f} "
                  f"{r['quant_fused_ms']:>8.4f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
