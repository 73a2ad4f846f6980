"""Where issue 16's short workload (1000 requests, 8-64 in, 64 out, Llama-3-8B shape, dummy bf16) spends its
time: per-step wall time by kind, GPU busy time vs wall over a window of steps (torch.profiler kernel events,
overlaps merged), the top kernels, and the decode GEMMs alone against their roofline.

    python benchmarks/gpu/profile_short.py [START:STEPS,...]   (default 30:30,62:16)

MAX_NUM_SEQS (env) pins the batch; unset, the offline LLM's default for the card applies (1024 on a large GPU).
GEMM_M (env, comma-separated) picks the batch sizes of the GEMM roofline table (default 200,248,256).
"""
import os
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.kernels import copy_bandwidth
from pagedllm.benchmarks.lower_bound import measure_matmul_peak
from pagedllm.benchmarks.roofline import LLAMA3_8B
from pagedllm.benchmarks.throughput import make_workload


def busy_us(kernels: list[tuple[float, float]]) -> float:
    """Union of [start, end) intervals (µs)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(kernels):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + ((cur_e - cur_s) if cur_e is not None else 0.0)


def gemm_roofline(bw: float, peak: float) -> None:
    h, i, v = LLAMA3_8B["hidden_size"], LLAMA3_8B["intermediate_size"], LLAMA3_8B["vocab_size"]
    kv = LLAMA3_8B["num_key_value_heads"] * h // LLAMA3_8B["num_attention_heads"]
    shapes = {"qkv": (h, h + 2 * kv), "o": (h, h), "gate_up": (h, 2 * i), "down": (i, h), "lm_head": (h, v)}
    for m in (int(x) for x in os.environ.get("GEMM_M", "200,248,256").split(",")):
        line = []
        for name, (k, n) in shapes.items():
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                torch.nn.functional.linear(a, w)
            torch.cuda.synchronize()
            reps = 50
            t = time.perf_counter()
            for _ in range(reps):
                torch.nn.functional.linear(a, w)
            torch.cuda.synchronize()
            us = (time.perf_counter() - t) / reps * 1e6
            bound = max(2 * n * k / bw, 2 * m * n * k / peak) * 1e6
            line.append(f"{name} {us:.0f} µs ({bound / us:.0%})")
        print(f"M={m}: " + ", ".join(line))


if __name__ == "__main__":
    windows = dict(tuple(map(int, w.split(":"))) for w in (sys.argv[1] if len(sys.argv) > 1 else "30:30,62:16").split(","))
    d = tempfile.mkdtemp()
    LlamaConfig(**LLAMA3_8B).save_pretrained(d)
    llm = LLM(model=d, load_format="dummy", skip_tokenizer_init=True, device="cuda", dtype="bfloat16",
              max_model_len=2048, max_num_seqs=int(os.environ["MAX_NUM_SEQS"]) if "MAX_NUM_SEQS" in os.environ else None)
    engine = llm.llm_engine
    wl = make_workload(1000, 8, 64, 64, LLAMA3_8B["vocab_size"], 0)
    for i, (p, n) in enumerate(zip(wl.prompts, wl.output_len)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=n,
                                                                            ignore_eos=True))
    walls, step = [], 0
    t_all = time.perf_counter()
    prof = None
    while engine.has_unfinished_requests():
        if step in windows:
            start, window = step, windows[step]
            torch.cuda.synchronize()
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
            t_win = time.perf_counter()
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
        step += 1
        if prof is not None and step == start + window:
            torch.cuda.synchronize()
            win_s = time.perf_counter() - t_win
            prof.__exit__(None, None, None)
            kern = [(e.time_range.start, e.time_range.end) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA]
            busy = busy_us(kern)
            print(f"window steps {start}..{start + window}: wall {win_s * 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms "
                  f"({busy / 1e3 / (win_s * 1e3):.1%}), {len(kern)} kernels")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=70))
            prof = None
    torch.cuda.synchronize()
    total = time.perf_counter() - t_all
    print(f"whole run {total:.2f} s in {step} steps; step() wall sum {sum(walls):.2f} s; "
          f"first steps (ms): {[round(w * 1e3, 1) for w in walls[:12]]}")
    print("every step (ms):", " ".join(f"{w * 1e3:.1f}" for w in walls))
    srt = sorted(walls)
    print(f"step wall ms: median {srt[len(srt) // 2] * 1e3:.2f}, p90 {srt[int(len(srt) * 0.9)] * 1e3:.2f}, "
          f"max {srt[-1] * 1e3:.2f}")
    gemm_roofline(copy_bandwidth(), measure_matmul_peak())
