"""Grammar-forced drafts (xgrammar's jump-forward tokens) A/B: greedy JSON-schema requests without worked examples
(the 20 sample schemas, zero-shot prompts), bundled model on the CPU, closed loop at 1 and 4 concurrent; engines:
speculation off, n-gram drafts only, n-gram + forced drafts. Same requests, interleaved rounds.

    python benchmarks/results/cpu_1206e/spec_forced_ab.py [prompts per schema] [rounds]
"""
import json
import sys

from pagedllm.benchmarks.spec_decode import run_closed_loop
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.params import StructuredOutputsParams
from pagedllm.structured_output.sample_schemas import SCHEMAS, max_tokens_for

per = int(sys.argv[1]) if len(sys.argv) > 1 else 2
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
SPEC = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 3, "prompt_lookup_max": 4}
engines = {name: LLMEngine(EngineArgs(max_model_len=1024, speculative_config=None if name == "off" else SPEC))
           for name in ("off", "ngram", "ngram+forced")}
engines["ngram"].structured_output.forced_tokens = lambda seq, compiled: []
tok = engines["off"].tokenizer
prompts, params = [], []
for i, schema in enumerate(SCHEMAS):
    for k in range(per):
        text = f"Write one example as JSON matching this schema: {json.dumps(schema)}\nExample {k + 1}:"
        prompts.append(tok.encode(text))
        params.append(SamplingParams(temperature=0, max_tokens=max_tokens_for(schema),
                                     structured_outputs=StructuredOutputsParams(json=schema)))
for name, eng in engines.items():  # compile the grammars, warm up
    run_closed_loop(eng, prompts, params, 8, f"warm-{name}")
for c in (1, 4):
    tot = {n: [0.0, 0] for n in engines}
    outs = {}
    before = {n: e.stats() for n, e in engines.items()}
    for r in range(rounds):
        for name, eng in engines.items():
            dt, o = run_closed_loop(eng, prompts, params, c, f"c{c}r{r}{name}")
            tot[name][0] += dt
            tot[name][1] += sum(len(x) for x in o)
            outs[name] = o
    base = tot["off"][1] / tot["off"][0]
    for name, (dt, n) in tot.items():
        st = engines[name].stats()
        acc = st.get("spec_decode_num_accepted_tokens", 0) - before[name].get("spec_decode_num_accepted_tokens", 0)
        dr = st.get("spec_decode_num_draft_tokens", 0) - before[name].get("spec_decode_num_draft_tokens", 0)
        same = sum(a == b for a, b in zip(outs[name], outs["off"]))
        print(f"c={c} {name:14s} {n / dt:8.1f} tok/s  x{n / dt / base:5.2f}  drafted {dr:6d} accepted {acc:6d}  "
              f"identical to off {same}/{len(prompts)}", flush=True)
