"""Fused MoE experts (kernels/triton_fused_moe.py) against the torch per-expert loop (layers/fused_moe.py's
`fused_experts_torch`, Hugging Face's way), same inputs, same run, at real MoE layer shapes.

Prints per token count: both times (median of CUDA-event-timed eager calls), the ratio, the Triton path's time as a
CUDA-graph replay (how the engine's graphs run it; the torch loop's data-dependent shapes cannot be captured), and
that time's fraction of its roofline bound, max(bytes / copy bandwidth, FLOPs / matmul peak), both measured in this run: bytes are the weights
of the experts the step routes to (read once) plus activations, FLOPs 2·3·H·I per (token, expert) pair.

    python benchmarks/fused_moe.py                     # CUDA, bf16, Qwen3-30B-A3B and Mixtral-8x7B layer shapes
"""
from __future__ import annotations

import argparse
import statistics

import torch

from pagedllm.kernels.triton_fused_moe import fused_experts
from pagedllm.model.layers.fused_moe import fused_experts_torch, select_experts

SHAPES = {  # name: (hidden, moe intermediate, experts, top-k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}


def _time_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _graph_ms(fn, reps: int) -> float:
    """Median time of replays of `fn` captured in a CUDA graph (as the engine's decode and piecewise graphs run it)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _time_ms(graph.replay, reps)


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write counted)."""
    a = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    ms = _time_ms(lambda: b.copy_(a), 10)
    return 2 * a.numel() * 2 / (ms / 1e3)


def matmul_peak(dtype: torch.dtype) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    a @ a
    ms = _time_ms(lambda: a @ a, 10)
    return 2 * 8192 ** 3 / (ms / 1e3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", nargs="*", type=int, default=[1, 8, 64, 256, 1024, 4096])
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    dtype = torch.bfloat16
    bw, peak = copy_bandwidth(), matmul_peak(dtype)
    print(f"device: {torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul peak "
          f"{peak / 1e12:.0f} TFLOP/s (both measured now)")
    for name in args.shapes:
        h, inter, experts, top_k = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        w13 = torch.randn(experts, 2 * inter, h, device="cuda", dtype=dtype, generator=g) * h ** -0.5
        w2 = torch.randn(experts, h, inter, device="cuda", dtype=dtype, generator=g) * inter ** -0.5
        print(f"\n{name}: hidden {h}, expert width {inter}, {experts} experts, top-{top_k}; "
              f"{w13.numel() * 3 // 2 * 2 / 1e9:.2f} GB of expert weights")
        print(f"{'tokens':>7} {'experts hit':>11} {'triton ms':>10} {'torch ms':>9} {'speed-up':>9} "
              f"{'graph ms':>9} {'bound ms':>9} {'of bound':>9}  max |diff|")
        for t in args.tokens:
            x = torch.randn(t, h, device="cuda", dtype=dtype, generator=g)
            weights, ids = select_experts(torch.randn(t, experts, device="cuda", generator=g), top_k, True)
            hit = int(torch.unique(ids).numel())
            fast = _time_ms(lambda: fused_experts(x, w13, w2, weights, ids), args.reps)
            graphed = _graph_ms(lambda: fused_experts(x, w13, w2, weights, ids), args.reps)
            slow = _time_ms(lambda: fused_experts_torch(x, w13, w2, weights, ids), max(3, args.reps // 4))
            diff = (fused_experts(x, w13, w2, weights, ids).float()
                    - fused_experts_torch(x, w13, w2, weights, ids).float()).abs().max().item()
            bytes_ = hit * 3 * h * inter * 2 + t * h * 2 * 2 + t * top_k * (3 * inter) * 2 * 2
            flops = t * top_k * 2 * 3 * h * inter
            bound = max(bytes_ / bw, flops / peak) * 1e3
            print(f"{t:7d} {hit:11d} {fast:10.3f} {slow:9.3f} {slow / fast:8.2f}x {graphed:9.3f} {bound:9.3f} "
                  f"{bound / graphed:8.1%}  {diff:.3g}")


if __name__ == "__main__":
    main()
