"""12 of the spec-decode benchmark's 100 copy prompts (40-51) at 4 concurrent through one engine: python
profile_run.py off|on (BENCHMARKS.md §59.2)."""
import sys

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.spec_decode import make_copy_prompts, run_closed_loop
spec = sys.argv[1] == "on"
kw = dict(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}) if spec else {}
llm = LLM(max_model_len=2048, num_gpu_blocks_override=2048, **kw)
tok = llm.get_tokenizer()
prompts = make_copy_prompts(tok, 100)[40:52]
params = [SamplingParams(temperature=0.0, max_tokens=512) for _ in prompts]
t, outs = run_closed_loop(llm.llm_engine, prompts, params, 4, "p")
n = sum(len(o) for o in outs)
print(f"{sys.argv[1]}: {n} tokens in {t:.1f} s = {n/t:.1f} tok/s; prompt lens {[len(p) for p in prompts]}")
