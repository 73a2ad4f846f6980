"""Where a hybrid model's mixed steps go (BENCHMARKS §83): throughput.py's uniform workload run three times on one
engine, each run's step times by kind, every prefill-carrying step (tokens, ms), the CUDA allocator's counters per
run, and a torch.profiler table of the third run's kernels (top by device time). BEFORE=measure runs throughput.py's
bandwidth and matmul measurements on the fresh engine first, BEFORE=first-request its first-request probe (a
throughput.py run does both before its workload); then one request alone is profiled on the host (top by CPU time).
KERNELS=0 runs the Mamba-2 layers' prefill chunks through torch ops (the A/B of the Triton prefill kernels).

    [BEFORE=measure|first-request] [KERNELS=0] python benchmarks/gpu/mamba_steps_probe.py MODEL_DIR [NUM_PROMPTS] [OUT_DIR] [RUNS]
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from pagedllm import LLM
from pagedllm.benchmarks.throughput import make_workload, run_pagedllm
from pagedllm.worker.step_stats import format_summary


def allocator_counters() -> dict[str, int]:
    s = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    return {k: int(s.get(k, 0)) for k in ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")}


def main() -> None:
    model, num = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 64
    out_dir = Path(sys.argv[3]) if len(sys.argv) > 3 else None
    cuda = torch.cuda.is_available()
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16" if cuda else "float32",
              device="cuda" if cuda else "cpu", max_model_len=2048, max_num_seqs=256,
              **({"gpu_memory_utilization": 0.55} if cuda else {}))
    wl = make_workload(num, 64, 512, 128, int(llm.llm_engine.hf_config.vocab_size), 0)
    if os.environ.get("KERNELS") == "0":  # the A/B: Mamba-2 prefill chunks through torch ops instead of Triton kernels
        from pagedllm.model.layers.mamba2 import Mamba2Mixer

        mixers = [m for m in llm.llm_engine.executor.driver_worker.model_runner.model.modules()
                  if isinstance(m, Mamba2Mixer)]
        for m in mixers:
            m.prefill_kernels = False
        print(f"KERNELS=0: {len(mixers)} Mamba-2 mixers run their prefill chunks through torch ops")
    before = os.environ.get("BEFORE", "")
    if before == "measure":
        from pagedllm.benchmarks.kernels import copy_bandwidth
        from pagedllm.benchmarks.lower_bound import measure_matmul_peak

        print(f"before: copy {copy_bandwidth() / 1e12:.2f} TB/s, matmul {measure_matmul_peak() / 1e12:.0f} TFLOP/s")
    elif before == "first-request":
        from pagedllm.benchmarks.throughput import probe_first_request

        probe_first_request(llm, wl.prompts[0])
    runner = llm.llm_engine.executor.driver_worker.model_runner
    stats = runner.enable_step_stats()
    runs = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    for run in range(runs):
        stats.clear()
        builds = len(runner.compile_watch.events)
        before = allocator_counters()
        profiler = None
        if run == 2 and runs == 3:
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            profiler = torch.profiler.profile(activities=acts)
            profiler.__enter__()
        result = run_pagedllm(llm, wl)
        if profiler is not None:
            profiler.__exit__(None, None, None)
        after = allocator_counters()
        print(f"run {run}{' (profiled)' if profiler else ''}: {result.row()}")
        print(f"  Triton builds after the warm start: {[e.kernel for e in runner.compile_watch.events[builds:]]}")
        print("  allocator:", {k: after[k] - before[k] for k in after},
              f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if cuda else "")
        print(format_summary(stats.summary()))
        for kind, path, n, a, b in stats.records:
            if not kind.startswith("decode"):
                print(f"  step {kind}/{path}: {n} tokens, {a.elapsed_time(b):.2f} ms")
        if profiler is not None:
            key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
            table = profiler.key_averages().table(sort_by=key, row_limit=30)
            print(table)
            if out_dir is not None:
                out_dir.mkdir(parents=True, exist_ok=True)
                (out_dir / "profile_table.txt").write_text(table)
    # one request alone (its prompt's prefill and a few decode steps), profiled on the host: what an eager step costs
    from pagedllm import SamplingParams

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate([{"prompt_token_ids": wl.prompts[0]}], SamplingParams(max_tokens=1, ignore_eos=True),
                     use_tqdm=False)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
