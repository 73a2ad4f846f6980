"""torch.profiler of a 64-sequence float32 decode step on the module path (issue 18's workload shape)."""
import sys, time
from torch.profiler import profile, ProfilerActivity
from pagedllm import LLM
from pagedllm.worker.model_input import SequenceChunk
ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 210
kv_dtype = sys.argv[2] if len(sys.argv) > 2 else "auto"
llm = LLM(quantization="none", max_model_len=1024, num_gpu_blocks_override=2048, kv_cache_dtype=kv_dtype)
w = llm.llm_engine.executor.driver_worker
runner, kv = w.model_runner, w.cache_engine.gpu_cache
nb = (ctx + 16) // 16 + 1
c = [SequenceChunk(s, [100], ctx, list(range(s * nb, s * nb + nb)), sample=True) for s in range(64)]
def step():
    ids, pos, meta, li = runner.prepare_inputs(c)
    h = runner.model(ids, pos, kv, meta)
    return runner.model.compute_logits(h[li])
for _ in range(3): step()
ts = []
for _ in range(5):
    t = time.perf_counter(); step(); ts.append(time.perf_counter() - t)
print(f"ctx {ctx} kv {kv_dtype}: step {1e3*min(ts):.1f} ms (best of 5), median {1e3*sorted(ts)[2]:.1f}")
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(3): step()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
