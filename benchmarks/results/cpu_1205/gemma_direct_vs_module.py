"""Gemma (float32, dense linears) decode/prefill forward: the CPU direct forward against the module path, alternating
in one process (same engine, same inputs; ROUNDS rounds, each timing every variant in turn; best and median round
printed); checks the hidden states are bit-identical.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/results/cpu_1205/gemma_direct_vs_module.py MODEL_DIR

"forward" is model.forward (the part the direct forward replaces); "+ head" adds the LM head on the sampled rows
(compute_logits: a 262 144-row GEMM for Gemma 3, the same on both paths)."""
import os
import statistics
import sys
import time

import torch

from pagedllm import LLM
from pagedllm.worker.model_input import SequenceChunk

llm = LLM(model=sys.argv[1], dtype="float32", skip_tokenizer_init=True, max_model_len=2048,
          num_gpu_blocks_override=2048)
w = llm.llm_engine.executor.driver_worker
runner, kv = w.model_runner, w.cache_engine.gpu_cache
direct = runner.direct_forward
if direct is None:  # a tree without the Gemma direct forward (e.g. the commit before it): the module path alone
    print(f"no direct forward: module path only, torch threads {torch.get_num_threads()}", flush=True)
else:
    print(f"direct forward: {type(direct).__name__} ({direct.gemm_method}), {len(direct.layers)} layers, windows "
          f"{sorted({lyr.window for lyr in direct.layers})}, activation {direct.activation}, torch threads "
          f"{torch.get_num_threads()}", flush=True)


def chunks(n, ctx, q):
    nb = (ctx + q + 16) // 16 + 1
    return [SequenceChunk(s, [100 + s] * q, ctx, list(range(s * nb, s * nb + nb)), sample=True) for s in range(n)]


ROUNDS = 9
cases = [("1 x 300 decode", chunks(1, 300, 1), 20), ("4 x 300 decode", chunks(4, 300, 1), 20),
         ("16 x 210 decode", chunks(16, 210, 1), 10), ("16 x 1000 decode (past the 512 window)", chunks(16, 1000, 1), 6),
         ("4 x 128 prefill", chunks(4, 0, 128), 2)]
with torch.inference_mode():
    for name, c, n in cases:
        ids, pos, meta, li = runner.prepare_inputs(c)
        fns = {"module": lambda: runner.model(ids, pos, kv, meta),
               "module + head": lambda: runner.model.compute_logits(runner.model(ids, pos, kv, meta)[li])}
        if direct is not None:
            same = torch.equal(direct(ids, pos, kv, meta).clone(), runner.model(ids, pos, kv, meta))
            fns.update({"direct": lambda: direct(ids, pos, kv, meta),
                        "direct + head": lambda: runner.model.compute_logits(direct(ids, pos, kv, meta)[li])})
        times = {k: [] for k in fns}
        for _ in range(ROUNDS):
            for k, f in fns.items():
                t = time.perf_counter()
                for _ in range(n):
                    f()
                times[k].append((time.perf_counter() - t) / n * 1e3)
        best = {k: min(v) for k, v in times.items()}
        med = {k: statistics.median(v) for k, v in times.items()}
        if direct is None:
            print(f"{name}: forward module {best['module']:.2f} ms (median {med['module']:.2f}); + head module "
                  f"{best['module + head']:.2f} ms; load average {os.getloadavg()[0]:.2f}", flush=True)
            continue
        print(f"{name}: forward module {best['module']:.2f} ms, direct {best['direct']:.2f} ms, "
              f"{best['module'] / best['direct']:.3f}x (medians {med['module']:.2f} / {med['direct']:.2f}, "
              f"{med['module'] / med['direct']:.3f}x); + head module {best['module + head']:.2f} ms, direct "
              f"{best['direct + head']:.2f} ms, {best['module + head'] / best['direct + head']:.3f}x; "
              f"same bits: {same}; load average {os.getloadavg()[0]:.2f}", flush=True)
