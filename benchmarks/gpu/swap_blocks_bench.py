"""Swap copies between the device pool and the pinned host pool (preemption swaps and the KV offloading tier): one
Triton launch for every layer and block (triton_cache_ops.swap_blocks, what CacheEngine runs now) against one
copy_ per block and layer tensor (its former path), both on the swap stream as CacheEngine issues them. Llama-3-8B's
KV geometry (32 layers, 8 KV heads of 128, block 16, bf16: 2 MiB a block), 1 024 device blocks, 1 024 host blocks.

    python benchmarks/gpu/swap_blocks_bench.py [blocks per swap ...]
"""
import sys
import time

import torch

from pagedllm.kernels import kv_layout
from pagedllm.worker.cache_engine import CacheEngine


def per_block(ce: CacheEngine, src_cache, dst_cache, mapping) -> None:
    compute = torch.cuda.current_stream()
    ce.swap_stream.wait_stream(compute)
    with torch.cuda.stream(ce.swap_stream):
        for pair in zip(src_cache, dst_cache):
            for src, dst in zip(*pair):
                src, dst = kv_layout.storage_of(src), kv_layout.storage_of(dst)
                for s, d in mapping:
                    dst[d].copy_(src[s], non_blocking=True)
    compute.wait_stream(ce.swap_stream)


def main() -> None:
    counts = [int(x) for x in sys.argv[1:]] or [16, 128, 512]
    ce = CacheEngine(32, 8, 128, 16, 1024, 1024, torch.bfloat16, torch.device("cuda"))
    block_bytes = 32 * 2 * 16 * 8 * 128 * 2
    print(f"{'blocks':>7}{'direction':>10}{'per-block copies ms':>21}{'one launch ms':>15}{'GB/s (launch)':>15}{'ratio':>8}")
    for n in counts:
        out = [(i * 7 % 1024, i) for i in range(n)]  # scattered device blocks → host blocks
        back = [(i, (i * 13 + 5) % 1024) for i in range(n)]
        for name, mapping, fwd in (("out", out, True), ("in", back, False)):
            src, dst = (ce.slot_gpu_cache, ce.slot_cpu_cache) if fwd else (ce.slot_cpu_cache, ce.slot_gpu_cache)
            times = {}
            for label, fn in (("per block", lambda: per_block(ce, src, dst, mapping)),
                              ("launch", lambda: ce._swap_async(src, dst, mapping))):
                fn()
                torch.cuda.synchronize()
                best = float("inf")
                for _ in range(5):
                    t0 = time.perf_counter()
                    fn()
                    torch.cuda.synchronize()
                    best = min(best, time.perf_counter() - t0)
                times[label] = best
            print(f"{n:>7}{name:>10}{1e3 * times['per block']:>21.2f}{1e3 * times['launch']:>15.2f}"
                  f"{n * block_bytes / times['launch'] / 1e9:>15.1f}{times['per block'] / times['launch']:>7.1f}x",
                  flush=True)


if __name__ == "__main__":
    main()
