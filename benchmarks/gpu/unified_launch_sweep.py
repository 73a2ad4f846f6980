"""The unified attention kernel's launch parameters (issues 21, 16): whole-step graphs run every mixed step's
attention through `unified_attention`, whose 16-row tiles took the prefill kernel's 64-key, 4-warp, 3-stage
launch. On mixed steps with hundreds of decodes (an FP8 pool's, BENCHMARKS §56.3) the unified kernel was slower than
the piecewise path's decode and prefill kernels. Per step layout and pool dtype, this times the unified kernel at its
default and at every (block_n, num_warps, num_stages) of a small grid, and the piecewise path's two launches
(split-KV decode kernel on the decodes, prefill kernel on the chunks) on the same rows, as CUDA-graph replays.

    python benchmarks/gpu/unified_launch_sweep.py [out.json]
"""
import itertools
import json
import random
import sys

import torch

from pagedllm.benchmarks.kernels import bench_graph
from pagedllm.kernels.triton_attention import paged_decode_attention, paged_prefill_attention
from pagedllm.kernels.triton_unified_attention import unified_attention

D, BS = 128, 16
SHAPES = {"llama-7b (MHA 32/32)": (32, 32), "llama-3-8b (GQA 32/8)": (32, 8)}
LAYOUTS = {  # name: (decode contexts, [(chunk query tokens, context before the chunk)])
    "400 decodes + 2 x 370-token chunks": ([("dec", 400)], [(370, 300), (370, 300)]),
    "200 decodes + one 600-token chunk": ([("dec", 200)], [(600, 0)]),
    "256 decodes": ([("dec", 256)], []),
}
GRID = list(itertools.product((32, 64, 128), (2, 4, 8), (2, 3)))


def build(hq: int, hk: int, layout, kv_dtype: torch.dtype, seed: int):
    rng = random.Random(seed)
    [(_, n_dec)], chunks = layout
    dec_lens = [rng.randint(100, 900) for _ in range(n_dec)]
    q_lens = [1] * n_dec + [q for q, _ in chunks]
    seq_lens = dec_lens + [q + c for q, c in chunks]
    nblk = [-(-s // BS) for s in seq_lens]
    total = sum(nblk) + 1
    g = torch.Generator(device="cuda").manual_seed(seed)
    kc = torch.randn(total, BS, hk, D, device="cuda", generator=g).to(kv_dtype)
    vc = torch.randn(total, BS, hk, D, device="cuda", generator=g).to(kv_dtype)
    perm = torch.randperm(total, device="cuda", generator=g)
    tables = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32, device="cuda")
    off = 0
    for i, n in enumerate(nblk):
        tables[i, :n] = perm[off: off + n]
        off += n
    qsl = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    query = torch.randn(sum(q_lens), hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return query, kc, vc, tables, lens, qsl, n_dec, len(chunks), max(q_lens), max(seq_lens)


def main() -> None:
    results = {}
    for (shape, (hq, hk)), (lname, layout), kv in itertools.product(
            SHAPES.items(), LAYOUTS.items(), (torch.bfloat16, torch.float8_e4m3fn)):
        if hk != hq and lname != "400 decodes + 2 x 370-token chunks":
            continue  # GQA: only the FP8 pool's step shape, to see that a new default does not hurt it
        query, kc, vc, tables, lens, qsl, n_dec, n_chunks, max_q, max_len = build(hq, hk, layout, kv, 5)
        scale = D ** -0.5
        out = torch.empty_like(query)

        def split():
            if n_dec:
                paged_decode_attention(query[:n_dec], kc, vc, tables[:n_dec], lens[:n_dec], scale, max_len,
                                       out=out[:n_dec])
            if n_chunks:
                paged_prefill_attention(query, kc, vc, tables, lens, qsl, scale, n_dec, n_chunks, max_q, out)

        split()
        want = out.clone()
        key = f"{shape} | {lname} | {str(kv).split('.')[-1]}"
        row = {"split": bench_graph(split)[0]}

        def unified(**kw):
            return lambda: unified_attention(query, kc, vc, tables, lens, qsl, scale, out, **kw)

        unified()()
        err = float((out.float() - want.float()).abs().max())
        row["unified default"] = bench_graph(unified())[0]
        for bn, w, st in GRID:
            try:
                unified(block_n=bn, num_warps=w, num_stages=st)()
                row[f"unified n{bn} w{w} s{st}"] = bench_graph(unified(block_n=bn, num_warps=w, num_stages=st))[0]
            except Exception as e:  # noqa: BLE001 - a launch that does not fit (shared memory) is reported
                row[f"unified n{bn} w{w} s{st}"] = f"{type(e).__name__}"
        best = min((v, k) for k, v in row.items() if isinstance(v, float) and k.startswith("unified"))
        print(f"{key}: split {row['split']:.3f} ms, unified default {row['unified default']:.3f} ms, "
              f"best {best[1]} {best[0]:.3f} ms (max |unified - split| {err:.3g})", flush=True)
        results[key] = row
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
