"""Issue 20 probe: what a decode graph costs per bucket on the bundled model, and which kernels grow with the rows.

Verification steps run k + 1 decode rows per sequence, so one speculating sequence replays bucket 8 (k = 4) where
plain decoding replays bucket 1. This replays buckets 1..24 with every row at a 300-token context (no KV writes),
then profiles one eager forward at 1 and at 8 rows (torch.profiler, top kernels by device time).

    python benchmarks/gpu/verify_rows_profile.py --dtype float32
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="float32")
    p.add_argument("--context", type=int, default=300)
    a = p.parse_args()
    eng = LLMEngine(EngineArgs(dtype=a.dtype, max_model_len=2048, num_gpu_blocks_override=8192, max_num_seqs=64,
                               speculative_config={"method": "ngram_gpu", "num_speculative_tokens": 4,
                                                   "prompt_lookup_min": 1, "prompt_lookup_max": 4}))
    runner = eng.executor.driver_worker.model_runner
    gr = runner.graph_runner
    blocks = -(-a.context // gr.block_size)
    mb = gr.max_batch
    gr.seq_lens[:mb] = a.context
    gr.positions[:mb] = a.context - 1
    gr.slot_mapping[:mb] = -1
    gr.block_tables[:mb, :blocks] = torch.arange(blocks, dtype=torch.int32, device=gr.device)
    line = []
    for b in [x for x in (1, 2, 4, 8, 16, 24, 32) if x in gr.graphs]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        gr.graphs[b].replay()
        start.record()
        for _ in range(20):
            gr.graphs[b].replay()
        end.record()
        end.synchronize()
        line.append(f"{b}: {start.elapsed_time(end) / 20:.3f}")
    print(f"{a.dtype} decode graph ms by bucket (context {a.context}): " + ", ".join(line), flush=True)
    for b in (1, 8):
        meta = gr._meta(b)
        meta.seq_lens_cpu = [a.context] * b
        args = (gr.input_ids[:b], gr.positions[:b], gr.kv_caches, meta)
        with torch.inference_mode():
            runner.model(*args)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                runner.model(*args)
                torch.cuda.synchronize()
        print(f"-- eager forward, {b} rows: top kernels", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=70), flush=True)


if __name__ == "__main__":
    main()
