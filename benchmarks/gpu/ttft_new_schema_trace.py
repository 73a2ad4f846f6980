"""Diagnostic (issue 19): the timeline of a never-seen schema's first token under load, step by step, twice
(the engine's first constrained request, then a second new schema): when its grammar finished compiling,
each step's duration, and when its first token came back; a plain twin's TTFT for reference.

    python benchmarks/gpu/ttft_new_schema_trace.py [model args as JSON]
"""
from __future__ import annotations

import json
import sys
import time

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.sample_schemas import SCHEMAS

kwargs = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
llm = LLM(num_gpu_blocks_override=1024, max_num_seqs=64, max_model_len=1024, **kwargs)
eng = llm.llm_engine
_ = eng.structured_output.backend
for i in range(8):
    eng.add_request(f"plain{i}", f"Story {i}:", SamplingParams(temperature=0, max_tokens=600, ignore_eos=True))
for _ in range(5):
    eng.step()


def trace(request_id: str, params: SamplingParams) -> None:
    t_add = time.perf_counter()
    group = eng.add_request(request_id, "JSON:", params)
    t_added = time.perf_counter()
    fut = group.extra.get("grammar_future")  # absent when the grammar was cached
    done_at = []
    if fut is not None:
        fut.add_done_callback(lambda f: done_at.append(time.perf_counter()))
    lines = []
    while True:
        t0 = time.perf_counter()
        outs = eng.step()
        t1 = time.perf_counter()
        got = any(o.request_id == request_id and o.outputs[0].token_ids for o in outs)
        lines.append(f"  step {1e3 * (t0 - t_add):7.2f} -> {1e3 * (t1 - t_add):7.2f} ms ({1e3 * (t1 - t0):5.2f}), "
                     f"running {len(eng.scheduler.running)}, compiled {bool(done_at)}{', FIRST TOKEN' if got else ''}")
        if got:
            break
    comp = f"compiled at {1e3 * (done_at[0] - t_add):.2f} ms" if done_at else "no grammar"
    print(f"{request_id}: add_request {1e3 * (t_added - t_add):.2f} ms, {comp}, TTFT {1e3 * (t1 - t_add):.2f} ms")
    print("\n".join(lines), flush=True)
    for _ in range(3):
        eng.step()


for k in range(2):
    schema = {"type": "object", "properties": {f"k{time.time_ns()}": {"type": "array", "items": SCHEMAS[9]}},
              "required": []}
    trace(f"new{k}", SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(json=schema)))
    trace(f"twin{k}", SamplingParams(temperature=0, max_tokens=8))
    trace(f"cached{k}", SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(json=schema)))
