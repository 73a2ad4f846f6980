"""Decode attention: the paged Triton kernel vs SDPA on contiguous K/V (every backend that runs).

Llama-3-8B head shape by default (32 query heads, 8 KV heads, head dim 128), bf16, block size 16.
For each batch × context point: median latency of a CUDA-graph replay of one call, L2 flushed before each
(eager do_bench time of the paged call is kept too, as `paged_ms_eager`; the paged call is the default
single-launch split-KV, `--variants` adds the two-kernel reduction and other split counts),
achieved K/V bandwidth, and paged ÷ best contiguous. The device-to-device copy bandwidth is measured
in the same run as the ceiling. Needs CUDA.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time

import torch
import torch.nn.functional as F

SDPA_BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
# (tile, num_warps, num_stages, programs_per_sm, min_tiles_per_split) variants of the paged kernel
# (fused reduction); the first is the default (None: chosen by the kernel's wrapper).
VARIANTS = ((None, 4, None, 2, 1), (32, 4, None, 2, 1), (64, 4, None, 2, 2))
# Named variants: keyword overrides of the default call (split-KV merged in the same launch, "fused";
# block-table row preloaded with 2 pipeline stages where the table has at most 256 columns, else
# per-tile table loads with 3 stages).
REDUCE_VARIANTS = {
    "reduce_separate": {"reduce": "separate"},
    "table_per_tile_stages3": {"preload_table": False, "num_stages": 3},
    "table_per_tile_stages2": {"preload_table": False, "num_stages": 2},
    "preload_stages3": {"preload_table": True, "num_stages": 3},
    "preload_stages2": {"preload_table": True, "num_stages": 2},
    "pps1": {"programs_per_sm": 1},
    "pps3": {"programs_per_sm": 3},
    "pps3_tile32": {"programs_per_sm": 3, "tile": 32},
}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--context", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--variants", action="store_true", help="also time the paged kernel's tuning variants")
    p.add_argument("--json", default=None, help="write all figures here")


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy, bytes read + written per second."""
    from triton.testing import do_bench

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


FLUSH_MODES = ("write", "read", "none")


def bench_graph(fn, reps: int = 200, warmup: int = 10, flush: str = "read") -> tuple[float, bool]:
    """Median ms of one call, timed as a CUDA-graph replay between device events with L2 flushed before
    each (so host launch overhead is out of the number, as the engine's decode graphs will take it out).
    `flush`: "read" (default) reads a 256 MiB buffer, which leaves L2 full of clean lines, as a decode
    step's kernels find it (they follow GEMMs that read weights and write little); "write" zeroes it, as
    triton's do_bench does, which leaves L2 full of dirty lines whose write-back the timed call pays for
    (~10 µs on an H100, BENCHMARKS.md §42.1); "none" does not flush. Falls back to triton's do_bench if
    the call cannot be captured. → (ms, captured)."""
    if flush not in FLUSH_MODES:
        raise ValueError(f"flush must be one of {FLUSH_MODES}, got {flush!r}.")
    from triton.testing import do_bench

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
    except RuntimeError:
        return do_bench(fn, warmup=25, rep=100, return_mode="median"), False
    buf = torch.zeros(256 << 20, dtype=torch.int8, device="cuda")
    words = buf.view(torch.int32)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for _ in range(warmup):
        graph.replay()
    for i in range(reps):
        if flush == "write":
            buf.zero_()
        elif flush == "read":
            words.amax()
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2], True


def _sdpa_fn(backend: str, q, k, v, scale):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = getattr(SDPBackend, backend)

    def fn():
        with sdpa_kernel([be]):
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    return fn


