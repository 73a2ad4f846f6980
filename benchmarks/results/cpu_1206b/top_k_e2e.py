"""The bundled model (GGUF served quantized), 64 requests of 16-64 prompt tokens and 128 output tokens, sampled at
temperature 0.7: plain, with top_k 50 alone, with Qwen2.5's defaults (top_k 20, top_p 0.8); output tok/s of each,
interleaved rounds (medians of 3)."""
import statistics
import time

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.throughput import make_workload

llm = LLM(max_model_len=1024)
wl = make_workload(64, 16, 64, 128, 49152, 0)
ps = [{"prompt_token_ids": p} for p in wl.prompts]
kinds = {"temperature 0.7": dict(), "+ top_k 50": dict(top_k=50), "+ top_k 20, top_p 0.8": dict(top_k=20, top_p=0.8)}
llm.generate(ps[:4], SamplingParams(max_tokens=4), use_tqdm=False)
res = {k: [] for k in kinds}
for r in range(3):
    for name, kw in kinds.items():
        sp = [SamplingParams(temperature=0.7, seed=i, max_tokens=128, ignore_eos=True, **kw) for i in range(64)]
        t = time.perf_counter()
        llm.generate(ps, sp, use_tqdm=False)
        res[name].append(64 * 128 / (time.perf_counter() - t))
base = statistics.median(res["temperature 0.7"])
for name, v in res.items():
    print(f"{name:24s} {statistics.median(v):7.1f} out tok/s (median of 3; {statistics.median(v) / base:.2f}x plain)",
          flush=True)
