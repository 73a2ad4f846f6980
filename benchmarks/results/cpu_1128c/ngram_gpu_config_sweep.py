"""Tokens per device step of ngram_gpu on the CPU (float32, 30 copy prompts, always speculating) per k:min:max."""
import sys
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.spec_decode import run_closed_loop, make_copy_prompts
cfgs = [tuple(map(int, c.split(":"))) for c in sys.argv[1:]]
base = None
for k, mn, mx in cfgs:
    llm = LLM(max_model_len=2048, dtype="float32", num_gpu_blocks_override=2048,
              speculative_config={"method": "ngram_gpu", "num_speculative_tokens": k, "prompt_lookup_min": mn, "prompt_lookup_max": mx})
    eng = llm.llm_engine; loop = eng.device_spec; eng.spec_decoder.mode = None
    ps = make_copy_prompts(eng.tokenizer, 30)
    dt, outs = run_closed_loop(eng, ps, [SamplingParams(temperature=0, max_tokens=64)] * len(ps), 1, "s")
    toks = sum(len(o) for o in outs)
    print(f"{k}:{mn}:{mx} tokens {toks} device steps {loop.num_steps} tokens/step {toks/loop.num_steps:.3f} ({dt:.1f} s)", flush=True)
