"""Per step: candidates, drafts proposed, drafts chosen (goodput) at 4 concurrent over the 100 copy prompts."""
import collections
import sys
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.spec_decode import make_copy_prompts, run_closed_loop
from pagedllm.spec_decode.spec_decoder import SpecDecoder
rec = collections.Counter()
orig = SpecDecoder._draft_lengths
def dl(self, sched, candidates):
    out = orig(self, sched, candidates)
    rec[(len(sched.scheduled), len(candidates), sum(k for _, k, _ in candidates), sum(out))] += 1
    return out
SpecDecoder._draft_lengths = dl
policy = sys.argv[1] if len(sys.argv) > 1 else "goodput"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 100
lmin = int(sys.argv[3]) if len(sys.argv) > 3 else 4
cfg = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": lmin, "draft_length_policy": policy}
llm = LLM(max_model_len=2048, num_gpu_blocks_override=2048, speculative_config=cfg)
prompts = make_copy_prompts(llm.get_tokenizer(), 100)[:n]
params = [SamplingParams(temperature=0.0, max_tokens=512) for _ in prompts]
t, outs = run_closed_loop(llm.llm_engine, prompts, params, 4, "p")
tok = sum(len(o) for o in outs)
print(f"{policy} min {lmin}: {tok} tokens in {t:.1f} s = {tok/t:.1f} tok/s")
print("seqs cands proposed chosen : steps")
for k, v in sorted(rec.items(), key=lambda kv: -kv[1])[:25]:
    print(*k, ":", v)
print("cost model:", {r: round(s * 1e3, 2) for r, s in sorted(llm.llm_engine.spec_decoder.step_cost.times.items())} if hasattr(llm.llm_engine, "spec_decoder") else "")
