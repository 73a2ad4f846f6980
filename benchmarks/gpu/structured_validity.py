"""Diagnostic (issue 19): 40 seeded JSON-schema generations (the 20 sample schemas, 2 seeds each) and 8 regex
generations on the engine's device, validated; per backend and scheduling mode.
Usage: python benchmarks/gpu/structured_validity.py {xgrammar|guidance} {async|sync}"""
from __future__ import annotations

import json
import re
import sys

import jsonschema

from pagedllm import LLM, SamplingParams, StructuredOutputsParams as SO
from pagedllm.structured_output.sample_schemas import SCHEMAS, max_tokens_for

backend, mode = sys.argv[1], sys.argv[2]
llm = LLM(num_gpu_blocks_override=512, max_num_seqs=64, max_model_len=1024, structured_outputs_backend=backend,
          async_scheduling=mode == "async")
regex = r"(\+33|0)[1-9]( \d\d){4}"
prompts = [f"Reply with JSON matching {json.dumps(s)[:60]}\n" for s in SCHEMAS] * 2 + ["A phone number:"] * 8
params = [SamplingParams(temperature=1.0, seed=100 * i + k, max_tokens=max_tokens_for(s), structured_outputs=SO(json=s))
          for k in range(2) for i, s in enumerate(SCHEMAS)]
params += [SamplingParams(temperature=1.0, seed=i, max_tokens=30, structured_outputs=SO(regex=regex)) for i in range(8)]
bad, length = 0, 0
for o, p in zip(llm.generate(prompts, params, use_tqdm=False), params):
    c = o.outputs[0]
    length += c.finish_reason == "length"
    try:
        if p.structured_outputs.json is not None:
            jsonschema.validate(json.loads(c.text), p.structured_outputs.json)
        elif not re.fullmatch(regex, c.text):
            raise ValueError("no match")
    except Exception as e:  # noqa: BLE001 — a diagnostic: report every kind of failure
        bad += c.finish_reason != "length"
        print(f"  invalid ({c.finish_reason}, {type(e).__name__}): {c.text[:100]!r}")
print(f"== {backend} {mode} on {llm.llm_engine.executor.device}: {len(params)} generations, {bad} invalid "
      f"(stopped), {length} ran to max_tokens", flush=True)
