"""FP8 decode-kernel launch parameters (issue 21): for the FP8 pool with fp16 dots, time every combination of
tile, num_warps, num_stages and programs per SM at batch 64/128 x context 4096/8192 (Llama-3-8B attention),
against the bf16 pool with its defaults; prints the best FP8 setting per point and overall.

    python benchmarks/gpu/fp8_kernel_sweep.py [BATCHxCTX,...] [OUT.json] [HQxHK]
    (defaults 64x4096,128x8192,64x8192 and 32x8; LLaMA-7B's MHA attention: 32x32)
"""
import itertools
import json
import sys

import torch

from pagedllm.benchmarks.fp8_kv import decode_inputs
from pagedllm.benchmarks.kernels import bench_graph, copy_bandwidth
from pagedllm.kernels.triton_attention import DecodeWorkspace, paged_decode_attention

D, BS = 128, 16


def main() -> None:
    hq, hk = map(int, (sys.argv[3] if len(sys.argv) > 3 else "32x8").split("x"))
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    results = []
    spec = sys.argv[1] if len(sys.argv) > 1 else "64x4096,128x8192,64x8192"
    for batch, ctx in (tuple(map(int, p.split("x"))) for p in spec.split(",")):
        x = decode_inputs(batch, ctx, hq, hk, D, BS, seed=batch + ctx)
        q, kc, vc, kq, vq, tables, lens = (x.query, x.key_cache, x.value_cache, x.key_fp8, x.value_fp8,
                                           x.block_tables, x.seq_lens)
        out = torch.empty_like(q)

        def time(k, v, **kw):
            ws = DecodeWorkspace.allocate("cuda")
            fn = lambda: paged_decode_attention(q, k, v, tables, lens, D ** -0.5, ctx, out=out, workspace=ws, **kw)  # noqa: E731
            fn()
            return bench_graph(fn)[0]

        base = time(kc, vc)
        fp8_bytes = 2 * batch * ctx * hk * D
        rows = []
        for tile, warps, stages, pps in itertools.product((64, 128, 256), (2, 4, 8), (2, 3, 4), (1, 2, 4, 8)):
            try:
                ms = time(kq, vq, tile=tile, num_warps=warps, num_stages=stages, programs_per_sm=pps)
            except Exception as e:  # a shared-memory overflow, e.g.
                print(f"  tile {tile} warps {warps} stages {stages} pps {pps}: {type(e).__name__}", file=sys.stderr)
                continue
            rows.append({"tile": tile, "warps": warps, "stages": stages, "pps": pps, "ms": ms,
                         "of_bw": fp8_bytes / (ms * 1e-3) / bw, "over_bf16": ms / base})
        rows.sort(key=lambda r: r["ms"])
        default = time(kq, vq)
        print(f"batch {batch} ctx {ctx}: bf16 {base:.3f} ms; fp8 default {default:.3f} ms (x{default / base:.2f}); best:")
        for r in rows[:6]:
            print(f"   tile {r['tile']:>3} warps {r['warps']} stages {r['stages']} pps {r['pps']}: {r['ms']:.3f} ms "
                  f"{100 * r['of_bw']:.0f}% of copy bw, x{r['over_bf16']:.2f} bf16")
        results.append({"batch": batch, "ctx": ctx, "bf16_ms": base, "fp8_default_ms": default, "rows": rows})
    if len(sys.argv) > 2 and sys.argv[2] != "-":
        with open(sys.argv[2], "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
