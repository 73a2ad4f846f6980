"""What Triton makes of the attention kernels for a GPU, on a machine without one: per launch, registers, spills,
shared memory, programs per SM, and counts of the instructions that tell how K/V tiles travel (``cp.async`` into
shared memory, ``ldmatrix`` / ``ldmatrix.trans`` or byte loads out of it, fp8 conversions, ``mma.sync`` /
``wgmma``). Launches go through the kernels' own wrappers at a step layout (``--decodes`` one-token sequences of
``--context`` tokens, or a chunk for the prefill kernel), head-major pools as the engine allocates them, compiled for
``--arch`` with Triton's bundled ptxas (``kernels/triton_compile_only.py``). BENCHMARKS.md §57.1 found the unified
kernel's byte-wise V reads on an FP8 pool this way, before any device time.

    python benchmarks/gpu/ptx_report.py --kernels unified decode --pools bfloat16 float8_e4m3fn \\
        --heads 32/32 32/8 --launch "" "num_warps=2" "block_n=32,fp8_upcast=False"

A ``--launch`` entry is comma-separated keyword arguments of the wrapper (ints, True / False); "" is its default.
Programs per SM count registers (64 K per SM) and shared memory (228 KiB on sm_90, 164 KiB on sm_80) only.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from pagedllm.kernels import kv_layout
from pagedllm.kernels.triton_attention import paged_decode_attention, paged_prefill_attention
from pagedllm.kernels.triton_compile_only import compile_only, ptxas_usage
from pagedllm.kernels.triton_unified_attention import unified_attention

SHARED_PER_SM = {90: 228 * 1024, 80: 164 * 1024}
COUNTS = {"cp.async": "cp.async.c", "ld.shared.b8": "ld.shared.b8", "ld.shared": "ld.shared.", "ldmatrix": "ldmatrix",
          "ldmatrix.trans": ".trans.shared", "cvt e4m3": "e4m3x2", "mma.sync": "mma.sync", "wgmma": "wgmma.mma_async"}


def parse_launch(text: str) -> dict:
    """"num_warps=2,fp8_upcast=False" → {"num_warps": 2, "fp8_upcast": False}."""
    kw = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, _, value = item.partition("=")
        kw[key] = {"True": True, "False": False}.get(value, None)
        if kw[key] is None:
            kw[key] = int(value)
    return kw


def launch_kernel(kernel: str, pool: torch.dtype, hq: int, hk: int, decodes: int, context: int, chunk: int,
                  kw: dict) -> None:
    """One launch of `kernel`'s wrapper on CPU tensors shaped like a step (nothing runs under compile_only)."""
    d, bs = 128, 16
    width = -(-context // bs)
    kc = kv_layout.to_layout(torch.zeros(64, bs, hk, d, dtype=pool), kv_layout.HEAD_MAJOR)
    if kernel == "decode":
        q = torch.zeros(decodes, hq, d, dtype=torch.bfloat16)
        paged_decode_attention(q, kc, kc, torch.zeros(decodes, width, dtype=torch.int32),
                               torch.full((decodes,), context, dtype=torch.int32), 0.1, context, **kw)
        return
    q_lens = [1] * decodes + [chunk]
    q = torch.zeros(sum(q_lens), hq, d, dtype=torch.bfloat16)
    starts = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    lens = torch.full((len(q_lens),), context, dtype=torch.int32)
    tables = torch.zeros(len(q_lens), width, dtype=torch.int32)
    if kernel == "unified":
        unified_attention(q, kc, kc, tables, lens, starts, 0.1, q.clone(), **kw)
    else:
        paged_prefill_attention(q, kc, kc, tables, lens, starts, 0.1, decodes, 1, chunk, q.clone(), **kw)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_PER_SM))
    p.add_argument("--kernels", nargs="+", default=["unified", "decode"], choices=["unified", "decode", "prefill"])
    p.add_argument("--pools", nargs="+", default=["bfloat16", "float8_e4m3fn"])
    p.add_argument("--heads", nargs="+", default=["32/32", "32/8"], help="query/KV heads")
    p.add_argument("--launch", nargs="+", default=[""], help="wrapper keyword arguments per variant")
    p.add_argument("--decodes", type=int, default=256)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=512, help="prompt tokens of the step's chunk (unified, prefill)")
    a = p.parse_args()
    print(f"Triton {__import__('triton').__version__}, sm_{a.arch}; {a.decodes} decodes of {a.context} tokens"
          f" (+ a {a.chunk}-token chunk for unified / prefill); head-major pools, head_dim 128, block 16")
    with compile_only(a.arch) as compiled:
        for kernel, pool, heads, launch in itertools.product(a.kernels, a.pools, a.heads, a.launch):
            if a.arch < 89 and "float8" in pool:
                continue
            hq, hk = map(int, heads.split("/"))
            try:
                launch_kernel(kernel, getattr(torch, pool), hq, hk, a.decodes, a.context, a.chunk,
                              parse_launch(launch))
            except TypeError as e:  # a keyword this kernel's wrapper does not take
                print(f"{kernel:8s} {pool:14s} {heads:6s} [{launch}] not a launch of this kernel: {e}")
                continue
            c = compiled[-1]
            use = ptxas_usage(c)
            warps, smem = c.kernel.metadata.num_warps, c.kernel.metadata.shared
            regs = -(-use["registers"] // 8) * 8  # allocated per thread in units of 8
            per_sm = min(65536 // max(1, regs * 32 * warps), SHARED_PER_SM[a.arch] // max(1, smem + 1024))
            counts = " ".join(f"{k} {c.ptx.count(v)}" for k, v in COUNTS.items())
            print(f"{kernel:8s} {pool:14s} {heads:6s} [{launch or 'default'}] warps {warps} regs {use['registers']} "
                  f"spill {use['spill_stores']} B smem {smem} B programs/SM {per_sm} ({per_sm * warps} warps) | "
                  f"{counts}", flush=True)


if __name__ == "__main__":
    main()
