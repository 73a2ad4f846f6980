"""Which tile configurations of the batch-invariant GEMM give a row the same bits? (VLLM_BATCH_INVARIANT=1, CUDA)

kernels/triton_invariant_matmul.py runs one fixed tile (64×64, BLOCK_K 64 for 16-bit types) at every row count,
which keeps a row's bits independent of its batch but runs far below cuBLAS. If rows computed under other tile
shapes (BLOCK_M, BLOCK_N, warps, stages) with the same BLOCK_K get the same bits, the kernel may pick its tile by
the row count and stay invariant. For each layer shape this prints, per candidate config, whether every row equals
the reference config's row (bitwise) and the time at each row count against cuBLAS (torch's matmul).

    python benchmarks/gpu/invariant_gemm_configs.py --json out.json
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from pagedllm.benchmarks.lower_bound import mean_cuda_ms
from pagedllm.kernels.triton_invariant_matmul import BLOCK_K, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_WARPS, \
    _invariant_matmul_kernel

SHAPES = {  # name: (N, K)
    "l8b.qkv": (6144, 4096), "l8b.o": (4096, 4096), "l8b.gate_up": (28672, 4096), "l8b.down": (4096, 14336),
    "l8b.lm_head": (128256, 4096), "s135.qkv": (960, 576), "s135.gate_up": (3072, 576), "s135.down": (576, 1536),
}


def launch(x, w, out, bm, bn, bk, warps, stages):
    m, k = x.shape
    n = w.shape[0]
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _invariant_matmul_kernel[grid](x, w, out, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                                   HAS_BIAS=False, PREC="ieee" if x.dtype == torch.float32 else "tf32",
                                   BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 200, 1000])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    dt = getattr(torch, a.dtype)
    bk = BLOCK_K[dt]
    cands = [(bm, bn, w, s) for bm, bn in itertools.product((16, 32, 64, 128), (32, 64, 128, 256))
             for w, s in ((4, 3), (4, 4), (8, 3), (8, 4)) if bm * bn <= 128 * 256 and not (w == 8 and bm * bn < 64 * 64)]
    ref_cfg = (BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES)
    report = {"device": torch.cuda.get_device_name(), "dtype": a.dtype, "block_k": bk, "shapes": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    mmax = max(a.rows)
    for name in a.shapes:
        n, k = SHAPES[name]
        w = torch.randn(n, k, device="cuda", dtype=dt, generator=g) / k ** 0.5
        x = torch.randn(mmax, k, device="cuda", dtype=dt, generator=g)
        ref = launch(x, w, torch.empty(mmax, n, device="cuda", dtype=dt), ref_cfg[0], ref_cfg[1], bk, ref_cfg[2],
                     ref_cfg[3])
        res = {"cublas_ms": {}, "configs": {}}
        for m in a.rows:
            res["cublas_ms"][m] = mean_cuda_ms(lambda: x[:m] @ w.t(), 20)
        for bm, bn, wp, st in cands:
            key = f"{bm}x{bn}w{wp}s{st}"
            try:
                same = True
                out = torch.empty(mmax, n, device="cuda", dtype=dt)
                for m in a.rows:
                    got = launch(x[:m], w, out[:m], bm, bn, bk, wp, st)
                    same &= bool(torch.equal(got, ref[:m]))
                ms = {m: mean_cuda_ms(lambda: launch(x[:m], w, out[:m], bm, bn, bk, wp, st), 20) for m in a.rows}
                res["configs"][key] = {"same_bits": same, "ms": ms}
            except Exception as exc:  # out of shared memory, etc.
                res["configs"][key] = {"error": str(exc)[:120]}
        report["shapes"][name] = res
        ok = {c: v for c, v in res["configs"].items() if "ms" in v}
        print(f"{name} (N {n}, K {k}): {sum(v['same_bits'] for v in ok.values())}/{len(ok)} configs give the "
              f"reference bits; differing: {[c for c, v in ok.items() if not v['same_bits']]}", flush=True)
        for m in a.rows:
            best = min(ok, key=lambda c: ok[c]["ms"][m])
            best_same = min((c for c in ok if ok[c]["same_bits"]), key=lambda c: ok[c]["ms"][m], default=None)
            refk = "{}x{}w{}s{}".format(*ref_cfg)
            print(f"  rows {m:5d}: cuBLAS {res['cublas_ms'][m]:.4f} ms; reference {refk} "
                  f"{ok[refk]['ms'][m]:.4f}; best {best} {ok[best]['ms'][m]:.4f}; best with the reference bits "
                  f"{best_same} {ok[best_same]['ms'][m] if best_same else float('nan'):.4f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
