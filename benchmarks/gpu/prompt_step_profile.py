"""Where the host's time goes in a prompt step (bundled model, CUDA): each of --num-prompts copy prompts is
added alone and its prompt step (the first `step()` after `add_request`, launched without waiting) is timed
and profiled with cProfile; then the request runs out. Prints the mean host ms of the prompt step, the
device ms of its forward pass (CUDA events), and the top functions by own time.

    python benchmarks/gpu/prompt_step_profile.py --num-prompts 30 --dtype bfloat16
"""
import argparse
import cProfile
import pstats
import time

import torch

from pagedllm.benchmarks.copy_prompts import make_copy_prompts
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-prompts", type=int, default=30)
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args()
    eng = LLMEngine(EngineArgs(dtype=a.dtype, max_model_len=2048, num_gpu_blocks_override=8192, max_num_seqs=64))
    prompts = make_copy_prompts(eng.tokenizer, a.num_prompts + 2)
    params = SamplingParams(temperature=0, max_tokens=4)
    prof = cProfile.Profile()
    host, device = [], []
    for i, prompt in enumerate(prompts):
        eng.add_request(f"p{i}", {"prompt_token_ids": prompt}, params)
        torch.cuda.synchronize()
        s0, e0 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s0.record()
        t0 = time.perf_counter()
        if i >= 2:
            prof.enable()
        eng.step()
        if i >= 2:
            prof.disable()
            host.append(time.perf_counter() - t0)
        e0.record()
        e0.synchronize()
        if i >= 2:
            device.append(s0.elapsed_time(e0))
        while eng.has_unfinished_requests():
            eng.step()
    lens = [len(x) for x in prompts[2:]]
    print(f"prompt tokens {min(lens)}-{max(lens)} (mean {sum(lens) / len(lens):.0f}); prompt step host ms "
          f"{1e3 * sum(host) / len(host):.3f}, device ms (launch to done) {sum(device) / len(device):.3f}")
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
