import sys, time, json
from pagedllm import LLM, SamplingParams
llm = LLM(max_model_len=1024)
import pagedllm; print(pagedllm.__file__)
prompts = [f"Write a short story number {i} about a robot who" for i in range(64)]
for seeded in (False, True):
    ps = [SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, seed=(i if seeded else None)) for i in range(64)]
    llm.generate(prompts[:4], ps[:4], use_tqdm=False)
    best = 1e9
    for _ in range(2):
        t0 = time.perf_counter(); llm.generate(prompts, ps, use_tqdm=False); best = min(best, time.perf_counter() - t0)
    print(json.dumps({"seeded": seeded, "s": best, "tok_s": 64 * 64 / best}), flush=True)
