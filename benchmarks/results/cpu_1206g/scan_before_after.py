"""BENCHMARKS §82.2: ssd_varlen_scan before (dfe1af5's parent) and after, on the CPU, 64 sequences of 16-200 tokens.
Needs the old function beside it: git show b50c4ef:pagedllm/model/layers/mamba2.py, its _segsum and ssd_varlen_scan cut
into scratch_old_scan.py at the repository root (with numpy, torch, math and async_tensor_h2d imported)."""
import sys, time, torch, random
sys.path.insert(0, "/work/main")
from scratch_old_scan import ssd_varlen_scan as old
from pagedllm.model.layers.mamba2 import ssd_varlen_scan as new
torch.manual_seed(0); random.seed(0)
H, P, N, G = 24, 64, 64, 1
lens = [random.randint(16, 200) for _ in range(64)]
T = sum(lens)
x = torch.randn(T, H, P); dt = torch.rand(T, H) * 0.1; a = -torch.rand(H) * 4
b = torch.randn(T, G, N); c = torch.randn(T, G, N)
bh = b[:, :, None].expand(-1, -1, H // G, -1).reshape(T, H, N); ch = c[:, :, None].expand(-1, -1, H // G, -1).reshape(T, H, N)
s0 = torch.randn(len(lens), H, P, N)
for L in (32, 128):
    for name, f, args in (("old", old, (bh, ch)), ("new", new, (b, c))):
        ts = []
        for i in range(3):
            t = time.perf_counter(); f(x, dt, a, *args, s0, lens, L); ts.append(time.perf_counter() - t)
        print(f"T={T} 64 seqs L={L} {name}: {min(ts)*1e3:.1f} ms")
