import time, torch
from pagedllm import LLM
from pagedllm.worker.model_input import SequenceChunk
llm = LLM(max_model_len=1024, num_gpu_blocks_override=1024)
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
ctx = 600; bs = 16
def chunks(extra):  # 4 sequences at ~ctx, sequence 0 verifying `extra` drafts
    out = []
    for s in range(4):
        n = 1 + (extra if s == 0 else 0)
        table = list(range(s * 48, s * 48 + 48))
        out.append(SequenceChunk(s, [100] * n, ctx, table, sample=True, all_logits=n > 1))
    return out
for extra in (0, 4, 8, 16):
    c = chunks(extra)
    ids, pos, meta, li = runner.prepare_inputs(c)
    for _ in range(3): df(ids, pos, kv, meta)
    lin_t[0] = att_t[0] = 0.0; n = 20
    t = time.perf_counter()
    for _ in range(n): h = df(ids, pos, kv, meta)
    tot = (time.perf_counter() - t) / n
    lm = time.perf_counter()
    for _ in range(n): runner.model.compute_logits(h[li])
    lm = (time.perf_counter() - lm) / n
    print(f"rows {4+extra:3d}: forward {1e3*tot:.2f} ms (linears {1e3*lin_t[0]/n:.2f}, attention {1e3*att_t[0]/n:.2f}, rest {1e3*(tot-(lin_t[0]+att_t[0])/n):.2f}); lm_head {1e3*lm:.2f} ms for {li.numel()} rows")
# prefill: 4 prompts of 600 tokens from scratch
c = [SequenceChunk(s, [100] * 600, 0, list(range(s * 48, s * 48 + 48)), sample=True) for s in range(4)]
ids, pos, meta, li = runner.prepare_inputs(c)
df(ids, pos, kv, meta)
lin_t[0] = att_t[0] = 0.0; n = 3
t = time.perf_counter()
for _ in range(n): h = df(ids, pos, kv, meta)
tot = (time.perf_counter() - t) / n
print(f"prefill 4x600: forward {1e3*tot:.1f} ms (linears {1e3*lin_t[0]/n:.1f}, attention {1e3*att_t[0]/n:.1f})")
