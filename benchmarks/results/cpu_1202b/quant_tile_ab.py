"""A/B of quant_ops.c builds (§55.4): "before" is the source of 0d30506 saved to /tmp/q/quant_ops_before.c, "after" the
working tree (a tried variant). The bundled model's quantized linears in sequence, best of 7, same inputs; prints
ms per pass and whether the bits agree. Usage: python quant_tile_ab.py ROWS[,ROWS...] [avx2|LEVEL]"""
import ctypes, time, sys
from pathlib import Path
import torch
from pagedllm import LLM
from pagedllm.kernels import cpu_isa, cpu_quant
from pagedllm.kernels.cpu_kernels import build_library
isa = cpu_isa.detect_cpu_isa()
level = sys.argv[2] if len(sys.argv) > 2 else "avx2"
extra = () if level == "avx2" else cpu_quant.vnni_flags(isa)
builds = {"before": build_library(Path("/tmp/q/quant_ops_before.c"), level, extra),
          "after": build_library(cpu_quant.SOURCE, level, extra)}
kerns = {n: cpu_quant.QuantKernels(ctypes.CDLL(str(p)), p) for n, p in builds.items()}
llm = LLM(max_num_seqs=4, num_gpu_blocks_override=64)
model = llm.llm_engine.executor.driver_worker.model
weights = [m.gguf_weight for m in model.modules() if getattr(m, "gguf_weight", None) is not None]
print(level, sorted({w.type_name for w in weights}))
for bs in [int(x) for x in sys.argv[1].split(",")]:
    xs = {w.in_features: torch.randn(bs, w.in_features) for w in weights}
    best = {n: 1e9 for n in kerns}; outs = {}
    for _ in range(7):
        for n, k in kerns.items():
            t0 = time.perf_counter()
            outs[n] = [k.linear(xs[w.in_features], w, "int8") for w in weights]
            best[n] = min(best[n], time.perf_counter() - t0)
    same = all(torch.equal(a, b) for a, b in zip(outs["before"], outs["after"]))
    flops = sum(2 * bs * w.out_features * w.in_features for w in weights)
    print(f"rows {bs:3d}: " + "  ".join(f"{n} {1e3*t:7.2f} ms ({flops/t/1e9:5.1f} GFLOP/s)" for n, t in best.items())
          + f"  after/before speed {best['before']/best['after']:.2f}x  same bits {same}", flush=True)
