"""Is the decode kernel's fixed cost at small reads the benchmark's L2 flush? (issue 21)

bench_graph zeroes a 256 MiB buffer before each timed replay, as triton's do_bench does. That leaves the
50 MB L2 full of dirty lines, and the timed kernel pays for writing them back. This times the paged decode
kernel (bf16 and FP8 pools, default launch) and two plain transfers of the same byte count — a read
(int32 amax) and a copy (half the bytes read, half written) — after a write flush, a read flush and no
flush; prints each against the 1 GiB copy bandwidth.

    python benchmarks/gpu/l2_flush_probe.py [BATCHxCTX,...] [HQxHK,...] [OUT.json]
"""
import json
import sys

import torch

from pagedllm.benchmarks.fp8_kv import decode_inputs
from pagedllm.benchmarks.kernels import FLUSH_MODES, bench_graph, copy_bandwidth
from pagedllm.kernels.triton_attention import DecodeWorkspace, paged_decode_attention

D, BS = 128, 16


def main() -> None:
    points = [tuple(map(int, p.split("x"))) for p in (sys.argv[1] if len(sys.argv) > 1 else
                                                       "64x2048,64x4096,128x4096").split(",")]
    shapes = [tuple(map(int, p.split("x"))) for p in (sys.argv[2] if len(sys.argv) > 2 else "32x8").split(",")]
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: 1 GiB copy bandwidth {bw / 1e12:.3f} TB/s (do_bench, write flush)")
    rows = []
    for hq, hk in shapes:
        for batch, ctx in points:
            x = decode_inputs(batch, ctx, hq, hk, D, BS, seed=batch + ctx)
            out = torch.empty_like(x.query)
            row = {"heads": f"{hq}x{hk}", "batch": batch, "ctx": ctx}
            for pool, k, v in (("bf16", x.key_cache, x.value_cache), ("fp8", x.key_fp8, x.value_fp8)):
                nbytes = 2 * batch * ctx * hk * D * k.element_size()
                ws = DecodeWorkspace.allocate("cuda")
                attn = lambda x=x, k=k, v=v, ws=ws, ctx=ctx: paged_decode_attention(  # noqa: E731
                    x.query, k, v, x.block_tables, x.seq_lens, D ** -0.5, ctx, out=out, workspace=ws)
                src = torch.ones(nbytes // 4, dtype=torch.int32, device="cuda")
                half = torch.ones(nbytes // 4, dtype=torch.int16, device="cuda")
                dst = torch.empty_like(half)
                kinds = {"attention": attn, "read": lambda src=src: src.amax(),
                         "copy": lambda dst=dst, half=half: dst.copy_(half)}
                for kind, fn in kinds.items():
                    for mode in FLUSH_MODES:
                        ms = bench_graph(fn, flush=mode)[0]
                        row[f"{pool}_{kind}_{mode}"] = ms
                        print(f"{hq}x{hk} {batch:4d}x{ctx:5d} {pool:4s} {kind:9s} flush {mode:5s}: {ms * 1e3:8.1f} us "
                              f"= {nbytes / (ms * 1e-3) / bw:6.1%} of copy bw ({nbytes / 1e6:.0f} MB)", flush=True)
                row[f"{pool}_bytes"] = nbytes
                del src, half, dst
            rows.append(row)
            del x
            torch.cuda.empty_cache()
    if len(sys.argv) > 3:
        with open(sys.argv[3], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bandwidth": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
