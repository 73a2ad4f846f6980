"""Native f32_gemm builds (MR / prefetch variants) at decode row counts over the bundled model's 30 layers x 4 shapes."""
import ctypes, sys, time, torch
from pagedllm.kernels import cpu_isa, cpu_linear
from pagedllm.kernels.cpu_f32_gemm import F32Gemm, SOURCE, BUILD_FLAGS
from pagedllm.kernels.cpu_kernels import build_library
torch.set_num_threads(2)
isa = cpu_isa.detect_cpu_isa().name
variants = {v: tuple(v.split()) for v in sys.argv[1:]} or {"": ()}
gs = {}
for name, flags in variants.items():
    p = build_library(SOURCE, isa, BUILD_FLAGS + flags)
    gs[name or "default"] = F32Gemm(ctypes.CDLL(str(p)), p, isa).for_every_row_count()
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
ws = [(torch.randn(n, k) / k ** 0.5, n) for _ in range(30) for k, n in SHAPES]
packed = {name: [(g.pack(w), n, w.shape[1]) for w, n in ws] for name, g in gs.items()}
onednn = [(cpu_linear.pack_linear_weight(w), w.shape[1]) for w, n in ws]
big = torch.randn(256 * 1024 * 1024 // 4 * 4)
t0 = time.perf_counter(); big.sum(); t1 = time.perf_counter(); big.sum(); t2 = time.perf_counter()
print(f"torch.sum 1 GiB: {big.numel()*4/(t2-t1)/1e9:.1f} GB/s"); del big
for rows in [int(r) for r in "1 8 16 32 48 64 96".split()]:
    xs = {k: torch.randn(rows, k) for k in (576, 1536)}
    best = {}
    for _ in range(5):
        for name, g in gs.items():
            t0 = time.perf_counter()
            for pk, n, k in packed[name]:
                g.linear(xs[k], pk, n, None)
            best[name] = min(best.get(name, 1e9), time.perf_counter() - t0)
        t0 = time.perf_counter()
        for pk, k in onednn:
            cpu_linear.packed_linear(xs[k], pk, None)
        best["onednn"] = min(best.get("onednn", 1e9), time.perf_counter() - t0)
    flops = 2 * rows * sum(k * n for k, n in SHAPES) * 30
    print(f"rows {rows:3d}: " + "  ".join(f"{n}: {t*1e3:7.2f} ms {flops/t/1e9:6.1f} GF/s" for n, t in best.items()), flush=True)
