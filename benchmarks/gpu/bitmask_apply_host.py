"""Issue 19 probe: the host's cost of applying a step's grammar bitmask on the GPU (the engine is host-bound on
the bundled model, so every µs the step thread spends here shows in a constrained step's time). Times, per call
and without synchronising, the pieces of `apply_token_bitmask_`: the pinned host → device copy, the Triton launch,
the whole call; the kernel reading the pinned host mask in place (no copy); and a torch-ops alternative.

    python benchmarks/gpu/bitmask_apply_host.py
"""
import time

import torch

from pagedllm.kernels.triton_bitmask import apply_token_bitmask_triton
from pagedllm.model.layers.sampler import apply_token_bitmask_


def host_us(fn, reps: int = 300) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    el = time.perf_counter() - t
    torch.cuda.synchronize()
    return el / reps * 1e6


def main() -> None:
    vocab = 49152
    words = (vocab + 31) // 32
    shifts = torch.arange(32, device="cuda", dtype=torch.int32)
    for n in (36, 64):
        logits = torch.randn(n, vocab, device="cuda")
        mask = torch.randint(-2**31, 2**31 - 1, (n, words), dtype=torch.int32).pin_memory()
        dev_mask = mask.to("cuda")
        rows = list(range(n))

        def torch_ops():
            m = mask.to("cuda", non_blocking=True)
            bits = (m.unsqueeze(-1) >> shifts) & 1
            logits.masked_fill_(bits.view(n, -1)[:, :vocab] == 0, float("-inf"))
        # Zero-copy: the kernel reads the pinned host mask in place (mapped memory under unified addressing).
        want = logits.clone()
        apply_token_bitmask_triton(want, dev_mask, None)
        got = logits.clone()
        apply_token_bitmask_triton(got, mask, None)
        torch.cuda.synchronize()
        same = torch.equal(want, got)
        print(f"rows {n}: zero-copy launch {host_us(lambda: apply_token_bitmask_triton(logits, mask, None)):.1f} µs "
              f"(same result as the copied mask: {same})", flush=True)
        print(f"rows {n}: whole apply_token_bitmask_ {host_us(lambda: apply_token_bitmask_(logits, mask, rows)):.1f} µs, "
              f"copy {host_us(lambda: mask.to('cuda', non_blocking=True)):.1f} µs, "
              f"triton launch {host_us(lambda: apply_token_bitmask_triton(logits, dev_mask, None)):.1f} µs, "
              f"torch ops {host_us(torch_ops):.1f} µs", flush=True)


if __name__ == "__main__":
    main()
