"""Decode-step GEMMs of the Llama-3-8B shape at M = 64..256 rows, L2 flushed before each call (as in a step,
where 32 layers' weights pass through): `F.linear` on the [N, K] weight (what the engine runs) against the
same product on a pre-transposed [K, N] weight, under cuBLAS and cuBLASLt, each against its roofline
max(weight bytes / copy bandwidth, FLOPs / bf16 peak) measured here.

    python benchmarks/gpu/gemm_layouts.py
"""
import torch
import torch.nn.functional as F

from pagedllm.benchmarks.kernels import copy_bandwidth
from pagedllm.benchmarks.lower_bound import measure_matmul_peak
from pagedllm.benchmarks.roofline import LLAMA3_8B

def _timed(fn, flush: torch.Tensor, reps: int = 50) -> float:
    """Median ms of `fn` between CUDA events, L2 flushed before each call."""
    times = []
    for r in range(reps + 5):
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        if r >= 5:
            times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    bw, peak = copy_bandwidth(), measure_matmul_peak()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 peak {peak / 1e12:.0f} TFLOP/s")
    h, i = LLAMA3_8B["hidden_size"], LLAMA3_8B["intermediate_size"]
    kv = LLAMA3_8B["num_key_value_heads"] * h // LLAMA3_8B["num_attention_heads"]
    shapes = {"qkv": (h, h + 2 * kv), "o": (h, h), "gate_up": (h, 2 * i), "down": (i, h)}
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for m in (64, 128, 248, 256):
            cells = []
            total = {"TN": 0.0, "NN": 0.0, "bound": 0.0}
            for name, (k, n) in shapes.items():
                a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                wt = w.t().contiguous()
                bound = max(2 * n * k / bw, 2 * m * n * k / peak) * 1e3  # ms
                res = {}
                for lay, fn in (("TN", lambda: F.linear(a, w)), ("NN", lambda: a @ wt)):
                    res[lay] = _timed(fn, flush)
                    total[lay] += res[lay]
                total["bound"] += bound
                cells.append(f"{name} TN {res['TN'] * 1e3:.0f} / NN {res['NN'] * 1e3:.0f} µs "
                             f"(bound {bound * 1e3:.0f})")
            print(f"{lib} M={m}: " + "; ".join(cells) + f" | layer TN {total['TN'] * 1e3:.0f} µs "
                  f"({total['bound'] / total['TN']:.0%}), NN {total['NN'] * 1e3:.0f} µs "
                  f"({total['bound'] / total['NN']:.0%})")
