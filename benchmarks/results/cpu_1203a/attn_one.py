"""python attn_one.py S L QLEN [REPS] [hot]: time paged_attention for S seqs at ctx L with QLEN query tokens (30 layers)."""
import sys, time, torch
from pagedllm.kernels.cpu_kernels import load_cpu_kernels
S, L, QLEN = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
REPS = int(sys.argv[4]) if len(sys.argv) > 4 else 7
HOT = len(sys.argv) > 5
k = load_cpu_kernels()
torch.manual_seed(0)
NB, BS, HK, HQ, D, LAYERS = 2048, 16, 3, 9, 64, 30
kc = [torch.randn(NB, BS, HK, D) for _ in range(1 if HOT else LAYERS)]
vc = [torch.randn(NB, BS, HK, D) for _ in range(1 if HOT else LAYERS)]
nblk = (L + BS - 1) // BS
perm = torch.randperm(NB)[: S * nblk].view(S, nblk).to(torch.int32).contiguous()
seq_lens = torch.full((S,), L, dtype=torch.int32)
T = S * QLEN
q = torch.randn(T, HQ, D); out = torch.empty_like(q)
qsl = torch.arange(0, T + 1, QLEN, dtype=torch.int32)
best = 1e9; bestc = 1e9
for _ in range(REPS):
    t = time.perf_counter(); c = time.process_time()
    for l in range(LAYERS):
        k.paged_attention(out, q, kc[0 if HOT else l], vc[0 if HOT else l], perm, seq_lens, qsl, 0.125, indices_checked=True)
    best = min(best, time.perf_counter() - t); bestc = min(bestc, time.process_time() - c)
print(f"S={S} L={L} qlen={QLEN} {'hot' if HOT else 'dram'}: {best*1e3:.2f} ms cpu {bestc*1e3:.2f} ms (30 layers) sum={out.double().sum().item():.6f}")
