"""The CPU path's kernels against their torch peers, on the bundled model's shapes, in one run.

GEMMs: oneDNN with prepacked weights vs ``F.linear`` (torch's default BLAS). Attention: the native
PagedAttention kernel vs the torch path (gather blocks + SDPA, kernels/reference.py) for one layer of
a decode batch and of prompt chunks with and without cached context (optionally with a sliding window and a logit
soft cap, `--sliding-window` / `--soft-cap`: the windowed decode reports the K/V bytes its window reads). Fused ops:
the native RMSNorm/RoPE/SiLU·mul vs the layers' torch code.
Each figure is the median of `--repeats` timed calls after warm-up; ratios are torch ÷ ours.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Callable

# SmolLM2-135M: hidden 576, 9 query / 3 KV heads of 64, MLP 1536, vocabulary 49152.
HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 576, 9, 3, 64, 1536, 49152
GEMM_SHAPES = {"qkv": (HIDDEN, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM), "o": (HIDDEN, HIDDEN),
               "gate_up": (HIDDEN, 2 * INTER), "down": (INTER, HIDDEN), "lm_head": (HIDDEN, VOCAB)}


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def bench_gemm(rows: list[int], repeats: int) -> None:
    import torch
    import torch.nn.functional as F

    from pagedllm.kernels import cpu_linear

    print("GEMM (float32)             torch F.linear     oneDNN packed     ratio")
    for m in rows:
        for name, (k, n) in GEMM_SHAPES.items():
            x, w = torch.randn(m, k), torch.randn(n, k) / k**0.5
            packed = cpu_linear.pack_linear_weight(w)
            flop = 2 * m * k * n
            t_torch = median_ms(lambda: F.linear(x, w), repeats)
            t_ours = median_ms(lambda: cpu_linear.packed_linear(x, packed, None), repeats)
            print(f"  M={m:<5d} {name:<8s} {k:>5d}x{n:<6d} {flop / t_torch / 1e6:8.1f} GFLOP/s  "
                  f"{flop / t_ours / 1e6:8.1f} GFLOP/s  {t_torch / t_ours:6.2f}x")


def bench_decode_attention(num_seqs: int, min_len: int, max_len: int, block_size: int, repeats: int,
                           window: int | None = None, cap: float | None = None) -> None:
    import torch

    from pagedllm.kernels import cpu_kernels, reference
    from pagedllm.kernels.metadata import AttentionMetadata

    kernels = cpu_kernels.load_cpu_kernels()
    rng = random.Random(0)
    lens = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
    width = -(-max_len // block_size)
    num_blocks = 4 * num_seqs * width  # a pool 4x larger than used, blocks scattered over it
    kc = torch.randn(num_blocks, block_size, KV_HEADS, HEAD_DIM)
    vc = torch.randn(num_blocks, block_size, KV_HEADS, HEAD_DIM)
    tables = torch.randperm(num_blocks)[: num_seqs * width].view(num_seqs, width).to(torch.int32)
    query = torch.randn(num_seqs, Q_HEADS, HEAD_DIM)
    fresh = torch.randn(num_seqs, KV_HEADS, HEAD_DIM)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_seqs,), -1), block_tables=tables, seq_lens=seq_lens,
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32), seq_lens_cpu=lens,
        query_lens_cpu=[1] * num_seqs, num_decodes=num_seqs, max_seq_len=max(lens), max_query_len=1,
    )
    scale = HEAD_DIM**-0.5

    def torch_path():
        meta.decode_buckets = None  # derived once per step in the engine: count it once per call here
        return reference.paged_attention(query, fresh, fresh, kc, vc, meta, scale, sliding_window=window,
                                         logits_soft_cap=cap)

    out = torch.empty_like(query)
    kv_bytes = 2 * sum(min(n, window or n) for n in lens) * KV_HEADS * HEAD_DIM * 4
    t_torch = median_ms(torch_path, repeats)
    line = (f"Decode attention, one layer: {num_seqs} seqs, context {min_len}-{max_len}, block {block_size}, "
            f"{Q_HEADS}q/{KV_HEADS}kv heads x {HEAD_DIM}, window {window}, cap {cap}, {kv_bytes / 1e6:.1f} MB of K/V read\n"
            f"  torch (gather + SDPA) {t_torch:7.3f} ms  {kv_bytes / t_torch / 1e6:6.1f} GB/s")
    if kernels is None:
        print(line + "\n  native: unavailable (no C compiler, or PAGEDLLM_CPU_KERNELS=torch)")
        return
    qsl = meta.query_start_loc
    t_ours = median_ms(lambda: kernels.paged_attention(out, query, kc, vc, tables, seq_lens, qsl, scale,
                                                       sliding_window=window, logits_soft_cap=cap), repeats)
    torch.testing.assert_close(out, torch_path(), atol=1e-5, rtol=1e-4)
    print(line + f"\n  native PagedAttention  {t_ours:7.3f} ms  {kv_bytes / t_ours / 1e6:6.1f} GB/s   "
          f"{t_torch / t_ours:.2f}x")


PREFILL_CASES = {  # name: (query tokens per chunk, cached context per chunk)
    "13 fresh prompts, 16-256 tokens": ([random.Random(1).randint(16, 256) for _ in range(13)], [0] * 13),
    "1 fresh prompt, 2048 tokens": ([2048], [0]),
    "1 chunk of 512 after 1536 cached": ([512], [1536]),
    "8 chunks of 8 after 1000 cached": ([8] * 8, [1000] * 8),
}


def bench_prefill_attention(block_size: int, repeats: int, window: int | None = None, cap: float | None = None) -> None:
    """Prompt chunks, one layer: the torch path (per-sequence SDPA, gathering any cached context) vs one
    native call. The engine sends a step to the native kernel when no chunk exceeds 512 tokens."""
    import torch

    from pagedllm.kernels import cpu_kernels, reference
    from pagedllm.kernels.metadata import AttentionMetadata

    kernels = cpu_kernels.load_cpu_kernels()
    if kernels is None:
        print("Prefill attention: native kernels unavailable")
        return
    print(f"Prefill attention, one layer (torch -> native), window {window}, cap {cap}")
    for name, (qlens, ctxs) in PREFILL_CASES.items():
        lens = [q + c for q, c in zip(qlens, ctxs)]
        width = max(-(-n // block_size) for n in lens)
        num_blocks = 2 * len(lens) * width
        kc = torch.randn(num_blocks, block_size, KV_HEADS, HEAD_DIM)
        vc = torch.randn(num_blocks, block_size, KV_HEADS, HEAD_DIM)
        tables = torch.randperm(num_blocks)[: len(lens) * width].view(len(lens), width).to(torch.int32)
        qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32)
        num_tokens = int(qsl[-1])
        query = torch.randn(num_tokens, Q_HEADS, HEAD_DIM)
        rows = torch.cat([torch.arange(c, c + q) for q, c in zip(qlens, ctxs)])  # this step's K/V = cache rows
        seq_of = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(qlens))
        blocks = tables.long()[seq_of, rows // block_size]
        key, value = kc[blocks, rows % block_size], vc[blocks, rows % block_size]
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1), block_tables=tables,
            seq_lens=torch.tensor(lens, dtype=torch.int32), query_start_loc=qsl, seq_lens_cpu=lens,
            query_lens_cpu=qlens, num_decodes=0, max_seq_len=max(lens), max_query_len=max(qlens),
        )
        out_torch, out_native, scale = torch.empty_like(query), torch.empty_like(query), HEAD_DIM**-0.5
        t_torch = median_ms(lambda: reference.prefill_attention(query, key, value, kc, vc, meta, scale, out_torch,
                                                                sliding_window=window, logits_soft_cap=cap), repeats)
        t_ours = median_ms(lambda: kernels.paged_attention(out_native, query, kc, vc, tables, meta.seq_lens, qsl,
                                                           scale, sliding_window=window, logits_soft_cap=cap),
                           repeats)
        torch.testing.assert_close(out_native, out_torch, atol=1e-5, rtol=1e-4)
        print(f"  {name:<34s} {t_torch:8.2f} ms -> {t_ours:8.2f} ms   {t_torch / t_ours:5.2f}x")


def bench_fused_ops(rows: list[int], repeats: int) -> None:
    import torch
    import torch.nn.functional as F

    from pagedllm.kernels import cpu_kernels
    from pagedllm.model.layers.norm import RMSNorm
    from pagedllm.model.layers.rotary import RotaryEmbedding

    kernels = cpu_kernels.load_cpu_kernels()
    if kernels is None:
        print("Fused ops: native kernels unavailable")
        return
    norm = RMSNorm(HIDDEN, 1e-5, torch.float32)
    rope = RotaryEmbedding(HEAD_DIM, 8192, {"rope_type": "default", "rope_theta": 100000.0}, torch.float32)
    print("Fused ops (float32)               torch        native     ratio")
    for t in rows:
        x, res = torch.randn(t, HIDDEN), torch.randn(t, HIDDEN)
        gate_up = torch.randn(t, 2 * INTER)
        qkv = torch.randn(t, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM)
        q, k = qkv[:, : Q_HEADS * HEAD_DIM], qkv[:, Q_HEADS * HEAD_DIM : (Q_HEADS + KV_HEADS) * HEAD_DIM]
        pos = torch.randint(0, 8192, (t,))
        cases = {
            "add+rms_norm": (lambda: norm.forward_native(x, res),
                             lambda: kernels.fused_add_rms_norm(x, res, norm.weight, norm.eps)),
            "rotary": (lambda: rope.forward_native(pos, q, k),
                       lambda: kernels.rotary_embedding(pos, q, k, rope.cos_cache, rope.sin_cache, HEAD_DIM)),
            "silu_and_mul": (lambda: F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:],
                             lambda: kernels.silu_and_mul(gate_up)),
        }
        for name, (ref, ours) in cases.items():
            t_ref, t_ours = median_ms(ref, repeats), median_ms(ours, repeats)
            print(f"  T={t:<5d} {name:<14s} {1e3 * t_ref:9.1f} us  {1e3 * t_ours:9.1f} us  {t_ref / t_ours:6.2f}x")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gemm-rows", type=int, nargs="+", default=[1, 64, 2048], help="GEMM batch rows (M).")
    p.add_argument("--num-seqs", type=int, default=64, help="Decode batch for the attention benchmark.")
    p.add_argument("--min-context", type=int, default=150)
    p.add_argument("--max-context", type=int, default=384)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--op-rows", type=int, nargs="+", default=[64, 2048], help="Token rows for the fused ops.")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--sliding-window", type=int, default=None, help="Attention window W (keys p-W < j <= p).")
    p.add_argument("--soft-cap", type=float, default=None, help="Attention logit soft cap c: s -> c*tanh(s/c).")
    p.add_argument("--attention-only", action="store_true", help="Skip the GEMM and fused-op benchmarks.")


def run(args: argparse.Namespace) -> int:
    import torch

    print(f"threads={torch.get_num_threads()}")
    window, cap = args.sliding_window, args.soft_cap
    if not args.attention_only:
        bench_gemm(args.gemm_rows, args.repeats)
    bench_decode_attention(args.num_seqs, args.min_context, args.max_context, args.block_size, args.repeats,
                           window, cap)
    bench_prefill_attention(args.block_size, max(3, args.repeats // 3), window, cap)
    if not args.attention_only:
        bench_fused_ops(args.op_rows, args.repeats)
    return 0
