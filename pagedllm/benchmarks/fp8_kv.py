"""FP8 vs bf16 paged decode on the GPU (issue 21): the same batch, context and block tables read from a
bf16 pool and from an FP8 pool (e4m3, k_scale = v_scale = 1.0) with each of the FP8 kernel's dot dtypes
(``--fp8-dot-dtypes``: fp16, the default, and bf16, the former path), per point: latency (CUDA-graph
replay), K/V bytes read per second ÷ the measured device copy bandwidth, and fp8 ÷ bf16 latency; plus the
error of each FP8 result against the bf16 one. Llama-3-8B attention shape by default (32 query / 8 KV
heads, D 128).

    python -m pagedllm.benchmarks.fp8_kv --fp8-dot-dtypes fp16 bf16 --out fp8_kv.json
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch

from pagedllm.benchmarks.kernels import bench_graph, copy_bandwidth
from pagedllm.kernels import kv_layout, kv_quant

FP8_DOT_CHOICES = ("fp16", "bf16")


def run_names(dot_dtypes: list[str], fp8_tiles: list[int]) -> list[str]:
    """Row keys of one point: the bf16 pool, the FP8 pool per dot dtype, then per extra tile (first dot dtype)."""
    return ["bf16"] + [f"fp8_{d}" for d in dot_dtypes] + [f"fp8_{dot_dtypes[0]}_tile{t}" for t in fp8_tiles]


@dataclass
class DecodeInputs:
    """One decode batch over a shuffled paged pool: bf16 caches and their FP8 (e4m3, scale 1.0) twins."""

    query: torch.Tensor  # [batch, hq, d]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    key_fp8: torch.Tensor
    value_fp8: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


def decode_inputs(batch: int, ctx: int, hq: int, hk: int, d: int = 128, bs: int = 16, seed: int = 0,
                  layout: str = kv_layout.HEAD_MAJOR) -> DecodeInputs:
    """Random CUDA inputs for `batch` sequences of `ctx` tokens (block tables a random permutation of the pool),
    the pools stored in `layout` (by default head-major, as the engine's CUDA pools are)."""
    nb_seq = -(-ctx // bs)
    num_blocks = batch * nb_seq + 1
    g = torch.Generator(device="cuda").manual_seed(seed)
    kc = torch.randn(num_blocks, bs, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(num_blocks, bs, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    tables = torch.randperm(num_blocks, device="cuda", generator=g)[: batch * nb_seq].view(batch, nb_seq).int()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kq, vq = kv_quant.quantize(kc, torch.float8_e4m3fn), kv_quant.quantize(vc, torch.float8_e4m3fn)
    kc, vc, kq, vq = (kv_layout.to_layout(t, layout) for t in (kc, vc, kq, vq))
    return DecodeInputs(q, kc, vc, kq, vq, tables, seq_lens)


def bench_point(batch: int, ctx: int, hq: int, hk: int, d: int, bs: int, dot_dtypes: list[str],
                fp8_tiles: list[int]) -> dict:
    from pagedllm.kernels.triton_attention import DecodeWorkspace, paged_decode_attention

    x = decode_inputs(batch, ctx, hq, hk, d, bs, seed=batch * 7919 + ctx)
    q, kc, vc, kq, vq, tables, seq_lens = (x.query, x.key_cache, x.value_cache, x.key_fp8, x.value_fp8,
                                           x.block_tables, x.seq_lens)
    row: dict = {"batch": batch, "context": ctx}
    outs = {}
    runs = [("bf16", kc, vc, None, None)] + [(f"fp8_{dot}", kq, vq, dot, None) for dot in dot_dtypes]
    runs += [(f"fp8_{dot_dtypes[0]}_tile{t}", kq, vq, dot_dtypes[0], t) for t in fp8_tiles]
    for name, k, v, dot, tile in runs:
        out = torch.empty_like(q)
        ws = DecodeWorkspace.allocate("cuda")
        fn = lambda: paged_decode_attention(q, k, v, tables, seq_lens, d**-0.5, ctx, out=out, workspace=ws,  # noqa: E731
                                            tile=tile, fp8_dot_dtype=dot)
        fn()
        ms, _ = bench_graph(fn)
        kv_bytes = 2 * batch * ctx * hk * d * k.element_size()
        row[name] = {"ms": ms, "kv_bytes": kv_bytes, "kv_bytes_per_s": kv_bytes / (ms * 1e-3)}
        outs[name] = out.float()
    for name in run_names(dot_dtypes, fp8_tiles)[1:]:
        row[name]["over_bf16_latency"] = row[name]["ms"] / row["bf16"]["ms"]
        row[name]["rel_err_vs_bf16"] = ((outs[name] - outs["bf16"]).norm() / outs["bf16"].norm()).item()
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 128])
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--fp8-dot-dtypes", nargs="+", default=list(FP8_DOT_CHOICES), choices=FP8_DOT_CHOICES,
                   help="time the FP8 pool with each of these dot dtypes (fp16: the kernels' default)")
    p.add_argument("--fp8-tiles", type=int, nargs="*", default=[],
                   help="also time the FP8 pool with these tiles (first dot dtype)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dots = list(dict.fromkeys(a.fp8_dot_dtypes))
    bw = copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: copy bandwidth {bw / 1e12:.2f} TB/s (read+write); fp8 = e4m3 pool, dots in "
          f"{' / '.join(dots)}", flush=True)
    rows = []
    for b in a.batches:
        for c in a.contexts:
            r = bench_point(b, c, a.num_heads, a.num_kv_heads, a.head_dim, a.block_size, dots, a.fp8_tiles)
            names = run_names(dots, a.fp8_tiles)
            for n in names:
                r[n]["frac_of_copy_bw"] = r[n]["kv_bytes_per_s"] / bw
            rows.append(r)
            parts = [f"bf16 {r['bf16']['ms']:.3f} ms ({r['bf16']['frac_of_copy_bw']:.0%} of copy bw)"]
            parts += [f"{n} {r[n]['ms']:.3f} ms ({r[n]['frac_of_copy_bw']:.0%}, x{r[n]['over_bf16_latency']:.2f}, "
                      f"err {r[n]['rel_err_vs_bf16']:.3f})" for n in names[1:]]
            print(f"batch {b:4d} ctx {c:5d}: " + "  ".join(parts), flush=True)
            torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": props.name, "copy_bandwidth": bw, "fp8_dot_dtypes": dots, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
