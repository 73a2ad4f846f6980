"""Where a windowed model's decode step goes, hybrid KV cache against one table, at the same batch and context:
wall time per step, GPU kernel time per step (torch.profiler) with the top kernels, and the host's hottest calls.

    python benchmarks/gpu/make_random_windowed.py /tmp/g1b gemma3-1b --config-only
    python benchmarks/gpu/profile_hybrid_step.py /tmp/g1b hybrid 32 4096
    python benchmarks/gpu/profile_hybrid_step.py /tmp/g1b one 32 4096

(`hybrid` sets PAGEDLLM_CUDA_HYBRID_KV_CACHE=1 itself, which has been the default on CUDA since BENCHMARKS.md §75.)
"""
import os
import random
import sys
import time

if sys.argv[2] == "hybrid":
    os.environ["PAGEDLLM_CUDA_HYBRID_KV_CACHE"] = "1"

import torch  # noqa: E402

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import RequestOutputKind  # noqa: E402
from step_profile import print_step_profile  # noqa: E402

if __name__ == "__main__":
    model, layout, batch, ctx = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, device="cuda", dtype="bfloat16",
              max_model_len=ctx + 256, max_num_seqs=batch, max_num_batched_tokens=16384,
              kv_cache_memory_bytes=int(os.environ.get("KV_BYTES", 8_000_000_000)),
              disable_hybrid_kv_cache_manager=layout != "hybrid", disable_log_stats=True)
    engine, rng = llm.llm_engine, random.Random(0)
    print(f"layout {layout}: {engine.scheduler.block_manager.num_groups} groups")
    params = SamplingParams(temperature=0.0, max_tokens=250, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)  # as LLM.generate asks
    for i in range(batch):
        engine.add_request(f"r{i}", {"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(ctx)]}, params)
    steps = 0
    while engine.scheduler.waiting or any(s.num_computed_tokens < ctx for g in engine.scheduler.running
                                          for s in g.get_seqs()):
        engine.step()
        steps += 1
    for _ in range(8):
        engine.step()
    torch.cuda.synchronize()
    running = sum(len(g.get_seqs()) for g in engine.scheduler.running)
    n = 30
    t = time.perf_counter()
    for _ in range(n):
        engine.step()
    torch.cuda.synchronize()
    print(f"{layout}, batch {batch} (running {running}), context ~{ctx}: {(time.perf_counter() - t) / n * 1e3:.2f} "
          f"ms/step wall ({steps} prefill steps before)")
    print_step_profile(engine.step, n, kernels=14, cumulative=0, tottime=18)
