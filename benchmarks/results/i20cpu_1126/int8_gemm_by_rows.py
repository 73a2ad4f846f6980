"""Time quant_linear (int8 design) of the bundled model's linears per M, for variant builds of quant_ops.c."""
import ctypes, sys, time, torch
from pathlib import Path
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.kernels import cpu_quant, cpu_isa
from pagedllm.kernels.cpu_kernels import build_library
e = LLMEngine(EngineArgs(device="cpu", max_model_len=512, num_gpu_blocks_override=64))
model = e.executor.driver_worker.model_runner.model
ws = [m.gguf_weight for m in model.modules() if getattr(m, "gguf_weight", None) is not None]
isa = cpu_isa.detect_cpu_isa()
libs = []
for src in sys.argv[1:]:
    p = build_library(Path(src), isa.name, cpu_quant.vnni_flags(isa))
    libs.append((src, cpu_quant.QuantKernels(ctypes.CDLL(str(p)), p)))
Ms = (1, 4, 8, 16, 20)
xs = {(M, k): torch.randn(M, k) for M in Ms for k in (576, 1536)}
ref = {}
for M in Ms:
    row = []
    for name, qk in libs:
        best = 1e9
        for rep in range(7):
            t = time.perf_counter()
            for w in ws:
                y = qk.linear(xs[(M, w.in_features)], w, "int8")
            best = min(best, time.perf_counter() - t)
        if M not in ref: ref[M] = y
        same = torch.equal(ref[M], y)
        row.append(f"{Path(name).stem} {1e3*best:.2f} ms{'' if same else ' (DIFFERENT BITS)'}")
    print(f"M={M}: " + " | ".join(row), flush=True)
