"""Where a 64-sequence float32 decode step goes (issue 18's workload shape): linears, attention, rest, LM head."""
import sys, time
from pagedllm import LLM
from pagedllm.worker.model_input import SequenceChunk
kv_dtype = sys.argv[1] if len(sys.argv) > 1 else "auto"
llm = LLM(quantization="none", max_model_len=1024, num_gpu_blocks_override=2048, kv_cache_dtype=kv_dtype)
w = llm.llm_engine.executor.driver_worker
runner, kv = w.model_runner, w.kv_caches if hasattr(w, "kv_caches") else w.cache_engine.gpu_cache
df = runner.direct_forward
lin_t = [0.0]; att_t = [0.0]
L0, A0 = df._linear, df._attention
def lin(*a):
    t = time.perf_counter(); r = L0(*a); lin_t[0] += time.perf_counter() - t; return r
def att(*a):
    t = time.perf_counter(); r = A0(*a); att_t[0] += time.perf_counter() - t; return r
df._linear, df._attention = lin, att
for ctx in (100, 210, 300):
    nb = (ctx + 16) // 16 + 1
    c = [SequenceChunk(s, [100], ctx, list(range(s * nb, s * nb + nb)), sample=True) for s in range(64)]
    ids, pos, meta, li = runner.prepare_inputs(c)
    for _ in range(2): df(ids, pos, kv, meta)
    best = None
    for _ in range(5):
        lin_t[0] = att_t[0] = 0.0
        t = time.perf_counter(); h = df(ids, pos, kv, meta); tot = time.perf_counter() - t
        t = time.perf_counter(); runner.model.compute_logits(h[li]); lm = time.perf_counter() - t
        r = (tot, lin_t[0], att_t[0], lm)
        if best is None or r[0] < best[0]: best = r
    tot, l, a, lm = best
    print(f"ctx {ctx}: forward {1e3*tot:.1f} ms (linears {1e3*l:.1f}, attention {1e3*a:.1f}, rest {1e3*(tot-l-a):.1f}); lm_head {1e3*lm:.1f} ms", flush=True)
