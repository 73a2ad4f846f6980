"""One engine (the bundled GGUF served quantized), 16 copy prompts, closed loop at concurrency C, greedy, 256 tokens:
    PAGEDLLM_CPU_ISA=avx2 python spec_isa.py on|off C 16   (n-gram k 6, lookup 3-4, as spec_decode's default)"""
import sys, time, logging
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.benchmarks.copy_prompts import make_copy_prompts
from pagedllm.benchmarks.spec_decode import run_closed_loop
spec = None if sys.argv[1] == "off" else '{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 3, "prompt_lookup_max": 4}'
c = int(sys.argv[2]); n = int(sys.argv[3])
eng = LLMEngine(EngineArgs(max_model_len=2048, max_num_seqs=4, num_gpu_blocks_override=2048, speculative_config=spec, seed=0))
prompts = make_copy_prompts(eng.tokenizer, n, 0, "frozen")
run_closed_loop(eng, prompts[:2], [SamplingParams(temperature=0, max_tokens=8)] * 2, 2, "w")
t = time.perf_counter()
dt, outs = run_closed_loop(eng, prompts, [SamplingParams(temperature=0, max_tokens=256)] * n, c, "m")
tok = sum(map(len, outs))
print(f"{sys.argv[1]} c={c}: {tok} tokens in {dt:.2f} s = {tok/dt:.1f} tok/s", flush=True)