def bench_point(batch: int, ctx: int, args, dtype, variants: bool) -> dict:
    from triton.testing import do_bench

    from pagedllm.kernels.reference import gather_kv
    from pagedllm.kernels.triton_attention import DecodeWorkspace, paged_decode_attention

    hq, hk, d, bs = args.num_heads, args.num_kv_heads, args.head_dim, args.block_size
    nb_seq = -(-ctx // bs)
    num_blocks = batch * nb_seq + 1
    g = torch.Generator(device="cuda").manual_seed(batch * 7919 + ctx)
    key_cache = torch.randn(num_blocks, bs, hk, d, device="cuda", dtype=dtype, generator=g)
    value_cache = torch.randn(num_blocks, bs, hk, d, device="cuda", dtype=dtype, generator=g)
    perm = torch.randperm(num_blocks, device="cuda", generator=g)[: batch * nb_seq]
    tables = perm.view(batch, nb_seq).to(torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, d, device="cuda", dtype=dtype, generator=g)
    scale = d**-0.5
    kv_bytes = 2 * batch * ctx * hk * d * key_cache.element_size()

    k = gather_kv(key_cache, tables, ctx).contiguous()  # [B, Hk, L, D], the same values
    v = gather_kv(value_cache, tables, ctx).contiguous()
    q4 = q.unsqueeze(2)
    row: dict = {"batch": batch, "context": ctx, "kv_bytes": kv_bytes, "sdpa": {}, "variants": {}}

    out = torch.empty_like(q)
    ws = DecodeWorkspace.allocate("cuda")  # owned by the caller, as the engine's backend does: no per-call memset
    paged = lambda **kw: paged_decode_attention(q, key_cache, value_cache, tables, seq_lens, scale, ctx, out=out,  # noqa: E731
                                                workspace=ws, **kw)
    paged()
    ref = None
    for backend in SDPA_BACKENDS:
        if backend == "MATH" and kv_bytes > (1 << 30):
            row["sdpa"][backend] = None  # would materialise 4x K/V copies
            continue
        fn = _sdpa_fn(backend, q4, k, v, scale)
        try:
            o = fn()
            torch.cuda.synchronize()
        except RuntimeError as e:  # backend does not support this shape / GQA
            row["sdpa"][backend] = None
            row.setdefault("sdpa_errors", {})[backend] = str(e).splitlines()[0][:160]
            continue
        if ref is None:
            ref = o.squeeze(2).float()
        row["sdpa"][backend], row.setdefault("graph", {})[backend] = bench_graph(fn)
    row["rel_err_vs_sdpa"] = ((out.float() - ref).norm() / ref.norm()).item() if ref is not None else None
    row["paged_ms"], row.setdefault("graph", {})["paged"] = bench_graph(paged)
    row["paged_ms_eager"] = do_bench(paged, warmup=25, rep=100, return_mode="median")  # host launch included
    if variants:
        for tile, warps, stages, pps, mt in VARIANTS[1:]:
            name = f"tile{tile}_w{warps}_s{stages or 'auto'}_pps{pps}_mt{mt}"
            row["variants"][name] = bench_graph(
                lambda: paged(tile=tile, num_warps=warps, num_stages=stages, programs_per_sm=pps,
                              min_tiles_per_split=mt))[0]
        for name, kw in REDUCE_VARIANTS.items():
            row["variants"][name] = bench_graph(lambda: paged(**kw))[0]
    times = [t for t in row["sdpa"].values() if t is not None]
    row["best_contig_ms"] = min(times) if times else None
    row["best_contig_backend"] = min((t, b) for b, t in row["sdpa"].items() if t is not None)[1] if times else None
    row["ratio"] = row["paged_ms"] / row["best_contig_ms"] if times else None
    if row["variants"]:
        best_var = min(row["variants"].values())
        row["best_variant_ratio"] = min(row["paged_ms"], best_var) / row["best_contig_ms"] if times else None
    del key_cache, value_cache, k, v
    torch.cuda.empty_cache()
    return row


def run(args) -> int:
    if not torch.cuda.is_available():
        print("benchmarks/decode_attention.py needs a CUDA GPU.")
        return 1
    dtype = getattr(torch, args.dtype)
    random.seed(0)
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    header = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
              "copy_bw_TBps": bw / 1e12, "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(header))
    rows = []
    for b in args.batch:
        for c in args.context:
            t0 = time.perf_counter()
            try:
                row = bench_point(b, c, args, dtype, args.variants)
            except Exception as e:  # keep measuring the other points
                print(f"batch {b} context {c} failed: {type(e).__name__}: {e}", flush=True)
                torch.cuda.empty_cache()
                continue
            rows.append(row)
            print(json.dumps(row), f"# {time.perf_counter() - t0:.1f}s", flush=True)
    print(f"\n{props.name}, copy bandwidth {bw / 1e12:.2f} TB/s (read+write); K/V bandwidth = K/V bytes / time")
    print("| batch | ctx | paged µs | eager µs | paged TB/s | % copy | best contiguous | µs | TB/s | paged÷best | cudnn | flash | efficient | math |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fmt = lambda t: f"{t * 1e3:.1f}" if t is not None else "n/a"  # noqa: E731
        pbw = r["kv_bytes"] / (r["paged_ms"] * 1e-3)
        best = r["best_contig_ms"]
        print(
            f"| {r['batch']} | {r['context']} | {r['paged_ms'] * 1e3:.1f} | {r['paged_ms_eager'] * 1e3:.1f} | {pbw / 1e12:.2f} | {100 * pbw / bw:.0f} | "
            f"{r['best_contig_backend']} | {fmt(best)} | "
            f"{(r['kv_bytes'] / (best * 1e-3)) / 1e12 if best else math.nan:.2f} | "
            f"{r['ratio'] if r['ratio'] else math.nan:.3f} | "
            + " | ".join(fmt(r["sdpa"][b]) for b in SDPA_BACKENDS) + " |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    add_args(p)
    return run(p.parse_args())
