"""Decode (1 query token per sequence) vs verification (k+1 tokens) attention, the bundled model's shape, 30 layers'
pools (DRAM-resident), S sequences at context L: python attn_verify.py S L."""
import sys, time, torch
from pagedllm.kernels.cpu_kernels import load_cpu_kernels
S, L = int(sys.argv[1]), int(sys.argv[2])
HOT = len(sys.argv) > 3
k = load_cpu_kernels()
torch.manual_seed(0)
NB, BS, HK, HQ, D, LAYERS = 2048, 16, 3, 9, 64, 30
kc = [torch.randn(NB, BS, HK, D) for _ in range(LAYERS)]
vc = [torch.randn(NB, BS, HK, D) for _ in range(LAYERS)]
nblk = (L + BS - 1) // BS
perm = torch.randperm(NB)[: S * nblk].view(S, nblk).to(torch.int32).contiguous()
seq_lens = torch.full((S,), L, dtype=torch.int32)
def run(qlen):
    T = S * qlen
    q = torch.randn(T, HQ, D); out = torch.empty_like(q)
    qsl = torch.arange(0, T + 1, qlen, dtype=torch.int32)
    best = 1e9
    for _ in range(7):
        t = time.perf_counter()
        for l in range(LAYERS):
            k.paged_attention(out, q, kc[0 if HOT else l], vc[0 if HOT else l], perm, seq_lens, qsl, 0.125, indices_checked=True)
        best = min(best, time.perf_counter() - t)
    return best * 1e3
for qlen in (1, 2, 5, 9):
    print(f"S={S} L={L} qlen={qlen}: {run(qlen):.2f} ms (30 layers)")
