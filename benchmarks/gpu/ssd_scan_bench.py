"""The chunked Mamba-2 scan on a GPU (BENCHMARKS §83): ssd_varlen_scan with its Triton block-output kernel against the
torch form of the same sums, at the Bamba-1b mixer's shape (64 heads of 64, one group, state 128) for the prompt
chunks of throughput.py's uniform workload (64-512 tokens) packed into one 8 192-token step and into a 2 048-token
one; kernel tiles compared; the largest difference from the torch form printed. Times: median of 20 after 3 warm-ups.

    python benchmarks/gpu/ssd_scan_bench.py
"""
from __future__ import annotations

import random
import statistics

import torch

import pagedllm.kernels.triton_mamba as tm
from pagedllm.model.layers import mamba2


def step_lens(budget: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    lens: list[int] = []
    while sum(lens) < budget:
        lens.append(min(rng.randint(64, 512), budget - sum(lens)))
    return lens


def timed(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def torch_outputs(xd, b, c, a_cum, starts, **_):
    nb, length, heads, head_dim = xd.shape
    groups = b.shape[2]
    return mamba2._block_outputs_torch(xd.view(nb, length, groups, heads // groups, head_dim), b, c, a_cum, starts)


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    heads, head_dim, groups, d_state = 64, 64, 1, 128
    kernel = tm.ssd_block_outputs
    print(torch.cuda.get_device_name(), f"heads {heads}x{head_dim}, groups {groups}, state {d_state}")
    for budget in (8192, 2048):
        lens = step_lens(budget)
        total = sum(lens)
        torch.manual_seed(0)
        x = torch.randn(total, heads, head_dim, device="cuda")
        dt = torch.rand(total, heads, device="cuda") * 0.1
        a = -torch.rand(heads, device="cuda") * 4
        b = torch.randn(total, groups, d_state, device="cuda")
        c = torch.randn(total, groups, d_state, device="cuda")
        s0 = torch.randn(len(lens), heads, head_dim, d_state, device="cuda")
        for block in (64, 128, 256):
            run = lambda: mamba2.ssd_varlen_scan(x, dt, a, b, c, s0, lens, block)  # noqa: E731
            variants = [("torch", torch_outputs)] + [
                (f"kernel rows {r} warps {w} {p}", lambda *t, r=r, w=w, p=p: kernel(*t, block_rows=r, num_warps=w,
                                                                                    precision=p))
                for r, w, p in ((16, 4, "tf32x3"), (32, 8, "tf32"), (16, 4, "tf32"), (32, 4, "tf32x3"))]
            reference = None
            for name, fn in variants:
                tm.ssd_block_outputs = fn
                try:
                    ms = timed(run)
                    y = run()[0]
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001  (a variant that does not compile here: say so, go on)
                    print(f"  {name}: failed ({type(e).__name__}: {str(e)[:120]})")
                    continue
                finally:
                    tm.ssd_block_outputs = kernel
                if reference is None:
                    reference = y
                diff = (y - reference).abs().max().item() / reference.abs().max().item()
                print(f"T={total} seqs={len(lens)} block={block} {name}: {ms:.3f} ms (rel. max diff {diff:.1e})",
                      flush=True)


if __name__ == "__main__":
    main()
