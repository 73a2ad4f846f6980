"""bfloat16 weights: the bundled model's 121 GEMMs in sequence (streamed from memory) at 1-4 rows, oneDNN packed
against F.linear, alternating rounds, best of 5 (does §41.3's one-row rule pay for bfloat16 too?)."""
import sys, time, torch
sys.path.insert(0, ".")
from pagedllm.kernels import cpu_linear
torch.set_num_threads(2)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
ws = [(torch.randn(n, k) * 0.05).bfloat16() for n, k in shapes]
packed = [cpu_linear.pack_linear_weight(w) for w in ws]
def run(kind, M):
    xs = {k: torch.randn(M, k).bfloat16() for k in (576, 1536)}
    t = time.perf_counter()
    for i, w in enumerate(ws):
        x = xs[w.shape[1]]
        cpu_linear.packed_linear(x, packed[i], None) if kind == "onednn" else torch.nn.functional.linear(x, w)
    return time.perf_counter() - t
for M in (1, 2, 4):
    best = {"onednn": 1e9, "F.linear": 1e9}
    for _ in range(5):
        for k in best: best[k] = min(best[k], run(k, M))
    print(f"bf16 M={M}: " + ", ".join(f"{k} {1e3*v:.1f} ms" for k, v in best.items()), flush=True)
