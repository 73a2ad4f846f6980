"""f32_gemm.c at a git revision against the working tree's (each optionally with -D flags), the bundled model's 121
float32 GEMMs in sequence with cold weights (as a decode step runs them), 2 threads, alternating rounds; ms per pass
(best of the rounds) and whether both builds gave bit-identical outputs.

    PYTHONPATH=. python benchmarks/results/cpu_1127h/f32_gemm_ab.py --base-rev HEAD --rows 1,8,16,64,128,256
"""
import argparse, ctypes, subprocess, tempfile, time
from pathlib import Path
import torch
from pagedllm.kernels import cpu_isa
from pagedllm.kernels.cpu_f32_gemm import SOURCE
from pagedllm.kernels.cpu_kernels import build_library

p = argparse.ArgumentParser(); p.add_argument("--base-rev", default="HEAD"); p.add_argument("--rounds", type=int, default=5)
p.add_argument("--rows", default="1,8,16,64,128,256"); p.add_argument("--new-flags", default="")
args = p.parse_args()
torch.set_num_threads(2)
level = cpu_isa.detect_cpu_isa().name
text = subprocess.run(["git", "show", f"{args.base_rev}:pagedllm/kernels/cpu/f32_gemm.c"], check=True, capture_output=True, text=True).stdout
P, I = ctypes.c_void_p, ctypes.c_int64
def load(path):
    lib = ctypes.CDLL(str(path)); lib.f32_gemm.argtypes = [P, I, I, I, P, I, P, P, I]; lib.f32_gemm_pack.argtypes = [P, I, I, I, P]
    return lib
with tempfile.TemporaryDirectory() as tmp:
    base = Path(tmp) / "f32_gemm.c"; base.write_text(text)
    libs = {args.base_rev: load(build_library(base, level, ("-ffp-contract=fast",))),
            "working tree": load(build_library(SOURCE, level, ("-ffp-contract=fast",) + tuple(args.new_flags.split())))}
NB = next(iter(libs.values())).f32_gemm_panel_width()
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
g = torch.Generator().manual_seed(0)
ws = [torch.randn(n, k, generator=g) * 0.05 for n, k in shapes]
packed = []
for w in ws:
    n, k = w.shape; pk = torch.empty(-(-n // NB) * NB * k)
    next(iter(libs.values())).f32_gemm_pack(w.data_ptr(), k, n, k, pk.data_ptr()); packed.append(pk)
flush = torch.empty(64 << 20)  # 256 MB written between passes: the weights come from memory, as in a step
print(f"{level}, {len(ws)} GEMMs, {sum(w.numel() for w in ws) * 4 / 1e6:.0f} MB of weights; new flags: {args.new_flags or '-'}")
for M in [int(r) for r in args.rows.split(",")]:
    xs = {k: torch.randn(M, k, generator=g) for k in (576, 1536)}
    best = {n: 1e9 for n in libs}; outs = {}
    for _ in range(args.rounds):
        for name, lib in libs.items():
            flush.fill_(1.0)
            ys = [torch.empty(M, w.shape[0]) for w in ws]
            t0 = time.perf_counter()
            for w, pk, y in zip(ws, packed, ys):
                n, k = w.shape
                lib.f32_gemm(xs[k].data_ptr(), k, M, k, pk.data_ptr(), n, None, y.data_ptr(), n)
            best[name] = min(best[name], time.perf_counter() - t0); outs[name] = ys
    same = all(torch.equal(a, b) for a, b in zip(*outs.values()))
    flops = sum(2 * M * w.numel() for w in ws)
    a, b = best.values()
    print(f"rows {M:4d}: " + "  ".join(f"{n} {1e3 * t:8.2f} ms ({flops / t / 1e9:5.1f} GFLOP/s)" for n, t in best.items())
          + f"  ratio {a / b:.2f}x  same bits {same}", flush=True)
