"""The float32 GEMMs of the bundled model's 30 layers (distinct weights) and its lm_head at M rows: the native kernel
(f32_gemm.c) and oneDNN's packed GEMM, median of 7:  python f32_gemm_rows.py 16 32 64"""
import time, statistics, torch, sys
from pagedllm.kernels.cpu_f32_gemm import load_f32_gemm
from pagedllm.kernels import cpu_linear
g = load_f32_gemm()
print("native max rows", g.max_rows, "tile rows", g.tile_rows, "panel", g.panel_width)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
layers = []
for l in range(30):
    for n, k in shapes:
        w = torch.randn(n, k) * 0.05
        layers.append((n, k, g.pack(w), cpu_linear.pack_linear_weight(w)))
lm = torch.randn(49152, 576) * 0.05
lm_native, lm_onednn = g.pack(lm), cpu_linear.pack_linear_weight(lm)
flop_l = sum(2 * n * k for n, k, *_ in layers)
for M in [int(a) for a in sys.argv[1:]] or [16, 32, 64]:
    xs = {k: torch.randn(M, k) for k in (576, 1536)}
    res = {"native": [], "onednn": [], "lm_native": [], "lm_onednn": []}
    for rep in range(7):
        t = time.perf_counter()
        for n, k, pn, po in layers: g.linear(xs[k], pn, n, None)
        res["native"].append(time.perf_counter() - t)
        t = time.perf_counter()
        for n, k, pn, po in layers: cpu_linear.packed_linear(xs[k], po, None)
        res["onednn"].append(time.perf_counter() - t)
        t = time.perf_counter(); g.linear(xs[576], lm_native, 49152, None); res["lm_native"].append(time.perf_counter() - t)
        t = time.perf_counter(); cpu_linear.packed_linear(xs[576], lm_onednn, None); res["lm_onednn"].append(time.perf_counter() - t)
    out = []
    for name, v in res.items():
        m = statistics.median(v); f = (flop_l if not name.startswith("lm") else 2 * 49152 * 576) * M
        out.append(f"{name} {m*1e3:6.1f} ms {f/m/1e9:5.0f} GF/s")
    print(f"M={M}: " + " | ".join(out), flush=True)
