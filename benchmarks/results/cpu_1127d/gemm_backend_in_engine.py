"""float32 direct-forward steps (+ LM head) with oneDNN-packed and MKL-packed linears: two engines in one process,
alternating rounds (10), the median of the per-round ratios and each side's best; tokens' hidden states compared (allclose, not bits: the GEMMs differ)."""
import os, time, torch
from pagedllm import LLM
from pagedllm.worker.model_input import SequenceChunk
engines = {}
for gemm in ("onednn", "mkl"):
    os.environ["PAGEDLLM_CPU_GEMM"] = gemm
    llm = LLM(quantization="none", max_model_len=1024, num_gpu_blocks_override=2048)
    w = llm.llm_engine.executor.driver_worker
    engines[gemm] = (w.model_runner, w.cache_engine.gpu_cache)
def chunks(n, ctx, q):
    nb = (ctx + q + 16) // 16 + 1
    return [SequenceChunk(s, [100] * q, ctx, list(range(s * nb, s * nb + nb)), sample=True) for s in range(n)]
cases = [("1 x 300 decode", chunks(1, 300, 1), 20), ("4 x 300 decode", chunks(4, 300, 1), 20),
         ("4 x 300 verify 5", chunks(4, 300, 5), 10), ("16 x 210 decode", chunks(16, 210, 1), 10),
         ("64 x 210 decode", chunks(64, 210, 1), 5), ("64 x 300 decode", chunks(64, 300, 1), 5),
         ("4 x 128 prefill", chunks(4, 0, 128), 2), ("1 x 459 prefill", chunks(1, 0, 459), 2)]
import statistics
for name, c, n in cases:
    best, outs, ratios = {}, {}, []
    for _ in range(10):
        this = {}
        for gemm, (runner, kv) in engines.items():
            ids, pos, meta, li = runner.prepare_inputs(c)
            t = time.perf_counter()
            for _ in range(n):
                h = runner.direct_forward(ids, pos, kv, meta)
                logits = runner.model.compute_logits(h[li])
            this[gemm] = (time.perf_counter() - t) / n
            best[gemm] = min(best.get(gemm, 1e9), this[gemm])
            outs[gemm] = logits
        ratios.append(this["onednn"] / this["mkl"])
    close = torch.allclose(outs["onednn"], outs["mkl"], atol=1e-3, rtol=1e-3)
    print(f"{name}: oneDNN {1e3*best['onednn']:.2f} ms, MKL {1e3*best['mkl']:.2f} ms, "
          f"best {best['onednn']/best['mkl']:.3f}x, median of rounds {statistics.median(ratios):.3f}x "
          f"(range {min(ratios):.2f}-{max(ratios):.2f}), logits close: {close}", flush=True)
