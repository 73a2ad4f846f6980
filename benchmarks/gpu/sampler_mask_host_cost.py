"""Issue 19: the host cost of `Sampler.launch` for 64 seeded temperature-1 rows of a 49 152 vocabulary, without a
grammar mask, with the mask folded into the sampling kernel (pinned, as the manager's), and with the mask applied
first by its own launch (the path before the fold); pieces of the folded call timed alone. Median µs over rounds
of 200 calls each (the device synchronised after each round only)."""
from __future__ import annotations

import random
import statistics
import time

import torch

from pagedllm.kernels.triton_sample import sample_with_logprob
from pagedllm.model.layers.sampler import Sampler, SamplingRow, apply_token_bitmask_
from pagedllm.sampling_params import SamplingParams

ROWS, VOCAB, CALLS = 64, 49152, 200
logits = torch.randn(ROWS, VOCAB, device="cuda", dtype=torch.bfloat16)
mask = torch.full((ROWS, (VOCAB + 31) // 32), -1, dtype=torch.int32).pin_memory()
params = SamplingParams(temperature=1.0, seed=1)
rows = [SamplingRow(params, [1], [], random.Random(i)) for i in range(ROWS)]
sampler = Sampler()
every = list(range(ROWS))
p2 = torch.rand(ROWS, 2, dtype=torch.float64).pin_memory().cuda()
p_neg = (p2 * torch.tensor([1.0, -1.0], device="cuda", dtype=torch.float64)).contiguous()  # -1/T: masked rows
arms = {
    "no mask": lambda: sampler.launch(logits, rows),
    "mask folded": lambda: sampler.launch(logits, rows, token_bitmask=(mask, every)),
    "mask applied first": lambda: (apply_token_bitmask_(logits, mask, every), sampler.launch(logits, rows)),
    "kernel alone, no mask": lambda: sample_with_logprob(logits, p2),
    "kernel alone, pinned mask": lambda: sample_with_logprob(logits, p_neg, mask),
    "mask.is_pinned()": lambda: mask.is_pinned(),
}
for fn in arms.values():
    fn()
torch.cuda.synchronize()
times = {name: [] for name in arms}
for _ in range(7):
    for name, fn in arms.items():
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        times[name].append((time.perf_counter() - t0) / CALLS * 1e6)
        torch.cuda.synchronize()
for name, ts in times.items():
    print(f"{name:28s} {statistics.median(ts):8.1f} µs per call (rounds: {', '.join(f'{t:.0f}' for t in ts)})")
