"""prompt_logprobs on CUDA with prefix caching on: every position computed, ranks consistent with the top-k.

python benchmarks/results/gpu_1203c/prompt_logprobs_cuda.py   (device: an H200, 2026-12-03)"""
from pagedllm import LLM, SamplingParams

llm = LLM(device="cuda", enable_prefix_caching=True, max_model_len=1024)
prompt = "The quick brown fox jumps over the lazy dog. " * 8
sp = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3)
cold, warm = (llm.generate([prompt], sp, use_tqdm=False)[0] for _ in range(2))
plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
n = len(cold.prompt_token_ids)
missing = [sum(d is None for d in o.prompt_logprobs[1:]) for o in (cold, warm)]
consistent = all((r == 1) == (max(d, key=d.get) == t) for o in (cold, warm)
                 for t, d, r in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:], o.prompt_logprob_ranks[1:]))
print(f"prompt tokens {n}; missing positions cold/warm {missing}; cached tokens cold/warm/plain "
      f"{cold.num_cached_tokens}/{warm.num_cached_tokens}/{plain.num_cached_tokens}; ranks equal "
      f"{cold.prompt_logprob_ranks == warm.prompt_logprob_ranks}; rank 1 iff the argmax: {consistent}; "
      f"outputs equal {cold.outputs[0].token_ids == warm.outputs[0].token_ids == plain.outputs[0].token_ids}")
