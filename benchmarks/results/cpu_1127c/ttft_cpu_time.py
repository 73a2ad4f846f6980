import time, os, sys, logging, json
import torch
torch.set_num_threads(1)
logging.disable(logging.WARNING)
from pagedllm import LLM, SamplingParams
q = os.environ.get("Q", "gguf")
llm = LLM(quantization=q, max_model_len=2048, enable_prefix_caching=False)
sp = SamplingParams(max_tokens=1, temperature=0)
res = {}
for n in (64, 256, 459):
    ids = [100 + (i * 37) % 20000 for i in range(n)]
    best = 9e9
    for r in range(6):
        t = time.process_time()
        llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
        best = min(best, time.process_time() - t)
    res[n] = best * 1e3
print(json.dumps(res))
