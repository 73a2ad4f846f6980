"""The torch sampler path on the CPU: 64 rows of 49 152 logits, per kind of row (median of 15 calls)."""
import random, statistics, time, torch
from pagedllm.model.layers.sampler import Sampler
from pagedllm.model.layers.sampling_metadata import SamplingRow
from pagedllm.sampling_params import SamplingParams
g = torch.Generator().manual_seed(0)
base = torch.randn(64, 49152, generator=g) * 2
allowed = torch.rand(64, 49152, generator=g) < 0.02
allowed[:, 0] = True
bits = torch.zeros(64, 49152 // 32, dtype=torch.int64)
for j in range(32): bits |= allowed[:, j::32].long() << j
mask = bits.where(bits < 2**31, bits - 2**32).to(torch.int32)
cases = {
    "temp 0.8": (SamplingParams(temperature=0.8), None),
    "top_p 0.95": (SamplingParams(temperature=0.8, top_p=0.95), None),
    "top_k 50": (SamplingParams(temperature=0.8, top_k=50), None),
    "presence 0.5": (SamplingParams(temperature=0.8, presence_penalty=0.5), None),
    "masked temp 1": (SamplingParams(temperature=1.0), mask),
    "masked top_p 0.95": (SamplingParams(temperature=1.0, top_p=0.95), mask),
    "masked logprobs 2": (SamplingParams(temperature=1.0, logprobs=2), mask),
}
s = Sampler()
for name, (p, m) in cases.items():
    ts = []
    for rep in range(15):
        rows = [SamplingRow(p, [1, 2, 3], [4, 5], random.Random(i)) for i in range(64)]
        x = base.clone()
        t = time.perf_counter()
        s(x, rows, token_bitmask=None if m is None else (m, list(range(64))))
        ts.append(time.perf_counter() - t)
    print(f"{name:>18}: {statistics.median(ts)*1e3:6.2f} ms per 64 rows", flush=True)
