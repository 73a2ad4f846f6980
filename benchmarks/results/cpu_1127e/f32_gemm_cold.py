"""python f32_gemm_cold.py M,M,... [ISA level] [extra cc flags]: f32_gemm.c vs oneDNN packed vs F.linear over the bundled model's 121 GEMMs in sequence (cold weights), float32."""
import ctypes, sys, time, torch
from pagedllm.kernels import cpu_linear, cpu_isa
from pagedllm.kernels.cpu_kernels import build_library
from pathlib import Path
torch.set_num_threads(2)
level = sys.argv[2] if len(sys.argv) > 2 else cpu_isa.detect_cpu_isa().name
lib = ctypes.CDLL(str(build_library(Path("pagedllm/kernels/cpu/f32_gemm.c"), level, ("-ffp-contract=fast",) + tuple(sys.argv[3:]))))
P = ctypes.c_void_p; I = ctypes.c_int64
lib.f32_gemm.argtypes = [P, I, I, I, P, I, P, P, I]
lib.f32_gemm_pack.argtypes = [P, I, I, I, P]
NB = lib.f32_gemm_panel_width()
print(level, "NB", NB, "MR", lib.f32_gemm_tile_rows())
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
ws = [torch.randn(n, k) * 0.05 for n, k in shapes]
onednn = [cpu_linear.pack_linear_weight(w) for w in ws]
packed = []
for w in ws:
    n, k = w.shape
    p = torch.empty(-(-n // NB) * NB * k)
    lib.f32_gemm_pack(w.data_ptr(), k, n, k, p.data_ptr()); packed.append(p)
def native(x, i):
    n, k = ws[i].shape
    y = torch.empty(x.shape[0], n)
    lib.f32_gemm(x.data_ptr(), k, x.shape[0], k, packed[i].data_ptr(), n, None, y.data_ptr(), n)
    return y
def run(kind, M):
    xs = {k: torch.randn(M, k) for k in (576, 1536)}
    t = time.perf_counter()
    for i, w in enumerate(ws):
        x = xs[w.shape[1]]
        if kind == "onednn": cpu_linear.packed_linear(x, onednn[i], None)
        elif kind == "native": native(x, i)
        else: torch.nn.functional.linear(x, w)
    return time.perf_counter() - t
for M in [int(a) for a in sys.argv[1].split(",")]:
    x = torch.randn(M, 576)
    err = max(((native(x, i) - x @ ws[i].t()).abs().max() / (x @ ws[i].t()).abs().max()).item() for i in (0, 2))
    best = {k: 1e9 for k in ("onednn", "native", "F.linear")}
    for _ in range(4):
        for k in best: best[k] = min(best[k], run(k, M))
    fl = 2 * M * sum(n * k for n, k in shapes)
    print(f"M={M}: " + ", ".join(f"{k} {1e3*v:.1f} ms ({fl/v/1e9:.0f} GF/s)" for k, v in best.items()) + f"; rel err {err:.1e}", flush=True)
