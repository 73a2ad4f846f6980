"""The C cache write (reshape_and_cache) at decode: 64 tokens into random slots of a 30-layer float32 pool, HEAD's
cpu_ops.c against the working tree's, alternating rounds; microseconds per 30 layers (best of the rounds).

    PYTHONPATH=. python benchmarks/results/cpu_1127h/cache_write_ab.py --base-rev HEAD
"""
import argparse, ctypes, subprocess, tempfile, time
from pathlib import Path
import torch
from pagedllm.kernels import cpu_isa
from pagedllm.kernels.cpu_kernels import SOURCE, CpuKernels, build_library

p = argparse.ArgumentParser(); p.add_argument("--base-rev", default="HEAD"); p.add_argument("--rounds", type=int, default=30)
args = p.parse_args()
isa = cpu_isa.detect_cpu_isa().name
text = subprocess.run(["git", "show", f"{args.base_rev}:pagedllm/kernels/cpu/cpu_ops.c"], check=True, capture_output=True, text=True).stdout
with tempfile.TemporaryDirectory() as tmp:
    base = Path(tmp) / "cpu_ops.c"; base.write_text(text)
    builds = {args.base_rev: CpuKernels(ctypes.CDLL(str(build_library(base, isa))), base, isa),
              "working tree": CpuKernels(ctypes.CDLL(str(build_library(SOURCE, isa))), SOURCE, isa)}
BLOCKS, BS, HK, D, LAYERS = 4096, 16, 3, 64, 30
for tokens in (16, 64, 256):
    caches = [(torch.zeros(BLOCKS, BS, HK, D), torch.zeros(BLOCKS, BS, HK, D)) for _ in range(LAYERS)]
    qkv = torch.randn(tokens, (9 + 2 * HK) * D)
    k, v = qkv[:, 9 * D:(9 + HK) * D].view(tokens, HK, D), qkv[:, (9 + HK) * D:].view(tokens, HK, D)
    best = {n: 1e9 for n in builds}
    for r in range(args.rounds):
        slots = torch.randperm(BLOCKS * BS)[:tokens].to(torch.int64)
        for name, kern in builds.items():
            t0 = time.perf_counter()
            for kc, vc in caches: kern.reshape_and_cache(k, v, kc, vc, slots)
            best[name] = min(best[name], time.perf_counter() - t0)
    a, b = best.values()
    print(f"{tokens:4d} tokens: " + "  ".join(f"{n} {1e6 * t:8.1f} us" for n, t in best.items()) + f"  ratio {a / b:.2f}x", flush=True)
