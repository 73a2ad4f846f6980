"""Prefill time of long prompts with VLLM_BATCH_INVARIANT=0 / 1 (engines in separate processes, alternating):
4 prompts of ~N tokens, 1 output token each, the bundled model.

    PYTHONPATH=. python benchmarks/results/cpu_1202/bi_long_prompt.py --tokens 2000 --quantization none
"""
import argparse, json, os, subprocess, sys, time

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, default=2000)
p.add_argument("--quantization", default="none")
p.add_argument("--rounds", type=int, default=2)
p.add_argument("--child", action="store_true")
a = p.parse_args()
if a.child:
    from pagedllm import LLM, SamplingParams
    llm = LLM(quantization=None if a.quantization == "gguf" else a.quantization, max_model_len=a.tokens + 64,
              num_gpu_blocks_override=4 * (a.tokens // 16 + 8))
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 40000 + 100 for j in range(a.tokens)]} for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompts[:1], sp, use_tqdm=False)  # warm
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    print(json.dumps({"s": time.perf_counter() - t0}))
    sys.exit(0)
res = {0: [], 1: []}
for r in range(a.rounds):
    for bi in (0, 1):
        out = subprocess.run([sys.executable, __file__, "--child", "--tokens", str(a.tokens), "--quantization",
                              a.quantization], env={**os.environ, "VLLM_BATCH_INVARIANT": str(bi)},
                             capture_output=True, text=True)
        s = json.loads(out.stdout.strip().splitlines()[-1])["s"]
        res[bi].append(s)
        print(f"round {r + 1} VLLM_BATCH_INVARIANT={bi}: 4 x {a.tokens}-token prompts in {s:.2f} s", flush=True)
print(f"best: off {min(res[0]):.2f} s, on {min(res[1]):.2f} s, on / off {min(res[1]) / min(res[0]):.2f}x")
