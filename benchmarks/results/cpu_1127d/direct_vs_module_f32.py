"""float32 (--quantization none) decode/prefill forward: the direct forward against the module path, alternating
in one process (same engine, same inputs); checks the hidden states are bit-identical."""
import time, torch
from pagedllm import LLM
from pagedllm.worker.model_input import SequenceChunk
llm = LLM(quantization="none", max_model_len=1024, num_gpu_blocks_override=2048)
w = llm.llm_engine.executor.driver_worker
runner, kv = w.model_runner, w.cache_engine.gpu_cache
direct = runner.direct_forward
print("direct forward:", type(direct).__name__, direct.gemm_method)
def chunks(n, ctx, q):
    nb = (ctx + q + 16) // 16 + 1
    return [SequenceChunk(s, [100] * q, ctx, list(range(s * nb, s * nb + nb)), sample=True) for s in range(n)]
cases = [("1 x 300 decode", chunks(1, 300, 1)), ("4 x 300 decode", chunks(4, 300, 1)),
         ("16 x 210 decode", chunks(16, 210, 1)), ("64 x 210 decode", chunks(64, 210, 1)),
         ("4 x 128 prefill", chunks(4, 0, 128))]
for name, c in cases:
    ids, pos, meta, li = runner.prepare_inputs(c)
    a = direct(ids, pos, kv, meta).clone()
    b = runner.model(ids, pos, kv, meta)
    same = torch.equal(a, b)
    n = 40 if "1 x" in name or "4 x 300" in name else 8
    best = {"direct": 1e9, "module": 1e9}
    for _ in range(5):
        for path in ("direct", "module"):
            f = (lambda: direct(ids, pos, kv, meta)) if path == "direct" else (lambda: runner.model(ids, pos, kv, meta))
            t = time.perf_counter()
            for _ in range(n): f()
            best[path] = min(best[path], (time.perf_counter() - t) / n)
    print(f"{name}: module {1e3*best['module']:.2f} ms, direct {1e3*best['direct']:.2f} ms, "
          f"{best['module']/best['direct']:.3f}x, same bits: {same}", flush=True)
