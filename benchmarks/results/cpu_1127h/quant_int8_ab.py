"""The int8 GEMM of quant_ops.c at a git revision against the working tree's, same inputs, alternating rounds: the
bundled model's quantized linears in sequence (every layer's own weights, as a decode step runs them), 2 threads.
Prints ms per pass (best of the rounds) per batch size, and whether both builds gave bit-identical outputs.

    PYTHONPATH=. python benchmarks/results/cpu_1127h/quant_int8_ab.py --base-rev HEAD
"""
import argparse, ctypes, subprocess, tempfile, time
from pathlib import Path
import torch
from pagedllm import LLM
from pagedllm.kernels import cpu_isa, cpu_quant
from pagedllm.kernels.cpu_kernels import build_library

p = argparse.ArgumentParser(); p.add_argument("--base-rev", default="HEAD"); p.add_argument("--rounds", type=int, default=7)
p.add_argument("--batch-sizes", default="1,4,16,64"); p.add_argument("--new-flags", default="")
args = p.parse_args()
isa = cpu_isa.detect_cpu_isa()
extra = cpu_quant.vnni_flags(isa)
text = subprocess.run(["git", "show", f"{args.base_rev}:pagedllm/kernels/cpu/quant_ops.c"], check=True, capture_output=True, text=True).stdout
with tempfile.TemporaryDirectory() as tmp:
    base = Path(tmp) / "quant_ops.c"; base.write_text(text)
    paths = {args.base_rev: build_library(base, isa.name, extra), "working tree": build_library(cpu_quant.SOURCE, isa.name, extra + tuple(args.new_flags.split()))}
builds = {n: cpu_quant.QuantKernels(ctypes.CDLL(str(pth)), pth) for n, pth in paths.items()}
llm = LLM(max_num_seqs=4, num_gpu_blocks_override=64)
model = llm.llm_engine.executor.driver_worker.model
weights = [m.gguf_weight for m in model.modules() if getattr(m, "gguf_weight", None) is not None]
print(f"{len(weights)} quantized linears ({', '.join(sorted({w.type_name for w in weights}))}); builds: "
      + ", ".join(f"{n} ({k.isa})" for n, k in builds.items()))
for bs in [int(b) for b in args.batch_sizes.split(",")]:
    xs = {w.in_features: torch.randn(bs, w.in_features) for w in weights}
    best = {n: 1e9 for n in builds}; outs = {}
    for _ in range(args.rounds):
        for name, kern in builds.items():
            t0 = time.perf_counter()
            ys = [kern.linear(xs[w.in_features], w, "int8") for w in weights]
            best[name] = min(best[name], time.perf_counter() - t0)
            outs[name] = ys
    same = all(torch.equal(a, b) for a, b in zip(*outs.values()))
    flops = sum(2 * bs * w.out_features * w.in_features for w in weights)
    a, b = best.values()
    print(f"batch {bs:3d}: " + "  ".join(f"{n} {1e3 * t:7.2f} ms ({flops / t / 1e9:5.1f} GFLOP/s)" for n, t in best.items())
          + f"  ratio {a / b:.2f}x  same bits {same}", flush=True)
