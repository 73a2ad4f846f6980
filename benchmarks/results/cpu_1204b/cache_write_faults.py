import time, torch, numpy as np
from pagedllm.kernels.cpu_kernels import load_cpu_kernels
k = load_cpu_kernels()
rms, rope, cache, attn, silu = k.c_functions()
NB, BS, HK, D, L = 7829, 16, 3, 64, 30
def z(): return torch.from_numpy(np.zeros(NB*BS*HK*D*4, dtype=np.uint8)).view(torch.float32).view(NB, BS, HK, D)
pools = [(z(), z()) for _ in range(L)]
seqs = 64
blocks = torch.randperm(NB)[:seqs*20].view(seqs, 20)
qkv = torch.randn(seqs, 9*64 + 2*192)
qkv_w = 9*64 + 2*192
tot = 0; n = 0
for step in range(128):
    pos = 136 + step
    slots = (blocks[:, pos // 16] * 16 + pos % 16).to(torch.int64).contiguous()
    t0 = time.perf_counter()
    for kc, vc in pools:
        p = qkv.data_ptr()
        cache(p + 4*576, p + 4*(576+192), qkv_w, kc.data_ptr(), vc.data_ptr(), slots.data_ptr(), seqs, 192)
    dt = time.perf_counter() - t0
    if step >= 8: tot += dt; n += 1
    if step in (0, 1, 2, 16, 64, 127): print(step, f"{dt*1e3:.2f} ms")
print(f"mean {tot/n*1e3:.2f} ms per step (30 layers)")
