"""The int8 GGUF GEMM (quant_ops.c) of two ISA builds in one process, calls alternated, median of N passes:
    python quant_isa_ab.py "avx512=/path/quant_ops-avx512_bf16-*.so,avx2=/path/quant_ops-avx2-*.so" QTYPE M,M,.. [N]
QTYPE 3 (Q4_1): the bundled model's 30 layers of 4 linears, distinct random weights; 8 (Q8_0): its tied lm_head."""
import ctypes, sys, time, statistics, torch
from pagedllm.kernels.cpu_quant import GGUFWeight, row_bytes
torch.manual_seed(0)
libs = {}
for spec in sys.argv[1].split(","):
    name, path = spec.split("=")
    lib = ctypes.CDLL(path); f = lib.quant_linear; f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    libs[name] = f
qtype = int(sys.argv[2]); MS = [int(a) for a in sys.argv[3].split(",")]
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] if qtype != 8 else [(49152, 576)]
nl = 30 if qtype != 8 else 1
ws = []
bb = {3: 20, 2: 18, 8: 34}[qtype]
for l in range(nl):
    for N, K in shapes:
        blocks = torch.randint(0, 256, (N, row_bytes(qtype, K)), dtype=torch.uint8)
        b = blocks.view(N, K // 32, bb); b[:, :, 0:2] = torch.tensor([0x00, 0x1c], dtype=torch.uint8)
        if qtype == 3: b[:, :, 2:4] = torch.tensor([0x00, 0x1c], dtype=torch.uint8)
        ws.append(GGUFWeight.from_gguf_blocks(blocks, qtype, N, K))
macs = sum(w.out_features * w.in_features for w in ws)
for M in MS:
    xs = {K: torch.randn(M, K) for K in (576, 1536)}
    ys = {w.out_features: torch.empty(M, w.out_features) for w in ws}
    times = {n: [] for n in libs}
    for rep in range(int(sys.argv[4]) if len(sys.argv) > 4 else 15):
        for n, f in libs.items():
            t = time.perf_counter()
            for w in ws:
                f(qtype, w.data_ptr, w.out_features, w.in_features, xs[w.in_features].data_ptr(), M, ys[w.out_features].data_ptr(), 0)
            times[n].append(time.perf_counter() - t)
    base = statistics.median(times[next(iter(libs))])
    print(f"M={M:3d} " + "  ".join(f"{n} {statistics.median(v)*1e3:7.2f} ms ({M*macs/statistics.median(v)/1e9:5.0f} GMAC/s, x{base/statistics.median(v):.2f})" for n, v in times.items()), flush=True)
