import ctypes, sys, time, torch
from pagedllm.kernels.cpu_kernels import build_library
from pagedllm.kernels import cpu_isa
from pathlib import Path
torch.set_num_threads(int(sys.argv[1]))
lib = ctypes.CDLL(str(build_library(Path("pagedllm/kernels/cpu/f32_gemm.c"), cpu_isa.detect_cpu_isa().name, ("-ffp-contract=fast",))))
P = ctypes.c_void_p; I = ctypes.c_int64
lib.f32_gemm.argtypes = [P, I, I, I, P, I, P, P, I]; lib.f32_gemm_pack.argtypes = [P, I, I, I, P]
NB = lib.f32_gemm_panel_width()
for (n, k) in [(576, 1536), (3072, 576), (49152, 576)]:
    w = torch.randn(n, k); p = torch.empty(-(-n // NB) * NB * k); lib.f32_gemm_pack(w.data_ptr(), k, n, k, p.data_ptr())
    for M in (1, 4, 12, 64):
        x = torch.randn(M, k); y = torch.empty(M, n)
        reps = 200 if n < 10000 else 10
        for _ in range(3): lib.f32_gemm(x.data_ptr(), k, M, k, p.data_ptr(), n, None, y.data_ptr(), n)
        t = time.perf_counter()
        for _ in range(reps): lib.f32_gemm(x.data_ptr(), k, M, k, p.data_ptr(), n, None, y.data_ptr(), n)
        dt = (time.perf_counter() - t) / reps
        print(f"n={n} k={k} M={M}: {dt*1e6:.1f} us  {2*M*n*k/dt/1e9:.0f} GF/s  {n*k*4/dt/1e9:.1f} GB/s weights", flush=True)
