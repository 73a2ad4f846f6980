"""Issue 18's float32 workload (64 requests, 16-256 prompt tokens, 128 output tokens) on two engines in one process,
PAGEDLLM_CPU_GEMM=onednn vs the default (native float32 GEMM for few rows), alternating: wall and step times."""
import os, time, random
import torch
import sys
from pagedllm import LLM, SamplingParams
from pagedllm.kernels import cpu_f32_gemm
if len(sys.argv) > 1:  # before the engines load their build: rows up to this many tiles on the native kernel
    cpu_f32_gemm.TILES_AVX512 = int(sys.argv[1])
engines = {}
for g in ("onednn", "auto"):
    os.environ["PAGEDLLM_CPU_GEMM"] = g
    engines[g] = LLM(quantization="none", num_gpu_blocks_override=2048, max_model_len=1024)
rng = random.Random(0)
vocab = 49152
prompts = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(rng.randint(16, 256))]} for _ in range(64)]
sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
for r in range(3):
    for g, llm in engines.items():
        t = time.perf_counter(); llm.generate(prompts, sp, use_tqdm=False); dt = time.perf_counter() - t
        print(f"round {r} {g:7s} {dt:6.2f} s  {64 * 128 / dt:6.1f} out tok/s", flush=True)
