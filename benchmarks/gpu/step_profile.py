"""The kernel and host profile of `n` engine steps, shared by the step-profiling scripts of this folder."""
import cProfile
import pstats

import torch
from torch.profiler import ProfilerActivity, profile


def print_step_profile(step, n: int, kernels: int = 18, cumulative: int = 28, tottime: int = 15) -> None:
    """Run `step()` n times under torch.profiler (GPU kernel time per step, the top kernels), then n times under
    cProfile (the host's calls by cumulative and by own time)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events) / n
    print(f"GPU kernel time per step: {gpu_us / 1e3:.2f} ms")
    print(events.table(sort_by="self_cuda_time_total", row_limit=kernels, max_name_column_width=70))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    pr.disable()
    if cumulative:
        pstats.Stats(pr).sort_stats("cumulative").print_stats(cumulative)
    pstats.Stats(pr).sort_stats("tottime").print_stats(tottime)
