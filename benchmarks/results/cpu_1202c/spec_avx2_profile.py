import sys, time
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.benchmarks.spec_decode import make_copy_prompts, run_closed_loop
spec = None if sys.argv[1] == "off" else '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}'
eng = LLMEngine(EngineArgs(device="cpu", max_model_len=2048, max_num_seqs=4, num_gpu_blocks_override=2048, speculative_config=spec))
prompts = make_copy_prompts(eng.tokenizer, 12, 0)
run_closed_loop(eng, prompts[:2], [SamplingParams(temperature=0, max_tokens=8)] * 2, 2, "warm")
# Time prefill-heavy and decode parts: count steps and time by whether any chunk had >1 new token
orig = eng.step
stats = {"steps": 0}
t0 = time.perf_counter()
secs, outs = run_closed_loop(eng, prompts, [SamplingParams(temperature=0, max_tokens=512)] * 12, 4, "m")
n = sum(len(o) for o in outs)
print(sys.argv[1], f"{n} tokens in {secs:.1f} s = {n/secs:.1f} tok/s; prompt tokens {sum(len(p) for p in prompts)}", eng.stats().get("spec_decode_num_accepted_tokens"), eng.stats().get("spec_decode_num_draft_tokens"))
