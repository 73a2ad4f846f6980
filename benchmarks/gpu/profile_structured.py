"""Where a constrained batch's time goes (issue 19): cProfile of one round of 64 JSON-schema requests and one
round of their unconstrained twins (as benchmarks/structured_outputs.py builds them), with the engine's step
count and mean step time per round. Usage: python benchmarks/gpu/profile_structured.py [xgrammar|guidance] [profile] [config dir, dummy weights]"""
from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.sample_schemas import SCHEMAS, max_tokens_for

backend = sys.argv[1] if len(sys.argv) > 1 else "xgrammar"
n = 64
model_kwargs = {"model": sys.argv[3], "load_format": "dummy"} if len(sys.argv) > 3 else {}  # e.g. .tok (dummy weights)
llm = LLM(num_gpu_blocks_override=1024, max_num_seqs=64, max_model_len=1024, structured_outputs_backend=backend,
          **model_kwargs)
prompts = [f"Reply with JSON matching {SCHEMAS[i % 20]}"[:80] + "\n" for i in range(n)]
cons = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens_for(SCHEMAS[i % 20]),
                       structured_outputs=StructuredOutputsParams(json=SCHEMAS[i % 20])) for i in range(n)]
outs = llm.generate(prompts, cons, use_tqdm=False)
lens = [len(o.outputs[0].token_ids) for o in outs]
plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=lens[i], ignore_eos=True) for i in range(n)]
llm.generate(prompts, plain, use_tqdm=False)
engine = llm.llm_engine
real_step = engine.step
times: list[float] = []
running: list[int] = []


def timed_step():
    running.append(len(engine.scheduler.running))
    t0 = time.perf_counter()
    out = real_step()
    times.append(time.perf_counter() - t0)
    return out


engine.step = timed_step
for i, (name, params) in enumerate((("constrained", cons), ("unconstrained", plain)) * 2):
    times.clear()
    running.clear()
    profile = i >= 2 and len(sys.argv) > 2  # the second pair only: cProfile inflates every call
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    if profile:
        prof.enable()
    llm.generate(prompts, params, use_tqdm=False)
    prof.disable()
    wall = time.perf_counter() - t0
    small = [t for t, r in zip(times, running) if r <= 4]
    print(f"== {backend} {name}{' (cProfile)' if profile else ''}: {sum(lens)} tokens, max {max(lens)}, wall "
          f"{wall * 1e3:.0f} ms, {len(times)} steps, mean step {1e3 * sum(times) / len(times):.2f} ms; "
          f"{len(small)} steps with <= 4 running: {1e3 * sum(small):.0f} ms", flush=True)
    if profile:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
        lines = s.getvalue().splitlines()
        start = next(i for i, line in enumerate(lines) if "tottime" in line)  # the table, from its header
        print("\n".join(lines[start:start + 41]), flush=True)
