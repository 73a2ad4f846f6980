"""The native float32 GEMM (kernels/cpu/f32_gemm.c, this tree) against oneDNN's packed GEMM (what rows above
`F32Gemm.max_rows` run), the bundled model's 121 GEMMs in sequence with cold weights, 2 threads, alternating
rounds; ms per pass (best of the rounds).

    PYTHONPATH=. python benchmarks/results/cpu_1201b/native_vs_onednn.py --rows 48,64,96,128,256,512
"""
import argparse, time
import torch
from pagedllm.kernels.cpu_f32_gemm import load_f32_gemm

p = argparse.ArgumentParser(); p.add_argument("--rows", default="48,64,96,128,256"); p.add_argument("--rounds", type=int, default=5)
args = p.parse_args()
torch.set_num_threads(2)
g = load_f32_gemm()
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
gen = torch.Generator().manual_seed(0)
ws = [torch.randn(n, k, generator=gen) * 0.05 for n, k in shapes]
panels = [g.pack(w) for w in ws]
dnn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
flush = torch.empty(64 << 20)
print(f"native {g.isa} (max_rows {g.max_rows}) vs oneDNN packed, {len(ws)} GEMMs, {sum(w.numel() for w in ws) * 4 / 1e6:.0f} MB")
for m in [int(r) for r in args.rows.split(",")]:
    xs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}
    best = {"native": 1e9, "onednn": 1e9}
    for _ in range(args.rounds):
        flush.fill_(1.0); t0 = time.perf_counter()
        for w, pk in zip(ws, panels):
            g.linear(xs[w.shape[1]], pk, w.shape[0], None)
        best["native"] = min(best["native"], time.perf_counter() - t0)
        flush.fill_(1.0); t0 = time.perf_counter()
        for w, pk in zip(ws, dnn):
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], pk, None, "none", [], "")
        best["onednn"] = min(best["onednn"], time.perf_counter() - t0)
    fl = sum(2 * m * w.numel() for w in ws)
    print(f"rows {m:4d}: " + "  ".join(f"{n} {1e3*t:7.2f} ms ({fl/t/1e9:5.1f} GFLOP/s)" for n, t in best.items())
          + f"  oneDNN / native {best['onednn'] / best['native']:.2f}x", flush=True)
