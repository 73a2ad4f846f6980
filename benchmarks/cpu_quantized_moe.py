"""One MoE layer's routed experts on the CPU: GGUF-quantized (one GGUFWeight per expert and projection, the
quantized linears' int8 GEMM, as ``--quantization gguf`` serves a MoE GGUF) vs dequantized float32 (``--quantization
none``), both through layers/fused_moe.py's expert loop, same routing, same run.

The default shape is Qwen3-30B-A3B's layer (hidden 2048, 128 experts of width 768, top 8); the weights are random
blocks (the values do not change the time). Prints per row count: median ms of each path (interleaved repeats: the
machine may be shared), the float / quantized ratio, and both paths' expert weight bytes.

    python benchmarks/cpu_quantized_moe.py --type Q4_K --rows 1 16
"""
from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from pagedllm.benchmarks.gguf_quant import random_gguf_blocks
from pagedllm.kernels.cpu_quant import GGML_TYPES, GGUFWeight, load_quant_kernels
from pagedllm.model.layers.fused_moe import fused_experts_torch, select_experts


def _experts(qtype: int, experts: int, rows: int, cols: int, seed: int) -> tuple[list[GGUFWeight], torch.Tensor]:
    """Random quantized experts [rows, cols] each, and their dequantized float32 stack [experts, rows, cols]."""
    kernels = load_quant_kernels()
    held = [GGUFWeight.from_gguf_blocks(torch.from_numpy(random_gguf_blocks(qtype, rows, cols, seed + e)), qtype,
                                        rows, cols) for e in range(experts)]
    dense = torch.stack([kernels.dequantize_rows(w, torch.arange(rows)) for w in held])
    return held, dense


def _ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--type", default="Q4_K", choices=sorted(GGML_TYPES))
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--width", type=int, default=768, help="each expert's intermediate size")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    qtype = GGML_TYPES[args.type]
    w13, w13_dense = _experts(qtype, args.experts, 2 * args.width, args.hidden, seed=0)
    w2, w2_dense = _experts(qtype, args.experts, args.hidden, args.width, seed=args.experts)
    q_bytes = sum(w.nbytes for w in w13 + w2)
    f_bytes = (w13_dense.numel() + w2_dense.numel()) * 4
    print(f"{args.type} experts: {args.experts} x (gate|up {2 * args.width}x{args.hidden}, down "
          f"{args.hidden}x{args.width}), top {args.top_k}; {torch.get_num_threads()} torch threads, quant kernels "
          f"{load_quant_kernels().isa}; expert bytes quantized {q_bytes / 1e6:.0f} MB, float32 {f_bytes / 1e6:.0f} MB")
    print(f"{'rows':>5} {'quantized ms':>13} {'float32 ms':>11} {'float/quant':>12}")
    gen = torch.Generator().manual_seed(0)
    for rows in args.rows:
        x = torch.randn(rows, args.hidden, generator=gen)
        weights, ids = select_experts(torch.randn(rows, args.experts, generator=gen), args.top_k, True)
        quant = partial(fused_experts_torch, x, w13, w2, weights, ids)
        dense = partial(fused_experts_torch, x, w13_dense, w2_dense, weights, ids)
        quant(), dense()  # warm-up
        pairs = [(_ms(quant), _ms(dense)) for _ in range(args.repeats)]  # interleaved
        q, f = (statistics.median(t) for t in zip(*pairs))
        print(f"{rows:>5} {q:>13.2f} {f:>11.2f} {f / q:>11.2f}x")


if __name__ == "__main__":
    main()
