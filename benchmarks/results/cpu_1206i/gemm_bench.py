import time, torch
from pagedllm.kernels.cpu_f32_gemm import load_f32_gemm
from pagedllm.kernels.cpu_linear import pack_linear_weight, packed_linear
torch.set_num_threads(2)
g = load_f32_gemm().for_every_row_count()
shapes = [("qkv", 960, 576), ("o", 576, 576), ("up", 3072, 576), ("down", 576, 1536)]
for M in (64, 256, 1024, 2048):
    for name, n, k in shapes:
        w = torch.randn(n, k); x = torch.randn(M, k)
        pw = pack_linear_weight(w); panels = g.pack(w)
        fl = 2 * M * n * k
        res = {}
        for label, fn in (("onednn", lambda: packed_linear(x, pw, None)), ("mkl", lambda: torch.nn.functional.linear(x, w)),
                          ("native", lambda: g.linear(x, panels, n, None))):
            for _ in range(3): fn()
            reps = max(3, int(2e9 / fl))
            t = time.perf_counter()
            for _ in range(reps): fn()
            res[label] = fl * reps / (time.perf_counter() - t) / 1e9
        print(M, name, " ".join(f"{k} {v:.0f}" for k, v in res.items()), "GFLOP/s", flush=True)
