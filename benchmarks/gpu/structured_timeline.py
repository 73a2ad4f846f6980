"""Diagnostic (issue 19): where a constrained batch's extra step time goes. One round of the 64 JSON-schema
requests and one of their unconstrained twins (as benchmarks/structured_outputs.py builds them), twice each; per
round the wall time and the host's time in each step phase (wrapped with timers; phases nest: `step` holds all),
including the time spent *waiting* for the device (`wait` = the sampled tokens' event). With `--cuda`, the rounds
also run under torch.profiler and print the device's busy time (the union of its kernel and copy intervals).

    python benchmarks/gpu/structured_timeline.py [config dir, dummy weights] [--cuda] [--profile-apply] [--split-apply]

`--profile-apply` runs cProfile inside the Triton mask launch only and prints where its host time goes;
`--split-apply` times the pieces of the mask apply (enter, copy, row list, launch, exit) separately.
"""
from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import pagedllm.engine.llm_engine as llm_engine_module
import pagedllm.kernels.triton_bitmask as triton_bitmask
from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.model.layers.sampler import SamplerOutput
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


def wrap(owner, attr: str, phase: str, spent: dict, calls: dict) -> None:
    fn = getattr(owner, attr)

    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            spent[phase] += time.perf_counter() - t0
            calls[phase] += 1
    setattr(owner, attr, timed)


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    cuda_profile = "--cuda" in sys.argv
    model_kwargs = {"model": args[0], "load_format": "dummy"} if args else {}
    llm = LLM(num_gpu_blocks_override=1024, max_num_seqs=64, max_model_len=1024, **model_kwargs)
    n = 64
    prompts = [f"Reply with JSON matching {SCHEMAS[i % 20]}"[:80] + "\n" for i in range(n)]
    cons = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens_for(SCHEMAS[i % 20]),
                           structured_outputs=StructuredOutputsParams(json=SCHEMAS[i % 20])) for i in range(n)]
    lens = [len(o.outputs[0].token_ids) for o in llm.generate(prompts, cons, use_tqdm=False)]
    plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=lens[i], ignore_eos=True) for i in range(n)]
    llm.generate(prompts, plain, use_tqdm=False)
    engine = llm.llm_engine
    spent: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for owner, attr, phase in (
        (engine, "step", "step"), (engine.scheduler, "schedule", "schedule"),
        (engine, "_launch_forward", "launch_forward"), (engine.executor, "execute_model", "execute_model"),
        (engine, "_launch_sampling", "launch_sampling"), (engine.sampler, "launch", "sampler.launch"),
        (llm_engine_module, "apply_token_bitmask_", "apply_bitmask"),
        (engine, "_complete_step", "complete_step"), (engine, "_append_samples", "append_samples"),
        (engine.structured_output, "start_fill", "start_fill"), (engine.structured_output, "_prepare", "fill.prepare"),
        (engine.structured_output, "_native_fill", "fill.native"), (triton_bitmask, "apply_token_bitmask_triton",
                                                                      "apply.triton"), (engine.structured_output, "accept", "accept"),
        (engine.output_processor, "make_output", "make_output"),
    ):
        wrap(owner, attr, phase, spent, calls)
    if "--profile-apply" in sys.argv:  # cProfile only inside the Triton mask launch
        apply_prof = cProfile.Profile()
        real_apply = triton_bitmask.apply_token_bitmask_triton

        def profiled_apply(*a, **kw):
            apply_prof.enable()
            try:
                return real_apply(*a, **kw)
            finally:
                apply_prof.disable()
        triton_bitmask.apply_token_bitmask_triton = profiled_apply
    if "--split-apply" in sys.argv:  # time the GPU mask apply's pieces separately (its body, instrumented)
        def split_apply(logits, bitmask, rows):
            t0 = time.perf_counter()
            with torch.inference_mode():
                t1 = time.perf_counter()
                mask = bitmask[: logits.shape[0]]
                dev = mask.to(logits.device, non_blocking=True)
                t2 = time.perf_counter()
                every = len(rows) == logits.shape[0]
                idx = None if every else llm_engine_module.async_tensor_h2d(rows, torch.long, logits.device)
                t3 = time.perf_counter()
                triton_bitmask.apply_token_bitmask_triton(logits, dev, idx)
                t4 = time.perf_counter()
            t5 = time.perf_counter()
            for phase, dt in (("apply.enter", t1 - t0), ("apply.copy", t2 - t1), ("apply.rows", t3 - t2),
                              ("apply.launch", t4 - t3), ("apply.exit", t5 - t4)):
                spent[phase] += dt
                calls[phase] += 1
        llm_engine_module.apply_token_bitmask_ = split_apply
    real_result = SamplerOutput.result

    def result(self):
        if self._event is not None:
            t0 = time.perf_counter()
            self._event.synchronize()
            spent["wait"] += time.perf_counter() - t0
            calls["wait"] += 1
        return real_result(self)
    SamplerOutput.result = result
    print(f"{sum(lens)} output tokens in each round, longest {max(lens)}", flush=True)
    for name, params in (("constrained", cons), ("unconstrained", plain)) * 2:
        spent.clear()
        calls.clear()
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if cuda_profile else None
        if prof is not None:
            prof.__enter__()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        line = f"== {name}: wall {1e3 * wall:.1f} ms, {calls['step']} steps"
        if prof is not None:
            prof.__exit__(None, None, None)
            device = [(e.time_range.start, e.time_range.end) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA]
            line += f", device busy {1e3 * busy_seconds(device):.1f} ms"
        print(line, flush=True)
        steps = max(calls["step"], 1)
        for phase in sorted(spent, key=spent.get, reverse=True):
            print(f"   {phase:16s} {1e3 * spent[phase]:8.2f} ms  {1e3 * spent[phase] / steps:6.3f} ms/step  "
                  f"{calls[phase]:6d} calls", flush=True)


    if "--profile-apply" in sys.argv:
        out = io.StringIO()
        pstats.Stats(apply_prof, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue(), flush=True)


if __name__ == "__main__":
    main()
