"""A 64-sequence float32 decode step on the module path, split into linears / attention / the rest (issue 18)."""
import sys, time
from pagedllm import LLM
from pagedllm.model.layers import linear as L
from pagedllm.worker.model_input import SequenceChunk
kv_dtype = sys.argv[1] if len(sys.argv) > 1 else "auto"
llm = LLM(quantization="none", max_model_len=1024, num_gpu_blocks_override=2048, kv_cache_dtype=kv_dtype)
w = llm.llm_engine.executor.driver_worker
runner, kv = w.model_runner, w.cache_engine.gpu_cache
acc = {"lin": 0.0, "lm": 0.0, "attn": 0.0, "prep": 0.0}
m0 = L.PackableGemm.matmul
def mm(self, x, b):
    t = time.perf_counter(); r = m0(self, x, b); dt = time.perf_counter() - t
    acc["lm" if self.weight.shape[0] > 10000 else "lin"] += dt; return r
L.PackableGemm.matmul = mm
backend = runner.attn_backend if hasattr(runner, "attn_backend") else None
Bk = type(w.attn_backend()) if False else None
import pagedllm.model.layers.attention as att
cls = att.NativeCpuAttentionBackend
f0 = cls.forward
def fw(self, *a, **k):
    t = time.perf_counter(); r = f0(self, *a, **k); acc["attn"] += time.perf_counter() - t; return r
cls.forward = fw
for ctx in (100, 210, 300):
    nb = (ctx + 16) // 16 + 1
    c = [SequenceChunk(s, [100], ctx, list(range(s * nb, s * nb + nb)), sample=True) for s in range(64)]
    def step():
        t0 = time.perf_counter()
        ids, pos, meta, li = runner.prepare_inputs(c)
        acc["prep"] = time.perf_counter() - t0
        h = runner.model(ids, pos, kv, meta)
        return runner.model.compute_logits(h[li])
    for _ in range(2): step()
    best = None
    for _ in range(6):
        for k in acc: acc[k] = 0.0
        t = time.perf_counter(); step(); tot = time.perf_counter() - t
        r = (tot, dict(acc))
        if best is None or r[0] < best[0]: best = r
    tot, a = best
    print(f"kv {kv_dtype} ctx {ctx}: step {1e3*tot:.1f} ms: linears {1e3*a['lin']:.1f}, lm_head {1e3*a['lm']:.1f}, attention {1e3*a['attn']:.1f}, prepare_inputs {1e3*a['prep']:.1f}, rest {1e3*(tot-sum(a.values())):.1f}", flush=True)
