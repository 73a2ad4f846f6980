"""Does the pool's physical layout limit the decode kernel (issue 21)? The pool is [blocks, slots, heads, dim]:
one (sequence, KV head) reads each slot's dim-vector (128 B in FP8, 256 B in bf16) at a stride of heads·dim.
A head-major pool ([blocks, heads, slots, dim], viewed with the same logical shape through a permute, which
the kernel's strides follow) makes one head's block one contiguous run (2 KiB FP8 / 4 KiB bf16). Times the
decode kernel on both layouts, bf16 and FP8, defaults plus a few FP8 launch settings.

    python benchmarks/gpu/kv_layout_probe.py [HQxHK:BATCHxCTX,...]
"""
import sys

import torch

from pagedllm.benchmarks.fp8_kv import decode_inputs
from pagedllm.benchmarks.kernels import bench_graph, copy_bandwidth
from pagedllm.kernels import kv_layout
from pagedllm.kernels.triton_attention import DecodeWorkspace, paged_decode_attention

D, BS = 128, 16


def to_head_major(cache: torch.Tensor) -> torch.Tensor:
    return kv_layout.to_layout(cache, kv_layout.HEAD_MAJOR)


def main() -> None:
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    spec = sys.argv[1] if len(sys.argv) > 1 else "32x32:256x512,32x32:64x2048,32x8:256x512,32x8:64x2048"
    for point in spec.split(","):
        heads, bc = point.split(":")
        hq, hk = map(int, heads.split("x"))
        batch, ctx = map(int, bc.split("x"))
        x = decode_inputs(batch, ctx, hq, hk, D, BS, seed=batch + ctx + hk, layout=kv_layout.SLOT_MAJOR)
        q, kc, vc, kq, vq, tables, lens = (x.query, x.key_cache, x.value_cache, x.key_fp8, x.value_fp8,
                                           x.block_tables, x.seq_lens)
        out = torch.empty_like(q)
        ref = {}

        def time(name, k, v, nbytes, **kw):
            ws = DecodeWorkspace.allocate("cuda")
            fn = lambda: paged_decode_attention(q, k, v, tables, lens, D ** -0.5, ctx, out=out, workspace=ws, **kw)  # noqa: E731
            fn()
            key = "fp8" if k.dtype != torch.bfloat16 else "bf16"
            if key in ref:
                err = (out.float() - ref[key]).abs().max().item()
                if err > 0:
                    print(f"  {name}: output differs from the slot-major run by {err:.2e}")
            else:
                ref[key] = out.float().clone()
            ms = bench_graph(fn)[0]
            print(f"  {name:44s} {ms:.4f} ms  {nbytes / (ms * 1e-3) / bw:5.1%} of copy bw")
            return ms

        print(f"{hq}x{hk} heads, batch {batch} ctx {ctx}:")
        b16 = 2 * batch * ctx * hk * D * 2
        time("bf16 slot-major (today)", kc, vc, b16)
        time("bf16 head-major", to_head_major(kc), to_head_major(vc), b16)
        time("fp8 slot-major (today)", kq, vq, b16 // 2)
        hk_, hv_ = to_head_major(kq), to_head_major(vq)
        time("fp8 head-major", hk_, hv_, b16 // 2)
        for tile, warps, stages in ((64, 4, 3), (128, 4, 3), (128, 2, 3), (32, 2, 4), (64, 2, 4)):
            time(f"fp8 head-major tile {tile} warps {warps} stages {stages}", hk_, hv_, b16 // 2, tile=tile,
                 num_warps=warps, num_stages=stages)


if __name__ == "__main__":
    main()
