"""In-engine prefill forwards (bundled model, the default GGUF direct forward, 2 threads): the attention kernel of
73f46f9 and of the working tree swapped in turn in one process; forward, linears and attention ms per step."""
import ctypes, subprocess, sys, tempfile, time
from pathlib import Path
import torch
from pagedllm import LLM
from pagedllm.kernels import cpu_isa
from pagedllm.kernels.cpu_kernels import build_library
from pagedllm.worker.model_input import SequenceChunk

llm = LLM(max_model_len=1024, num_gpu_blocks_override=1024)
w = llm.llm_engine.executor.driver_worker
runner, kv = w.model_runner, w.cache_engine.gpu_cache
df = runner.direct_forward
src = Path(tempfile.mkdtemp()) / "cpu_ops.c"
src.write_text(subprocess.run(["git", "show", "73f46f9:pagedllm/kernels/cpu/cpu_ops.c"], check=True,
                              capture_output=True, text=True).stdout)
old = ctypes.CDLL(str(build_library(src, cpu_isa.detect_cpu_isa().name))).paged_attention_f32
old.restype, old.argtypes = ctypes.c_int, df._attention.argtypes[:-1]
new = df._attention
timers = {"lin": 0.0, "att": 0.0}
L0 = df._linear
def lin(*a):
    t = time.perf_counter(); r = L0(*a); timers["lin"] += time.perf_counter() - t; return r
def timed(fn):
    def att(*a):
        t = time.perf_counter(); r = fn(*a); timers["att"] += time.perf_counter() - t; return r
    return att
variants = {"73f46f9": timed(lambda *a: old(*a[:-1])), "tree": timed(new)}
df._linear = lin
cases = {"1 x 459": [(459, 1)], "4 x 256": [(256, 4)], "16 x 64": [(64, 16)]}
for name, spec in cases.items():
    chunks = []
    for n, count in spec:
        for s in range(count):
            chunks.append(SequenceChunk(s, [100 + (i * 37 + s) % 20000 for i in range(n)], 0,
                                        list(range(s * 48, s * 48 + 48)), sample=True))
    ids, pos, meta, li = runner.prepare_inputs(chunks)
    best = {}
    for r in range(6):
        for v, fn in variants.items():
            df._attention = fn
            df(ids, pos, kv, meta)
            timers["lin"] = timers["att"] = 0.0
            t = time.perf_counter(); df(ids, pos, kv, meta); tot = time.perf_counter() - t
            cur = (tot, timers["lin"], timers["att"])
            if v not in best or cur[0] < best[v][0]:
                best[v] = cur
    print(f"prefill {name}: " + "   ".join(f"{v}: forward {1e3*t:.1f} ms (linears {1e3*l:.1f}, attention {1e3*a:.1f})"
                                          for v, (t, l, a) in best.items())
          + f"   forward ratio {best['73f46f9'][0] / best['tree'][0]:.2f}x", flush=True)
