"""Where an FP8-KV decode step's time goes next to a bf16 one (issue 21): the same batch and contexts, pure
decode steps, kernel time by category against that category's byte/FLOP bound.

    python benchmarks/gpu/profile_fp8_decode.py SHAPE BATCH CTX_LO:CTX_HI KV [QUANT]

SHAPE: l7b (LLaMA-7B: MHA, vocab 32 000) or l8b (Llama-3-8B: GQA). KV: auto | fp8. QUANT: none | fp8.
Prompts have uniform random lengths in [CTX_LO, CTX_HI] (ShareGPT-like contexts are 50-900 tokens mid-run);
every request decodes 48 tokens after the whole batch is prefilled; steps 8..8+STEPS of the decode phase are
timed (wall, synchronised) and profiled. One JSON line per run is printed after the tables (prefix "JSON ").
"""
import json
import random
import re
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

LLAMA_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                tie_word_embeddings=False)
STEPS = 12
CATEGORIES = [  # first match wins
    ("attention", re.compile(r"_decode_kernel|_prefill_kernel|_reduce_kernel|attention", re.I)),
    ("cache write", re.compile(r"cache", re.I)),
    ("fp8 act quant", re.compile(r"quant|amax|_scaled_cast", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|sm90_|xmma|cublas|scaled_mm|matmul", re.I)),
    ("norm", re.compile(r"rms|norm", re.I)),
    ("silu/act", re.compile(r"silu|act_and_mul|gelu", re.I)),
    ("rope", re.compile(r"rope|rotary", re.I)),
    ("sampling", re.compile(r"argmax|greedy|sample|topk|softmax", re.I)),
    ("copy/fill", re.compile(r"copy|memcpy|memset|fill|cat", re.I)),
]


def category(name: str) -> str:
    return next((c for c, rx in CATEGORIES if rx.search(name)), "other")


def kernel_time(engine, steps: int, before_step=None) -> tuple[float, dict[str, float], dict[str, float]]:
    """Wall ms per step over `steps` engine steps (synchronised), then the same number profiled: kernel µs per
    step by category and by name. `before_step(i)` runs before step i (e.g. to add requests)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(steps):
        if before_step is not None:
            before_step(i)
        engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t) / steps * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            if before_step is not None:
                before_step(steps + i)
            engine.step()
        torch.cuda.synchronize()
    per_cat: dict[str, float] = {}
    per_name: dict[str, float] = {}
    for e in prof.key_averages():
        us = e.self_device_time_total / steps
        if us > 0:
            per_name[e.key] = per_name.get(e.key, 0.0) + us
            per_cat[category(e.key)] = per_cat.get(category(e.key), 0.0) + us
    return wall_ms, per_cat, per_name


def decoding_batch(shape: str, batch: int, lo: int, hi: int, kv: str, quant: str, max_tokens: int,
                   max_num_seqs: int, extra_len: int):
    """An engine (dummy weights) with `batch` requests of [lo, hi] prompt tokens, stepped until every one of them
    decodes and nobody waits → (llm, engine, rng, model config)."""
    cfg = LLAMA_7B if shape == "l7b" else dict(LLAMA3_8B)
    d = tempfile.mkdtemp()
    LlamaConfig(**cfg).save_pretrained(d)
    llm = LLM(model=d, load_format="dummy", skip_tokenizer_init=True, device="cuda", dtype="bfloat16",
              max_model_len=hi + extra_len, max_num_seqs=max_num_seqs, kv_cache_dtype=kv,
              quantization=None if quant == "none" else quant)
    engine, rng = llm.llm_engine, random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        n = rng.randint(lo, hi)
        engine.add_request(f"r{i}", {"prompt_token_ids": [rng.randrange(100, cfg["vocab_size"]) for _ in range(n)]},
                           params)
    sched = engine.scheduler
    steps = 0
    while sched.waiting or len(sched.running) < batch or any(
            s.is_prefill for g in sched.running for s in g.get_seqs()):
        engine.step()
        steps += 1
        if steps > 2000:
            raise SystemExit("batch never reached pure decode (pool too small?)")
    return llm, engine, rng, cfg


def main() -> None:
    shape, batch, ctx, kv = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    quant = sys.argv[5] if len(sys.argv) > 5 else "none"
    lo, hi = map(int, ctx.split(":"))
    llm, engine, _, cfg = decoding_batch(shape, batch, lo, hi, kv, quant, max_tokens=48, max_num_seqs=batch,
                                         extra_len=64)
    sched = engine.scheduler
    for _ in range(8):
        engine.step()
    torch.cuda.synchronize()
    ctx_tokens = sum(s.get_len() for g in sched.running for s in g.get_seqs())
    wall_ms, per_cat, per_name = kernel_time(engine, STEPS)
    # Bounds: KV bytes read by attention over the profiled steps' mean context; weight bytes + FLOPs of linears.
    mean_ctx_tokens = ctx_tokens + batch * (STEPS + STEPS // 2)
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = h // cfg["num_attention_heads"]
    kv_elem = 1 if kv.startswith("fp8") else 2
    kv_bytes = mean_ctx_tokens * layers * 2 * cfg["num_key_value_heads"] * head_dim * kv_elem
    kvd = cfg["num_key_value_heads"] * head_dim
    linear_params = layers * (h * (h + 2 * kvd) + h * h + 3 * h * cfg["intermediate_size"])
    w_elem = 1 if quant == "fp8" else 2
    bw, peak = copy_bandwidth(), measure_matmul_peak(fp8=quant == "fp8")
    lm_head = h * cfg["vocab_size"]
    gemm_bound_us = (max(linear_params * w_elem / bw, 2 * batch * linear_params / peak)
                     + max(lm_head * 2 / bw, 2 * batch * lm_head / measure_matmul_peak())) * 1e6
    attn_bound_us = kv_bytes / bw * 1e6
    gpu_ms = sum(per_cat.values()) / 1e3
    print(f"{shape} batch {batch} ctx {lo}:{hi} kv {kv} quant {quant}: wall {wall_ms:.2f} ms/step, kernels "
          f"{gpu_ms:.2f} ms/step, mean context {mean_ctx_tokens / batch:.0f} tokens, KV read {kv_bytes / 1e9:.2f} GB"
          f"/step, copy bw {bw / 1e12:.2f} TB/s, matmul peak {peak / 1e12:.0f} TFLOP/s")
    for c, us in sorted(per_cat.items(), key=lambda kv_: -kv_[1]):
        extra = ""
        if c == "attention":
            extra = f"  (KV bytes at copy bw: {attn_bound_us:.0f} µs = {attn_bound_us / us:.0%})"
        elif c == "gemm":
            extra = f"  (bound {gemm_bound_us:.0f} µs = {gemm_bound_us / us:.0%})"
        print(f"  {c:14s} {us:9.0f} µs{extra}")
    print("top kernels (µs/step):")
    for name, us in sorted(per_name.items(), key=lambda kv_: -kv_[1])[:16]:
        print(f"  {us:8.0f}  {name[:110]}")
    print("JSON " + json.dumps(dict(shape=shape, batch=batch, ctx=ctx, kv=kv, quant=quant, wall_ms=wall_ms,
                                     kernel_ms=gpu_ms, per_category_us=per_cat, attn_bound_us=attn_bound_us,
                                     gemm_bound_us=gemm_bound_us, mean_ctx=mean_ctx_tokens / batch)))


if __name__ == "__main__":
    main()
