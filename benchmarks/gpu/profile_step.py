"""Where a decode step's time goes (Llama-3-8B shape, dummy bf16, context 1024): wall time per step,
GPU kernel time per step (torch.profiler), the top kernels, and a cProfile of the host side.

    python benchmarks/gpu/profile_step.py 64
"""
import random
import sys
import tempfile
import time

import torch
from transformers import LlamaConfig

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.roofline import LLAMA3_8B
from step_profile import print_step_profile

if __name__ == "__main__":
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    d = tempfile.mkdtemp()
    LlamaConfig(**LLAMA3_8B).save_pretrained(d)
    llm = LLM(model=d, load_format="dummy", skip_tokenizer_init=True, device="cuda", max_model_len=2048,
              max_num_seqs=batch, max_num_batched_tokens=16384)
    engine, rng = llm.llm_engine, random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", {"prompt_token_ids": [rng.randrange(100, 128000) for _ in range(1024)]}, params)
    for _ in range(12):
        engine.step()
    torch.cuda.synchronize()
    n = 20
    t = time.perf_counter()
    for _ in range(n):
        engine.step()
    torch.cuda.synchronize()
    print(f"batch {batch}: {(time.perf_counter() - t) / n * 1e3:.2f} ms/step wall")
    print_step_profile(engine.step, n)
