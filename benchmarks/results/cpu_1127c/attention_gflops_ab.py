"""Single-thread A/B of the attention kernel: HEAD vs working tree, per case GFLOP/s."""
import sys, time, subprocess, tempfile, os
from pathlib import Path
import torch
sys.path.insert(0, "benchmarks")
import cpu_attention_ab as ab
from pagedllm.kernels.cpu_kernels import SOURCE
from pagedllm.benchmarks.cpu_flops import measure_fma_peak
torch.set_num_threads(int(os.environ.get("T", "1")))
rev = os.environ.get("REV", "HEAD")
text = subprocess.run(["git", "show", f"{rev}:pagedllm/kernels/cpu/cpu_ops.c"], check=True, capture_output=True, text=True).stdout
tmp = tempfile.mkdtemp(); base = Path(tmp) / "cpu_ops.c"; base.write_text(text)
builds = {"base": ab.load(base), "new": ab.load(SOURCE)}
print("peak GFLOP/s", measure_fma_peak() / 1e9)
cases = [(16, 300, 1, 8), (4, 500, 5, 8), (16, 160, 64, 2), (1, 459, 459, 2), (1, 1000, 1000, 1)]
for seqs, ctx, qlen, layers in cases:
    caches, tables, qsl, lens, q = ab.case_inputs(seqs, ctx, qlen, layers)
    flops = 0
    for s in range(seqs):
        for i in range(qlen):
            flops += (ctx - qlen + i + 1) * ab.HQ * ab.D * 4 * layers
    res = {}
    for r in range(int(os.environ.get("R", "6"))):
        for name, k in builds.items():
            out = torch.empty_like(q)
            t = time.perf_counter()
            for kc, vc in caches:
                k.paged_attention(out, q, kc, vc, tables, lens, qsl, ab.D**-0.5, indices_checked=True)
            res[name] = min(res.get(name, 9e9), time.perf_counter() - t)
    print(f"{seqs}x{ctx}x{qlen}: " + "  ".join(f"{n} {t*1e3:.2f} ms {flops/t/1e9:.1f} GF/s" for n, t in res.items()) + f"  ratio {res['base']/res['new']:.2f}")
