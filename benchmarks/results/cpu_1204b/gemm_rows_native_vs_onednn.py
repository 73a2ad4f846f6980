"""Native f32_gemm vs oneDNN packed GEMM at prompt-sized row counts, the bundled model's 30 layers of shapes, 2 threads,
interleaved, best of N (ms per 30 layers x 4 shapes)."""
import time, torch
from pagedllm.kernels import cpu_linear
from pagedllm.kernels.cpu_f32_gemm import load_f32_gemm
torch.set_num_threads(2)
g = load_f32_gemm().for_every_row_count()
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
layers = []
for _ in range(30):
    for k, n in SHAPES:
        w = torch.randn(n, k) / k ** 0.5
        layers.append((w, cpu_linear.pack_linear_weight(w), g.pack(w), n))
for rows in (64, 96, 128, 192, 256, 512, 1024, 2048):
    xs = {k: torch.randn(rows, k) for k in (576, 1536)}
    best = {"onednn": 1e9, "native": 1e9}
    for _ in range(5):
        for name in ("onednn", "native"):
            t0 = time.perf_counter()
            for w, packed, panels, n in layers:
                x = xs[w.shape[1]]
                if name == "onednn":
                    cpu_linear.packed_linear(x, packed, None)
                else:
                    g.linear(x, panels, n, None)
            best[name] = min(best[name], time.perf_counter() - t0)
    flops = 2 * rows * sum(k * n for k, n in SHAPES) * 30
    print(f"rows {rows:5d}: onednn {best['onednn']*1e3:8.2f} ms ({flops/best['onednn']/1e9:6.1f} GFLOP/s)  native {best['native']*1e3:8.2f} ms ({flops/best['native']/1e9:6.1f})  native/onednn time {best['native']/best['onednn']:.2f}", flush=True)
