"""A/B of decode attention variants (-D flags) on 30 layers x S seqs x ctx, pools pre-touched, random tables."""
import ctypes, sys, time, torch, os
from pagedllm.kernels import cpu_isa
from pagedllm.kernels.cpu_kernels import SOURCE, CpuKernels, build_library
BLOCK, HQ, HK, D, L = 16, 9, 3, 64, 30
variants = [tuple(v.split()) if v != "base" else () for v in sys.argv[1].split(",")]
seqs, ctx = int(sys.argv[2]), int(sys.argv[3])
isa = os.environ.get("ISA") or cpu_isa.detect_cpu_isa().name
def mk(f):
    i = isa
    if f and f[0].startswith("isa="): i, f = f[0][4:], f[1:]
    return CpuKernels(ctypes.CDLL(str(build_library(SOURCE, i, f))), SOURCE, i)
libs = [mk(f) for f in variants]
g = torch.Generator().manual_seed(0)
per = -(-ctx // BLOCK); nb = 7867
import numpy as np, os
def pool():
    t = torch.from_numpy(np.zeros(nb * BLOCK * HK * D, np.float32)).view(nb, BLOCK, HK, D) if os.environ.get("HUGE") else torch.empty(nb, BLOCK, HK, D)
    t.normal_(generator=g); return t
caches = [(pool(), pool()) for _ in range(L)]
tables = torch.randperm(nb, generator=g)[: seqs * per].to(torch.int32).view(seqs, per).contiguous()
QL = int(os.environ.get("QLEN", "1")); qsl = torch.arange(0, seqs * QL + 1, QL, dtype=torch.int32)
lens = torch.randint(ctx // 2, ctx + 1, (seqs,), generator=g, dtype=torch.int32)
q = torch.randn(seqs * QL, HQ, D, generator=g)
gb = int(lens.sum()) * L * 2 * HK * D * 4 / 1e9
res = {i: [] for i in range(len(libs))}
for rep in range(int(sys.argv[4]) if len(sys.argv) > 4 else 7):
    for i, k in enumerate(libs):
        out = torch.empty_like(q)
        t0 = time.perf_counter()
        for kc, vc in caches: k.paged_attention(out, q, kc, vc, tables, lens, qsl, D**-0.5, indices_checked=True)
        res[i].append(time.perf_counter() - t0)
for i, v in enumerate(variants):
    ts = sorted(res[i]); print(f"{' '.join(v) or 'base':40s} best {ts[0]*1e3:7.2f} ms  median {ts[len(ts)//2]*1e3:7.2f} ms  {gb/ts[0]:5.1f} GB/s ({gb*1e3:.0f} MB)")
