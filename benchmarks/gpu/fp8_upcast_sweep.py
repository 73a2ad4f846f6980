"""Where an FP8 K/V tile becomes fp16 (issue 21): in shared memory (the kernels so far) or right after its load.

Compiled offline for sm_90 (Triton 3.6), the unified kernel on an FP8 pool kept each tile 8-bit in shared memory and
read V's transposed dot operand byte by byte (64 ``ld.shared.b8`` per thread per tile) at 198 registers: two
4-warp programs per SM, against four on a bf16 pool. Converting the V tile in registers right after its load (with a
select, ``_kv_tile``'s UPCAST) lets it reach shared memory as fp16, read by ``ldmatrix.trans``, at 128 registers
(BENCHMARKS.md §57.1). This times, as CUDA-graph replays with L2 flushed, on head-major pools as the engine allocates them:

1. the decode kernel alone (batch × context points), bf16 pool vs FP8 pool at its default and with the tiles
   converted after the load, at a few launches; KV bytes per second ÷ the measured copy bandwidth;
2. the step layouts of ``unified_launch_sweep.py``: the piecewise path (decode + prefill kernels) against the
   unified kernel with and without the preloaded block-table row and the conversion, at a few launches; each with
   its fraction of copy bandwidth, every sequence's K and V read once being the bound.

Every variant's output is compared with the default's.
``python benchmarks/gpu/fp8_upcast_sweep.py [out.json] [--steps-only]``
"""
import itertools
import json
import sys

import torch

from pagedllm.benchmarks.fp8_kv import decode_inputs
from pagedllm.benchmarks.kernels import bench_graph, copy_bandwidth
from pagedllm.kernels import kv_layout
from pagedllm.kernels.triton_attention import DecodeWorkspace, paged_decode_attention, paged_prefill_attention
from pagedllm.kernels.triton_unified_attention import unified_attention

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from unified_launch_sweep import LAYOUTS, SHAPES, build  # noqa: E402

D = 128
DECODE_POINTS = [(64, 2048), (256, 512), (128, 4096), (16, 2048)]
DECODE_VARIANTS = {  # name: kwargs of paged_decode_attention on the FP8 pool
    "fp8 default": {},
    "fp8 up V": dict(fp8_upcast=True),
    "fp8 up V t64 w4 s3": dict(fp8_upcast=True, tile=64, num_warps=4, num_stages=3),
    "fp8 up V t32 w4 s3": dict(fp8_upcast=True, tile=32, num_warps=4, num_stages=3),
    "fp8 up V t128 w8 s3": dict(fp8_upcast=True, tile=128, num_warps=8, num_stages=3),
    "fp8 up V t64 w4 s2": dict(fp8_upcast=True, tile=64, num_warps=4, num_stages=2),
}
UNIFIED_VARIANTS = {  # name: kwargs of unified_attention
    "unified old (no preload, no upcast)": dict(preload_table=False, fp8_upcast=False),
    "unified preload": dict(preload_table=True, fp8_upcast=False),
    "unified preload up V (default)": {},
    "unified up V (no preload)": dict(preload_table=False, fp8_upcast=True),
    "unified preload up V n32": dict(block_n=32),
    "unified preload up V s2": dict(num_stages=2),
    "unified preload up V w8": dict(num_warps=8),
    "unified preload up V n128 s2": dict(block_n=128, num_stages=2),
    "unified preload up V w2": dict(num_warps=2),
    "unified preload up V w2 n32": dict(num_warps=2, block_n=32),
}


def timed(fn, out, want) -> dict:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - a launch that does not fit (shared memory) is reported
        return {"error": type(e).__name__}
    err = float((out.float() - want.float()).abs().max()) if want is not None else 0.0
    return {"ms": bench_graph(fn)[0], "max_abs_diff": err}


