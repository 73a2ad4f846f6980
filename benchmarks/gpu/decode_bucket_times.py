"""Replay time of every captured decode-graph bucket (issues 16, 21): is a larger bucket ever faster?

cuBLAS picks a GEMM kernel per M; §32.2 found M = 1 000 slower than 1 024. A decode batch of n runs in the smallest
captured bucket ≥ n. This builds an engine (dummy weights), then replays each bucket's graph over padding rows
(context 1, so the time is the GEMMs and elementwise kernels, what padding rows cost) and prints, per bucket, the
time and whether some larger bucket is faster.

    python benchmarks/gpu/decode_bucket_times.py /tmp/l7b [--quantization fp8] [--max-num-seqs 1024]
"""
import argparse
import json

import torch

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    engine = LLMEngine(EngineArgs(model=a.model, load_format="dummy", device="cuda", dtype="bfloat16",
                                  skip_tokenizer_init=True, max_model_len=2048, max_num_seqs=a.max_num_seqs,
                                  quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype))
    gr = engine.executor.driver_worker.model_runner.graph_runner
    gr._reset_padding()
    for b in gr.batch_sizes:  # warm every graph once
        gr.graphs[b].replay()
    torch.cuda.synchronize()
    times = {b: replay_ms(gr.graphs[b], a.reps) for b in gr.batch_sizes}
    times2 = {b: replay_ms(gr.graphs[b], a.reps) for b in reversed(gr.batch_sizes)}
    times = {b: min(times[b], times2[b]) for b in gr.batch_sizes}
    sizes = gr.batch_sizes
    print(f"{'bucket':>7}{'ms':>9}{'us/row':>9}  best larger bucket")
    slower = 0
    for i, b in enumerate(sizes):
        later = min(sizes[i:], key=lambda x: times[x])
        note = f"{later} ({times[later]:.3f} ms, {100 * (1 - times[later] / times[b]):.1f} % less)" if later != b else ""
        slower += later != b
        print(f"{b:>7}{times[b]:>9.3f}{1e3 * times[b] / b:>9.1f}  {note}")
    print(f"{slower} of {len(sizes)} buckets have a faster larger bucket")
    print("the engine's routing (bucket → bucket it replays):", {b: r for b, r in gr.route.items() if r != b})
    pw = engine.executor.driver_worker.model_runner.piecewise_runner
    if pw is not None:
        if not pw.replay_ms:
            pw.time_buckets(reps=2)
        print(f"{'tokens':>7}{'ms':>9}{'us/tok':>9}  piecewise buckets (no attention), routed to")
        for b, ms in pw.replay_ms.items():
            print(f"{b:>7}{ms:>9.3f}{1e3 * ms / b:>9.2f}  {pw.route[b] if pw.route[b] != b else ''}")
        times["piecewise"] = pw.replay_ms
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "quantization": a.quantization, "times_ms": times}, f, indent=1)


if __name__ == "__main__":
    main()
