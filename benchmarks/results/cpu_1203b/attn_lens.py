"""python attn_lens.py LENS QLEN [REPS]: paged_attention for sequences of context LENS (comma-separated) with
QLEN query tokens each, the bundled model's shape (9 query heads, 3 KV heads, head_dim 64, 16-token blocks),
30 layers' pools in DRAM; best of REPS wall times and the output's checksum."""
import sys
import time

import torch

from pagedllm.kernels.cpu_kernels import load_cpu_kernels

lens = [int(x) for x in sys.argv[1].split(",")]
QLEN = int(sys.argv[2])
REPS = int(sys.argv[3]) if len(sys.argv) > 3 else 7
k = load_cpu_kernels()
torch.manual_seed(0)
BS, HK, HQ, D, LAYERS = 16, 3, 9, 64, 30
NB = max(2048, len(lens) * ((max(lens) + BS - 1) // BS))
kc = [torch.randn(NB, BS, HK, D) for _ in range(LAYERS)]
vc = [torch.randn(NB, BS, HK, D) for _ in range(LAYERS)]
per = (max(lens) + BS - 1) // BS
tables = torch.randperm(NB)[: len(lens) * per].view(len(lens), per).to(torch.int32).contiguous()
seq_lens = torch.tensor(lens, dtype=torch.int32)
T = len(lens) * QLEN
q = torch.randn(T, HQ, D)
out = torch.empty_like(q)
qsl = torch.arange(0, T + 1, QLEN, dtype=torch.int32)
best = 1e9
for _ in range(REPS):
    t = time.perf_counter()
    for layer in range(LAYERS):
        k.paged_attention(out, q, kc[layer], vc[layer], tables, seq_lens, qsl, 0.125, indices_checked=True)
    best = min(best, time.perf_counter() - t)
print(f"lens={sys.argv[1][:40]} qlen={QLEN}: {best * 1e3:.2f} ms (30 layers) sum={out.double().sum().item():.6f}")
