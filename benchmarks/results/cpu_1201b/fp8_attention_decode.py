"""Decode attention of the bundled model's shape (9 query / 3 KV heads of 64, block 16) over float32, bf16 and
fp8 pools: 64 sequences × 300 tokens of context, 30 layers with a pool each (they do not fit the CPU's caches,
as in a real step); ms per 30 layers, best of the rounds, alternating.

    PYTHONPATH=. python benchmarks/results/cpu_1201b/fp8_attention_decode.py
"""
import time
import torch
from pagedllm.kernels import cpu_kernels, kv_quant

K = cpu_kernels.load_cpu_kernels()
S, CTX, L, BS, HQ, HK, D = 64, 300, 30, 16, 9, 3, 64
g = torch.Generator().manual_seed(0)
nb = S * (-(-CTX // BS))
tables = torch.randperm(nb, generator=g).view(S, -1).to(torch.int32)
lens = torch.full((S,), CTX, dtype=torch.int32)
qsl = torch.arange(S + 1, dtype=torch.int32)
q = torch.randn(S, HQ, D, generator=g)
base = [(torch.randn(nb, BS, HK, D, generator=g), torch.randn(nb, BS, HK, D, generator=g)) for _ in range(L)]
pools = {"float32": base, "bfloat16": [(k.bfloat16(), v.bfloat16()) for k, v in base],
         "fp8_e4m3": [(kv_quant.quantize(k, torch.float8_e4m3fn), kv_quant.quantize(v, torch.float8_e4m3fn)) for k, v in base],
         "fp8_e5m2": [(kv_quant.quantize(k, torch.float8_e5m2), kv_quant.quantize(v, torch.float8_e5m2)) for k, v in base]}
out = torch.empty_like(q)
best = {n: 1e9 for n in pools}
for _ in range(7):
    for name, layers in pools.items():
        t0 = time.perf_counter()
        for k, v in layers:
            K.paged_attention(out, q, k, v, tables, lens, qsl, D ** -0.5, indices_checked=True)
        best[name] = min(best[name], time.perf_counter() - t0)
for name, t in best.items():
    kv_bytes = S * CTX * L * 2 * HK * D * pools[name][0][0].element_size()
    print(f"{name:9s} {1e3 * t:7.2f} ms per 30 layers, {kv_bytes / t / 1e9:5.1f} GB/s of KV, {best['float32'] / t:.2f}x float32")
