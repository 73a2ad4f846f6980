"""Cost of the CPU GEMM row buckets (kernels/cpu_linear.py): oneDNN at the exact row count vs
`packed_linear` (padded / split to bucket sizes), on the bundled model's four layer shapes.

    python benchmarks/cpu_gemm_buckets.py --threads 1
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from pagedllm.kernels import cpu_linear

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out): qkv, o, gate_up, down


def _once(xs: list[torch.Tensor], ws: list[torch.Tensor], exact: bool) -> float:
    t0 = time.perf_counter()
    for x, w in zip(xs, ws):
        if exact:
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        else:
            cpu_linear.packed_linear(x, w, None)
    return time.perf_counter() - t0


def _both(rows: int, ws: list[torch.Tensor], repeats: int) -> tuple[float, float]:
    """(bucketed, exact) ms: min of `repeats` interleaved runs (the machine may be shared)."""
    xs = [torch.randn(rows, i) for i, _ in SHAPES]
    tb, te = [], []
    for _ in range(repeats):
        tb.append(_once(xs, ws, False))
        te.append(_once(xs, ws, True))
    return 1e3 * min(tb), 1e3 * min(te)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    if not cpu_linear.onednn_linear_available():
        raise SystemExit("this torch build has no oneDNN packed linear")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    ws = [cpu_linear.pack_linear_weight(torch.randn(o, i)) for i, o in SHAPES]
    print(f"threads {args.threads}")
    for rows in (17, 33, 65, 129, 257, 511, 513, 1025, 1151):
        b, e = _both(rows, ws, args.repeats)
        print(f"rows {rows:5d} -> {str(cpu_linear.gemm_row_plan(rows)):26s} exact {e:8.2f} ms  bucketed {b:8.2f} ms"
              f"  ratio {b / e:.3f}", flush=True)
    rng = random.Random(0)
    for lo, hi in ((17, 64), (65, 511), (512, 2048)):
        sample = [rng.randint(lo, hi) for _ in range(24)]
        tb = te = 0.0
        for rows in sample:
            b, e = _both(rows, ws, args.repeats)
            tb, te = tb + b, te + e
        extra = sum(run for r in sample for _, run in cpu_linear.gemm_row_plan(r)) / sum(sample) - 1
        print(f"24 row counts uniform in [{lo}, {hi}]: {100 * extra:.1f} % extra rows, GEMM time exact {te:.1f} ms,"
              f" bucketed {tb:.1f} ms, ratio {tb / te:.3f}", flush=True)


if __name__ == "__main__":
    main()
