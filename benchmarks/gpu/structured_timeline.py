"""Diagnostic (issue 19): is a constrained batch's extra time the host's or a pipeline bubble? One round of the
64 JSON-schema requests and one of their unconstrained twins (as benchmarks/structured_outputs.py builds them)
under torch.profiler with CUDA activity: per round the wall time, the device's busy time (the union of its kernel
and copy intervals), its idle time, and the host's time in the engine's step phases.

    python benchmarks/gpu/structured_timeline.py [config dir, dummy weights]
"""
from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.sample_schemas import SCHEMAS, max_tokens_for


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (µs in, s out)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total * 1e-6


def main() -> None:
    model_kwargs = {"model": sys.argv[1], "load_format": "dummy"} if len(sys.argv) > 1 else {}
    llm = LLM(num_gpu_blocks_override=1024, max_num_seqs=64, max_model_len=1024, **model_kwargs)
    n = 64
    prompts = [f"Reply with JSON matching {SCHEMAS[i % 20]}"[:80] + "\n" for i in range(n)]
    cons = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens_for(SCHEMAS[i % 20]),
                           structured_outputs=StructuredOutputsParams(json=SCHEMAS[i % 20])) for i in range(n)]
    lens = [len(o.outputs[0].token_ids) for o in llm.generate(prompts, cons, use_tqdm=False)]
    plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=lens[i], ignore_eos=True) for i in range(n)]
    llm.generate(prompts, plain, use_tqdm=False)
    engine = llm.llm_engine
    phases = ("_launch_forward", "_complete_step", "_launch_sampling")
    for name, params in (("constrained", cons), ("unconstrained", plain)) * 2:
        spent = dict.fromkeys(phases, 0.0)
        originals = {p: getattr(engine, p) for p in phases}

        def timed(phase, fn):
            def wrapper(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    spent[phase] += time.perf_counter() - t0
            return wrapper

        for p in phases:
            setattr(engine, p, timed(p, originals[p]))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
        for p in phases:
            setattr(engine, p, originals[p])
        device = [(e.time_range.start, e.time_range.end) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = busy_seconds(device)
        host = ", ".join(f"{p.strip('_')} {1e3 * s:.0f} ms" for p, s in spent.items())
        print(f"== {name}: wall {1e3 * wall:.0f} ms, device busy {1e3 * busy:.0f} ms ({100 * busy / wall:.0f} %), "
              f"idle {1e3 * (wall - busy):.0f} ms; host in {host} (nested: complete_step may include "
              f"launch_sampling)", flush=True)


if __name__ == "__main__":
    main()
