"""The Sampler alone on 64 rows of 49 152 float32 logits at temperature 0.7 (seeded rows): plain, top_k 50, top_k 20 +
top_p 0.8, top_p 0.9; min and median ms of 31 calls."""
import time, torch
from pagedllm import SamplingParams
from pagedllm.model.layers.sampler import Sampler, SamplingRow
torch.manual_seed(0)
x = torch.randn(64, 49152) * 3
def rows(**kw):
    import random; return [SamplingRow(SamplingParams(temperature=0.7, seed=i, **kw), [1, 2], [3], random.Random(i)) for i in range(64)]
s = Sampler()
def t(kw, n=31):
    r = rows(**kw)
    s(x, r); ts = []
    for _ in range(n):
        a = time.perf_counter(); s(x, r); ts.append(time.perf_counter() - a)
    ts.sort(); return f"min {ts[0] * 1e3:6.2f}  median {ts[n // 2] * 1e3:6.2f}"
for kw in ({}, {"top_k": 50}, {"top_k": 20, "top_p": 0.8}, {"top_p": 0.9}):
    print(f"{str(kw):30s}", t(kw), "ms")
