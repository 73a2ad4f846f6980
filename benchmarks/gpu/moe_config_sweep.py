"""Sweep the fused MoE GEMMs' tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) per layer shape and token count,
timed as CUDA-graph replays (as the engine runs them); prints the best few per point and the current default."""
import itertools, os, statistics, sys
import torch
from pagedllm.kernels import triton_fused_moe as tfm
from pagedllm.model.layers.fused_moe import select_experts

SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2), "small": (1024, 512, 64, 8)}
SHAPES = {k: v for k, v in SHAPES.items() if k in os.environ.get("SHAPES", ",".join(SHAPES)).split(",")}
def graph_ms(fn, reps=30):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); g.replay(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    return statistics.median(ts)
tokens = [int(t) for t in (sys.argv[1].split(",") if len(sys.argv) > 1 else "1,16,64,256,1024,4096".split(","))]
# LARGE=1: only the big tiles (BLOCK_M 64/128 with BLOCK_N up to 256, 3-5 stages) for prefill-sized steps
import os
LARGE = os.environ.get("LARGE") == "1"
SPACE = (itertools.product((64, 128), (128, 256), (32, 64, 128), (4, 8), (3, 4, 5)) if LARGE else
         itertools.product((16, 32, 64, 128), (64, 128), (64, 128), (4, 8), (3, 4)))
SPACE = list(SPACE)
for name, (h, inter, E, k) in SHAPES.items():
    w13 = torch.randn(E, 2 * inter, h, device="cuda", dtype=torch.bfloat16) * h ** -0.5
    w2 = torch.randn(E, h, inter, device="cuda", dtype=torch.bfloat16) * inter ** -0.5
    for t in tokens:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        wts, ids = select_experts(torch.randn(t, E, device="cuda"), k, True)
        base = graph_ms(lambda: tfm.fused_experts(x, w13, w2, wts, ids))
        res = []
        for bm, bn, bk, nw, ns in SPACE:
            if not LARGE and (bm == 128 and t * k < 2048 or bm <= 32 and t * k > 4096 or bm * bn * bk > 128 * 128 * 64):
                continue
            if LARGE and (bm + bn) * bk * ns * 2 > 220_000:  # bf16 tiles of A and B per stage: shared memory
                continue
            cfg = tfm.MoeGemmConfig(bn, bk, nw, ns)
            try:
                ms = graph_ms(lambda: tfm.fused_experts(x, w13, w2, wts, ids, bm, (cfg, cfg)), 15)
            except Exception:  # out of shared memory etc.
                continue
            res.append((ms, bm, bn, bk, nw, ns))
        res.sort()
        print(f"{name} T={t}: default {base:.3f} ms; best " + "; ".join(f"{m:.3f} ms (M{bm} N{bn} K{bk} w{nw} s{ns})" for m, bm, bn, bk, nw, ns in res[:4]), flush=True)
