import time, sys
from pagedllm import LLM, SamplingParams
llm = LLM(max_model_len=1024, num_gpu_blocks_override=256)
sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
p = [{"prompt_token_ids": list(range(1000, 1100))}]
llm.generate(p, sp, use_tqdm=False)
best = 1e9
for _ in range(3):
    t = time.perf_counter(); llm.generate(p, sp, use_tqdm=False); best = min(best, time.perf_counter() - t)
print(f"{sys.argv[1]} {128 / best:.1f} tok/s")
