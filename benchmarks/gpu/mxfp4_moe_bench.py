"""One gpt-oss-20b MoE layer (32 experts top-4, hidden 2880, width 2880, swigluoai, biases) on the fused-MoE kernels:
bf16 experts against the same experts held as MXFP4, timed as CUDA-graph replays, per token count. Prints each time,
the ratio, the expert bytes the step reads (the experts that received tokens) and that rate against the GPU's copy
bandwidth measured here (device-to-device copy of 2 GiB). MXFP4 is timed both ways its tiles can be decoded: by
`tl.dot_scaled` (Triton's upcast, the default) and by the kernel's own bit decode. Optional tile sweep: SWEEP=1.

    python benchmarks/gpu/mxfp4_moe_bench.py [1,8,64,256,1024,4096]
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import sys

import torch

from pagedllm.benchmarks.kernels import bench_graph, copy_bandwidth
from pagedllm.kernels import triton_fused_moe as tfm
from pagedllm.model.mxfp4 import Mxfp4Weight


def graph_ms(fn, reps: int = 30) -> float:
    """Median ms of a CUDA-graph replay of `fn` (pagedllm.benchmarks.kernels.bench_graph: L2 read-flushed)."""
    return bench_graph(fn, reps=reps)[0]


def main() -> None:
    tokens = [int(t) for t in (sys.argv[1] if len(sys.argv) > 1 else "1,8,64,256,1024,4096").split(",")]
    h, inter, e, k = 2880, 2880, 32, 4
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = Mxfp4Weight(torch.randint(0, 256, (e, 2 * inter, h // 2), dtype=torch.uint8, device="cuda", generator=g),
                      torch.randint(118, 126, (e, 2 * inter, h // 32), dtype=torch.uint8, device="cuda", generator=g))
    w2 = Mxfp4Weight(torch.randint(0, 256, (e, h, inter // 2), dtype=torch.uint8, device="cuda", generator=g),
                     torch.randint(118, 126, (e, h, inter // 32), dtype=torch.uint8, device="cuda", generator=g))
    d13 = torch.stack([w13.dequantize_expert(i, torch.bfloat16) for i in range(e)])
    d2 = torch.stack([w2.dequantize_expert(i, torch.bfloat16) for i in range(e)])
    b13 = torch.randn(e, 2 * inter, device="cuda", dtype=torch.bfloat16)
    b2 = torch.randn(e, h, device="cuda", dtype=torch.bfloat16)
    bw = copy_bandwidth(2 << 30)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    mx_bytes_expert = (w13.blocks[0].numel() + w13.scales[0].numel() + w2.blocks[0].numel() + w2.scales[0].numel())
    bf_bytes_expert = (d13[0].numel() + d2[0].numel()) * 2
    for t in tokens:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
        logits = torch.randn(t, e, device="cuda", generator=g)
        vals, ids = torch.topk(logits, k, dim=-1)
        wts = torch.softmax(vals, dim=-1)
        used = int(torch.unique(ids).numel())
        kw = dict(activation="swigluoai", w13_bias=b13, w2_bias=b2)
        dense = graph_ms(lambda: tfm.fused_experts(x, d13, d2, wts, ids, **kw))
        bm = tfm.block_m_for(t * k, e)
        tiles = tfm.gemm_config(bm, x.dtype, True, t * k)
        flipped = (dataclasses.replace(tiles, mxfp4_scaled_dot=not tiles.mxfp4_scaled_dot),) * 2
        line = f"T={t:5d} experts used {used:2d}: bf16 {dense:7.3f} ms ({used * bf_bytes_expert / dense / 1e6:6.0f} GB/s, " \
               f"{used * bf_bytes_expert / dense / 1e6 / (bw / 1e9):.0%} of copy)"
        ref = tfm.fused_experts(x, d13, d2, wts, ids, **kw).float()
        names = ("dot_scaled", "own decode") if tiles.mxfp4_scaled_dot else ("own decode", "dot_scaled")
        for name, cfgs in zip(names, (None, flipped)):
            mx = graph_ms(lambda: tfm.fused_experts(x, w13, w2, wts, ids, bm, cfgs, **kw))
            err = (tfm.fused_experts(x, w13, w2, wts, ids, bm, cfgs, **kw).float() - ref).abs().max().item()
            line += (f"  MXFP4 {name} {mx:7.3f} ms ({used * mx_bytes_expert / mx / 1e6:6.0f} GB/s, "
                     f"{used * mx_bytes_expert / mx / 1e6 / (bw / 1e9):.0%}) bf16/MXFP4 {dense / mx:.2f}x "
                     f"max|diff| {err:.3g}")
        print(line, flush=True)
        if os.environ.get("SWEEP") == "1":
            res = []
            for bn, bk, nw, ns, scaled in itertools.product((64, 128), (64, 128, 256), (4, 8), (3, 4), (False, True)):
                cfg = tfm.MoeGemmConfig(bn, bk, nw, ns, scaled)
                try:
                    res.append((graph_ms(lambda: tfm.fused_experts(x, w13, w2, wts, ids, bm, (cfg, cfg), **kw), 10),
                                bn, bk, nw, ns, "dot_scaled" if scaled else "own"))
                except Exception:  # out of shared memory and the like
                    continue
            res.sort()
            print(f"   sweep M{bm}: " + "; ".join(f"{m:.3f} ms (N{bn} K{bk} w{nw} s{ns} {d})"
                                                 for m, bn, bk, nw, ns, d in res[:5]), flush=True)

if __name__ == "__main__":
    main()
