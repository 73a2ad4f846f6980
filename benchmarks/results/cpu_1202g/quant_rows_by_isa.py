import ctypes, time, sys
import torch
from pagedllm import LLM
from pagedllm.kernels import cpu_isa, cpu_quant
from pagedllm.kernels.cpu_kernels import build_library
isa = cpu_isa.detect_cpu_isa()
builds = {"avx2": build_library(cpu_quant.SOURCE, "avx2", ()),
          "native": build_library(cpu_quant.SOURCE, isa.name, cpu_quant.vnni_flags(isa))}
kerns = {n: cpu_quant.QuantKernels(ctypes.CDLL(str(p)), p) for n, p in builds.items()}
llm = LLM(max_num_seqs=4, num_gpu_blocks_override=64)
model = llm.llm_engine.executor.driver_worker.model
weights = [m.gguf_weight for m in model.modules() if getattr(m, "gguf_weight", None) is not None]
for bs in [int(x) for x in sys.argv[1].split(",")]:
    xs = {w.in_features: torch.randn(bs, w.in_features) for w in weights}
    best = {n: 1e9 for n in kerns}
    for _ in range(7):
        for n, k in kerns.items():
            t0 = time.perf_counter()
            for w in weights:
                k.linear(xs[w.in_features], w, "int8")
            best[n] = min(best[n], time.perf_counter() - t0)
    flops = sum(2 * bs * w.out_features * w.in_features for w in weights)
    print(f"rows {bs:3d}: " + "  ".join(f"{n} {1e3*t:7.2f} ms ({flops/t/1e9:5.1f} GFLOP/s)" for n, t in best.items()), flush=True)
