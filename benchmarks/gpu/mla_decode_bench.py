"""MLA decode over the latent pool (DeepSeek-V2-Lite's row: 512 + 64, one KV head, 16 query heads, bf16, blocks of
16): the MLA kernel (kernels/triton_mla_decode.py) against the generic decode kernel on the same aliased pool
(num_warps 4 and 8; it pads 576 to 1 024 and loads each row as key and as value).

Each point: batch × context, random pool, shuffled block tables padded to 256 columns (max_model_len 4 096, as the
engine pads them under CUDA graphs); median µs of 25 CUDA-graph replays of one call, L2 flushed (read) before each
(``pagedllm.benchmarks.kernels.bench_graph``). GB/s counts the latent bytes a decode must read, seqs × ctx × 576 × 2
B (each row once), and % is of the H100's 3.35 TB/s. The smallest point also checks every kernel against the torch
reference (max |err| / max |ref| over the output's first 512 values per head). `--sweep` adds MLA launch variants
(tile, warps, stages, min tiles per split, programs per SM). CUDA only; ~1 min with compilation (more with
--sweep).

    python3 benchmarks/gpu/mla_decode_bench.py [--sweep] [--batch 1 16 64 256] [--context 512 2048]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pagedllm.benchmarks.kernels import bench_graph  # noqa: E402
from pagedllm.kernels.reference import gather_kv  # noqa: E402
from pagedllm.kernels.triton_attention import DecodeWorkspace, paged_decode_attention  # noqa: E402
from pagedllm.kernels.triton_mla_decode import mla_decode_attention  # noqa: E402

LATENT, ROPE, BLOCK_SIZE, TABLE_WIDTH = 512, 64, 16, 256
HBM_BYTES_PER_S = 3.35e12  # H100 SXM
# MLA launch variants for --sweep: (tile, num_warps, num_stages, min_tiles_per_split, programs_per_sm); the default
# is (32, 4, 2, 4, 2).
SWEEP = ((16, 4, 2, 4, 2), (64, 4, 2, 2, 2), (32, 8, 2, 4, 2), (64, 8, 2, 2, 2), (32, 4, 1, 4, 2), (32, 4, 3, 4, 2),
         (32, 4, 2, 1, 2), (32, 4, 2, 16, 2), (32, 4, 2, 4, 1), (32, 4, 2, 4, 4))


def make_point(batch: int, ctx: int, heads: int, dtype: torch.dtype) -> dict:
    """Query, latent pool and shuffled, padded block tables of one point."""
    g = torch.Generator(device="cuda").manual_seed(batch * 7919 + ctx)
    blocks_per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    pool = torch.randn(num_blocks, BLOCK_SIZE, 1, LATENT + ROPE, device="cuda", dtype=dtype, generator=g)
    perm = torch.randperm(num_blocks, device="cuda", generator=g)[: batch * blocks_per_seq]
    tables = torch.zeros(batch, TABLE_WIDTH, dtype=torch.int32, device="cuda")
    tables[:, :blocks_per_seq] = perm.view(batch, blocks_per_seq).to(torch.int32)
    return dict(q=torch.randn(batch, heads, LATENT + ROPE, device="cuda", dtype=dtype, generator=g), pool=pool,
                tables=tables, seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device="cuda"), ctx=ctx,
                scale=(128 + ROPE) ** -0.5)  # V2's qk_nope + qk_rope head dim


def reference(p: dict) -> torch.Tensor:
    """The torch reference in float32: [S, H, LATENT] = softmax(q · row · scale) · c_kv over each context."""
    rows = gather_kv(p["pool"], p["tables"], p["ctx"])[:, 0].float()  # [S, L, 576]
    s = torch.einsum("shd,sld->shl", p["q"].float(), rows) * p["scale"]
    return torch.einsum("shl,sld->shd", s.softmax(-1), rows[..., :LATENT])


def kernels(p: dict, out: torch.Tensor, ws: DecodeWorkspace, sweep: bool) -> dict:
    """name → a call writing `out` (each head's first LATENT values are the result)."""
    args = (p["q"], p["pool"], p["pool"], p["tables"], p["seq_lens"], p["scale"], p["ctx"])
    fns = {
        "mla": lambda: mla_decode_attention(p["q"], p["pool"], p["tables"], p["seq_lens"], p["scale"], p["ctx"],
                                            LATENT, out=out, workspace=ws),
        "generic_w4": lambda: paged_decode_attention(*args, out=out, workspace=ws, num_warps=4),
        "generic_w8": lambda: paged_decode_attention(*args, out=out, workspace=ws, num_warps=8),
    }
    for tile, warps, stages, min_tiles, pps in SWEEP if sweep else ():
        fns[f"mla_t{tile}_w{warps}_s{stages}_mt{min_tiles}_pps{pps}"] = (
            lambda tile=tile, warps=warps, stages=stages, min_tiles=min_tiles, pps=pps: mla_decode_attention(
                p["q"], p["pool"], p["tables"], p["seq_lens"], p["scale"], p["ctx"], LATENT, out=out, workspace=ws,
                tile=tile, num_warps=warps, num_stages=stages, min_tiles_per_split=min_tiles, programs_per_sm=pps))
    return fns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--sweep", action="store_true", help="also time MLA launch variants")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("mla_decode_bench.py needs CUDA.")
    if max(a.context) > TABLE_WIDTH * BLOCK_SIZE:
        sys.exit(f"contexts up to {TABLE_WIDTH * BLOCK_SIZE} tokens (the tables' {TABLE_WIDTH} columns).")
    dtype = torch.bfloat16
    print(f"{torch.cuda.get_device_name()}: MLA decode, {a.heads} heads, latent {LATENT}+{ROPE}, {dtype}, "
          f"block_size {BLOCK_SIZE}; GB/s = seqs x ctx x {LATENT + ROPE} x 2 B / time; % of 3.35 TB/s")
    ws = DecodeWorkspace.allocate("cuda")
    print(f"{'batch':>5} {'ctx':>5} {'kernel':<28} {'us':>9} {'GB/s':>8} {'%HBM':>6}")
    first = True
    for batch in a.batch:
        for ctx in a.context:
            p = make_point(batch, ctx, a.heads, dtype)
            out = torch.zeros_like(p["q"])
            ref = reference(p) if first else None
            nbytes = batch * ctx * (LATENT + ROPE) * p["pool"].element_size()
            for name, fn in kernels(p, out, ws, a.sweep).items():
                try:
                    out.zero_()
                    fn()
                    torch.cuda.synchronize()
                    err = ""
                    if ref is not None:
                        e = ((out[..., :LATENT].float() - ref).abs().max() / ref.abs().max()).item()
                        err = f"  max rel err {e:.2e}"
                    ms, _ = bench_graph(fn, reps=25, warmup=5)
                except Exception as e:  # a launch variant may not fit (shared memory): report it, go on
                    print(f"{batch:>5} {ctx:>5} {name:<28} failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
                    continue
                gbs = nbytes / (ms * 1e-3) / 1e9
                print(f"{batch:>5} {ctx:>5} {name:<28} {ms * 1e3:>9.1f} {gbs:>8.0f} "
                      f"{100 * gbs * 1e9 / HBM_BYTES_PER_S:>5.1f}%{err}", flush=True)
            first = False
            del p, out


if __name__ == "__main__":
    main()
