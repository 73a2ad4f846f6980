"""The bundled model's 120 layer linears + LM head in sequence (weights streamed from memory, as in a step), float32,
at M rows, for each CPU GEMM backend: oneDNN packed (pagedllm's), MKL packed (torch.ops.mkl._mkl_linear) and F.linear.
Alternating rounds, best of 5. Checks MKL's packed weight serves every M it is called with."""
import sys, time, torch
sys.path.insert(0, "/work/main")
from pagedllm.kernels import cpu_linear
torch.set_num_threads(2)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
ws = [torch.randn(n, k) * 0.05 for n, k in shapes]
onednn = [cpu_linear.pack_linear_weight(w) for w in ws]
mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, 64) for w in ws]
def run(kind, M):
    xs = {k: torch.randn(M, k) for k in (576, 1536)}
    t = time.perf_counter()
    for i, w in enumerate(ws):
        x = xs[w.shape[1]]
        if kind == "onednn": cpu_linear.packed_linear(x, onednn[i], None)
        elif kind == "mkl": torch.ops.mkl._mkl_linear(x, mkl[i], w, None, M)
        else: torch.nn.functional.linear(x, w)
    return time.perf_counter() - t
for M in [int(a) for a in (sys.argv[1].split(",") if len(sys.argv) > 1 else "1,4,16,64".split(","))]:
    x = torch.randn(M, 576)
    ok = torch.allclose(torch.ops.mkl._mkl_linear(x, mkl[0], ws[0], None, M), x @ ws[0].t(), atol=1e-4, rtol=1e-4)
    best = {k: 1e9 for k in ("onednn", "mkl", "F.linear")}
    for _ in range(5):
        for k in best: best[k] = min(best[k], run(k, M))
    fl = 2 * M * sum(n * k for n, k in shapes)
    print(f"M={M}: " + ", ".join(f"{k} {1e3*v:.1f} ms ({fl/v/1e9:.0f} GF/s)" for k, v in best.items()) + f"; mkl matches: {ok}", flush=True)
