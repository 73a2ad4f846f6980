"""Issue 16 A/B: the model runner hands the sampler logits in the model's dtype on CUDA (`sampler_logits`) or, as
before, a float32 copy. Runs benchmarks/throughput.py with the given arguments in either mode (the sampler's warm-up
follows the mode, so neither pays a kernel compile in its run).

    python benchmarks/gpu/sampler_logits_ab.py {model|float32} <throughput.py arguments>
"""
import runpy
import sys

import torch

import pagedllm.engine.llm_engine as llm_engine
import pagedllm.worker.model_runner as model_runner

mode = sys.argv.pop(1)
if mode == "float32":
    model_runner.sampler_logits = lambda logits: logits.float()
    warm_up = llm_engine.warm_up_sampler
    llm_engine.warm_up_sampler = lambda sampler, vocab, device, dtype=None: warm_up(sampler, vocab, device, torch.float32)
elif mode != "model":
    raise SystemExit(f"mode must be 'model' or 'float32', got {mode!r}")
sys.argv = ["benchmarks/throughput.py", *sys.argv[1:]]
runpy.run_path("benchmarks/throughput.py", run_name="__main__")
