"""Paged prefill attention launch parameters (issue 16, long prompts): time the Triton prefill kernel for
every (block_m, block_n, num_warps, num_stages) on chunks shaped like the long workload's mixed steps
(Llama-3-8B attention: 32 query / 8 KV heads, D 128, block 16, bf16), against torch SDPA (flash / efficient)
on the same queries with contiguous K/V and a bottom-right causal mask, and print TFLOP/s of the causal work.

    python benchmarks/gpu/prefill_kernel_sweep.py [out.json]
"""
import itertools
import json
import sys

import torch
from torch.nn.attention.bias import causal_lower_right

from pagedllm.benchmarks.kernels import bench_graph
from pagedllm.kernels.triton_attention import paged_prefill_attention, prefill_launch

HQ, HK, D, BS = 32, 8, 128, 16
CASES = {  # name: [(query tokens, context before them)] per sequence
    "2048 new": [(2048, 0)],
    "2048 after 4000": [(2048, 4000)],
    "512 after 5000 + 3x512 new": [(512, 5000), (512, 0), (512, 0), (512, 0)],
    "8x256 new": [(256, 0)] * 8,
}


def causal_flops(seqs) -> float:
    return sum(4 * D * HQ * (q * c + q * (q + 1) / 2) for q, c in seqs)


def main() -> None:
    results = {}
    for name, seqs in CASES.items():
        g = torch.Generator(device="cuda").manual_seed(len(name))
        nblk = [-(-(q + c) // BS) for q, c in seqs]
        total_blocks = sum(nblk) + 1
        kc = torch.randn(total_blocks, BS, HK, D, device="cuda", dtype=torch.bfloat16, generator=g)
        vc = torch.randn_like(kc)
        perm = torch.randperm(total_blocks, device="cuda", generator=g)
        width = max(nblk)
        tables = torch.zeros(len(seqs), width, dtype=torch.int32, device="cuda")
        off = 0
        for i, n in enumerate(nblk):
            tables[i, :n] = perm[off: off + n]
            off += n
        qlens = [q for q, _ in seqs]
        cu = torch.tensor([0] + list(itertools.accumulate(qlens)), dtype=torch.int32, device="cuda")
        seq_lens = torch.tensor([q + c for q, c in seqs], dtype=torch.int32, device="cuda")
        query = torch.randn(sum(qlens), HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
        out = torch.empty_like(query)
        flops = causal_flops(seqs)

        def run(**kw):
            fn = lambda: paged_prefill_attention(query, kc, vc, tables, seq_lens, cu, D ** -0.5, 0, len(seqs),  # noqa: E731
                                                 max(qlens), out, **kw)
            fn()
            return bench_graph(fn)[0]

        # The peer: SDPA per sequence over contiguous K/V gathered from the pool (gather not timed).
        per_seq = []
        for i, (q, c) in enumerate(seqs):
            blocks = tables[i, : nblk[i]].long()
            k = kc[blocks].reshape(-1, HK, D)[: q + c].transpose(0, 1).unsqueeze(0).contiguous()
            v = vc[blocks].reshape(-1, HK, D)[: q + c].transpose(0, 1).unsqueeze(0).contiguous()
            qq = query[cu[i]: cu[i + 1]].transpose(0, 1).unsqueeze(0).contiguous()
            per_seq.append((qq, k, v, causal_lower_right(q, q + c)))

        def sdpa():
            for qq, k, v, mask in per_seq:
                torch.nn.functional.scaled_dot_product_attention(qq, k, v, attn_mask=mask, enable_gqa=True)

        sdpa_ms = bench_graph(sdpa)[0]
        default = run()
        rows = []
        for bm, bn, w, st in itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (1, 2, 3)):
            try:
                ms = run(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
            except Exception as e:  # out of shared memory / registers
                print(f"  {bm}/{bn}/{w}/{st}: {type(e).__name__}", file=sys.stderr)
                continue
            rows.append({"block_m": bm, "block_n": bn, "warps": w, "stages": st, "ms": ms})
        rows.sort(key=lambda r: r["ms"])
        print(f"{name}: SDPA {sdpa_ms:.3f} ms ({flops / sdpa_ms / 1e9:.0f} TFLOP/s); paged default "
              f"{prefill_launch(D, BS, 2)} {default:.3f} ms ({flops / default / 1e9:.0f} TFLOP/s, x{default / sdpa_ms:.2f} SDPA)")
        for r in rows[:5]:
            print(f"   m {r['block_m']:>3} n {r['block_n']:>3} warps {r['warps']} stages {r['stages']}: {r['ms']:.3f} ms "
                  f"({flops / r['ms'] / 1e9:.0f} TFLOP/s, x{r['ms'] / sdpa_ms:.2f} SDPA)")
        results[name] = {"sdpa_ms": sdpa_ms, "default_ms": default, "flops": flops, "rows": rows}
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
