"""Host cost of building one step's block tables per KV cache group (model_runner.prepare_inputs's loop), at the
GPU comparison's shape: 111 decoding sequences of ~4 300 tokens, blocks of 16 (272 entries), 1 or 7 groups."""
import random, time
import numpy as np
rows, width, groups = 111, 272, 7
rng = random.Random(0)
tabs = [[[rng.randrange(60000) for _ in range(width)] for _ in range(rows)] for _ in range(groups)]
def build(g):
    t = np.zeros((rows, width), dtype=np.int64)
    for i, tab in enumerate(tabs[g]):
        t[i, :len(tab)] = tab
    return t
for n in (1, groups):
    best = min((lambda t0: ([build(g) for g in range(n)], time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(50))
    print(f"{n} group(s): {best * 1e3:.2f} ms per step")