def decode_part(bw: float) -> dict:
    rows = {}
    for (hq, hk), (batch, ctx) in itertools.product(((32, 32), (32, 8)), DECODE_POINTS):
        x = decode_inputs(batch, ctx, hq, hk, D, 16, seed=batch + ctx)
        kv_bytes = 2 * batch * ctx * hk * D
        ws = DecodeWorkspace.allocate("cuda")
        out = torch.empty_like(x.query)
        row = {}
        bf = timed(lambda: paged_decode_attention(x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens,
                                                  D ** -0.5, ctx, out=out, workspace=ws), out, None)
        row["bf16"] = bf | {"frac_of_copy_bw": 2 * kv_bytes / (bf["ms"] * 1e-3) / bw}
        want = None
        for name, kw in DECODE_VARIANTS.items():
            r = timed(lambda: paged_decode_attention(x.query, x.key_fp8, x.value_fp8, x.block_tables, x.seq_lens,
                                                     D ** -0.5, ctx, out=out, workspace=ws, **kw), out, want)
            if want is None:
                want = out.clone()
            if "ms" in r:
                r |= {"frac_of_copy_bw": kv_bytes / (r["ms"] * 1e-3) / bw, "over_bf16": r["ms"] / bf["ms"]}
            row[name] = r
        key = f"decode {hq}/{hk} batch {batch} ctx {ctx}"
        best = min((v["ms"], k) for k, v in row.items() if k != "bf16" and "ms" in v)
        print(f"{key}: bf16 {bf['ms']:.3f} ms ({row['bf16']['frac_of_copy_bw']:.0%}); fp8 default "
              f"{row['fp8 default']['ms']:.3f} ({row['fp8 default']['frac_of_copy_bw']:.0%}); best {best[1]} "
              f"{best[0]:.3f} ({row[best[1]]['frac_of_copy_bw']:.0%}, x{row[best[1]]['over_bf16']:.2f} bf16)",
              flush=True)
        rows[key] = row
        torch.cuda.empty_cache()
    return rows


def step_part(bw: float) -> dict:
    rows = {}
    for (shape, (hq, hk)), (lname, layout), kv in itertools.product(
            SHAPES.items(), LAYOUTS.items(), (torch.bfloat16, torch.float8_e4m3fn)):
        if hk != hq and lname != "400 decodes + 2 x 370-token chunks":
            continue
        query, kc, vc, tables, lens, qsl, n_dec, n_chunks, max_q, max_len = build(hq, hk, layout, kv, 5)
        kc, vc = kv_layout.to_layout(kc, kv_layout.HEAD_MAJOR), kv_layout.to_layout(vc, kv_layout.HEAD_MAJOR)
        scale = D ** -0.5
        out = torch.empty_like(query)
        ws = DecodeWorkspace.allocate("cuda")

        def piecewise(**dkw):
            def fn():
                if n_dec:
                    paged_decode_attention(query[:n_dec], kc, vc, tables[:n_dec], lens[:n_dec], scale, max_len,
                                           out=out[:n_dec], workspace=ws, **dkw)
                if n_chunks:
                    paged_prefill_attention(query, kc, vc, tables, lens, qsl, scale, n_dec, n_chunks, max_q, out)
            return fn

        row = {"piecewise": timed(piecewise(), out, None)}
        want = out.clone()
        if kv != torch.bfloat16:
            row["piecewise, decode up V t64 w4 s3"] = timed(
                piecewise(fp8_upcast=2, tile=64, num_warps=4, num_stages=3), out, want)
        for name, kw in UNIFIED_VARIANTS.items():
            if kv == torch.bfloat16 and "up V" in name:
                continue
            row[name] = timed(lambda: unified_attention(query, kc, vc, tables, lens, qsl, scale, out, **kw), out,
                              want)
        key = f"{shape} | {lname} | {str(kv).split('.')[-1]}"
        # The bound: every sequence's K and V read once (chunk tiles re-read earlier keys, mostly from L2).
        kv_bytes = int(lens.sum()) * hk * D * 2 * kc.element_size()
        for v in row.values():
            if "ms" in v:
                v["frac_of_copy_bw"] = kv_bytes / (v["ms"] * 1e-3) / bw
        parts = [f"{k} {v['ms']:.3f} ({v['frac_of_copy_bw']:.0%})" if "ms" in v else f"{k} {v['error']}"
                 for k, v in row.items()]
        print(f"{key}: " + "; ".join(parts), flush=True)
        rows[key] = row
    return rows


def main() -> None:
    bw = copy_bandwidth()
    name = torch.cuda.get_device_properties(0).name
    print(f"{name}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    steps_only = "--steps-only" in sys.argv
    results = {"device": name, "copy_bandwidth": bw, "decode": {} if steps_only else decode_part(bw),
               "steps": step_part(bw)}
    paths = [a for a in sys.argv[1:] if not a.startswith("--")]
    if paths:
        with open(paths[0], "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
