"""The chunked Mamba-2 scan on a GPU (BENCHMARKS §83): ssd_varlen_scan with its Triton kernels against the torch
form of the same sums, at the Bamba-1b mixer's shape (64 heads of 64, one group, state 128) for the prompt
chunks of throughput.py's uniform workload (64-512 tokens) packed into one 8 192-token step and into a 2 048-token
one and a 512-token one (the layout built once, as the engine does per step); the largest difference from the torch
form printed. Times: triton.testing.do_bench's median (3 ms of warm-up, 20 ms of runs).

    python benchmarks/gpu/ssd_scan_bench.py
"""
from __future__ import annotations

import random

import torch
from triton.testing import do_bench

from pagedllm.model.layers import mamba2


def step_lens(budget: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    lens: list[int] = []
    while sum(lens) < budget:
        lens.append(min(rng.randint(64, 512), budget - sum(lens)))
    return lens


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    heads, head_dim, groups, d_state = 64, 64, 1, 128
    print(torch.cuda.get_device_name(), f"heads {heads}x{head_dim}, groups {groups}, state {d_state}")
    for budget in (8192, 2048, 512):
        lens = step_lens(budget)
        total = sum(lens)
        torch.manual_seed(0)
        inner, width = heads * head_dim, groups * d_state
        conv = torch.randn(total, inner + 2 * width, device="cuda")  # x, B, C: views into one conv output
        x = conv[:, :inner].reshape(total, heads, head_dim)
        b = conv[:, inner: inner + width].reshape(total, groups, d_state)
        c = conv[:, inner + width:].reshape(total, groups, d_state)
        dt = torch.rand(total, heads, device="cuda") * 0.1
        a = -torch.rand(heads, device="cuda") * 4
        s0 = torch.randn(len(lens), heads, head_dim, d_state, device="cuda")
        for block in (64, 128, 256):
            layout = mamba2.scan_layout(lens, block, None, torch.device("cuda"))
            results = {}
            for kernels in (False, True):
                run = lambda: mamba2.ssd_varlen_scan(x, dt, a, b, c, s0, lens, block, None, layout,  # noqa: E731
                                                     kernels=kernels)
                results[kernels] = (do_bench(run, warmup=3, rep=20, return_mode="median"), run())
            (t_torch, ref), (t_kern, got) = results[False], results[True]
            diff = max(((g - r).abs().max() / r.abs().max()).item() for g, r in zip(got[:2], ref[:2]))
            print(f"T={total} seqs={len(lens)} block={block}: torch {t_torch:.3f} ms, kernels {t_kern:.3f} ms "
                  f"({t_torch / t_kern:.2f}x; rel. max diff {diff:.1e})", flush=True)


if __name__ == "__main__":
    main()
