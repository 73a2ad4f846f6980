"""MXFP4 weights on the CPU's quantized linear (kernels/cpu/quant_ops.c) vs Q4_0 and vs torch's F.linear on the
float32 dequantized weight, on gpt-oss-20b's expert shapes: gate_up 5760 out x 2880 in, down 2880 x 2880.

Random Gaussian weights quantized by gguf.quants; median of interleaved runs per batch of M rows. GFLOP/s counts
2·M·N·K; weight GB/s is the weight's resident bytes (R16 for the GGUF types, 4·N·K for float32) per call, both from
the median. The ratios are times: MXFP4's ÷ Q4_0's and ÷ F.linear's (below 1: MXFP4 faster), of the medians and,
in brackets, of the minimums (steadier on a shared machine).

    python benchmarks/mxfp4_cpu_gemm.py [--threads 2] [--level avx2] [--method int8]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_isa, cpu_quant
from pagedllm.kernels.cpu_quant import GGML_TYPES, GGUFWeight

SHAPES = {"gate_up": (5760, 2880), "down": (2880, 2880)}  # (out, in)
ROWS = (1, 4, 16, 64)


def quantized(dense: np.ndarray, type_name: str) -> np.ndarray:
    """gguf.quants' blocks of ``dense`` [N, K] (in row chunks: MXFP4's quantizer holds 16 candidates a value)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    qt = GGMLQuantizationType[type_name]
    return np.concatenate([quantize(dense[i:i + 256], qt) for i in range(0, dense.shape[0], 256)])


def timings_ms(fns: dict[str, Callable[[], object]], budget_s: float) -> dict[str, tuple[float, float]]:
    """(median, min) ms of each function, runs interleaved (one of each per round) until ``budget_s`` or 200
    rounds."""
    for fn in fns.values():
        fn()  # warm-up: first-touch of buffers, thread pool start
    times: dict[str, list[float]] = {name: [] for name in fns}
    start = time.perf_counter()
    first = times[next(iter(fns))]
    while len(first) < 5 or (time.perf_counter() - start < budget_s and len(first) < 200):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: (1e3 * statistics.median(ts), 1e3 * min(ts)) for name, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--level", default=None, help=f"ISA build, one of {cpu_isa.ISA_LEVELS} (default: the CPU's)")
    p.add_argument("--method", default="int8", choices=("int8", "dequant"))
    p.add_argument("--budget", type=float, default=2.0, help="seconds of timing per shape and row count")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kern = cpu_quant.load_quant_kernels(args.level)
    print(f"threads {args.threads}, build {args.level or cpu_isa.detect_cpu_isa().name} ({kern.isa}), "
          f"method {args.method}")
    rng = np.random.default_rng(0)
    for shape_name, (n, k) in SHAPES.items():
        dense = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
        weights = {t: GGUFWeight.from_gguf_blocks(torch.from_numpy(quantized(dense, t)), GGML_TYPES[t], n, k)
                   for t in ("MXFP4", "Q4_0")}
        w32 = kern.dequantize_rows(weights["MXFP4"], torch.arange(n))
        nbytes = {"MXFP4": weights["MXFP4"].nbytes, "Q4_0": weights["Q4_0"].nbytes, "F.linear": w32.numel() * 4}
        print(f"\n{shape_name}: {n} out x {k} in; resident MB: MXFP4 {nbytes['MXFP4'] / 1e6:.1f} (file "
              f"{n * k // 32 * 17 / 1e6:.1f}), Q4_0 {nbytes['Q4_0'] / 1e6:.1f}, float32 {nbytes['F.linear'] / 1e6:.1f}")
        print(f"{'M':>4} {'':8} {'median ms':>9} {'min ms':>8} {'GFLOP/s':>8} {'GB/s':>7}   {'MXFP4/Q4_0':>14} "
              f"{'MXFP4/F.linear':>14}")
        for m in ROWS:
            x = torch.randn(m, k)
            fns = {"MXFP4": partial(kern.linear, x, weights["MXFP4"], args.method),
                   "Q4_0": partial(kern.linear, x, weights["Q4_0"], args.method),
                   "F.linear": partial(F.linear, x, w32)}
            ms = timings_ms(fns, args.budget)
            for i, (name, (t, best)) in enumerate(ms.items()):
                ratios = "   " + " ".join(f"{ms['MXFP4'][0] / ms[o][0]:5.2f} ({ms['MXFP4'][1] / ms[o][1]:5.2f})"
                                          for o in ("Q4_0", "F.linear")) if i == 0 else ""
                print(f"{m if i == 0 else '':>4} {name:8} {t:9.3f} {best:8.3f} {2 * m * n * k / t / 1e6:8.1f} "
                      f"{nbytes[name] / t / 1e6:7.1f}{ratios}", flush=True)


if __name__ == "__main__":
    main()
