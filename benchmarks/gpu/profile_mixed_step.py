"""Where a mixed step's time goes (issue 21): in the ShareGPT-like FP8 runs a third of the wall time is steps that
carry prompt tokens next to ~300 decode rows (§37). This builds such steps on purpose: BATCH sequences decode at
contexts in [CTX_LO, CTX_HI]; then, before each timed step, NEW prompts of PLEN tokens arrive, so every timed step
carries BATCH decode rows + NEW × PLEN prompt tokens. Decode-only steps of the same batch are timed first, so the
mixed step's extra time can be set against the prompt tokens' FLOPs at the measured matmul peak.

    python benchmarks/gpu/profile_mixed_step.py SHAPE BATCH CTX_LO:CTX_HI KV NEW PLEN [QUANT]

SHAPE l7b | l8b, KV auto | fp8, QUANT none | fp8 (as profile_fp8_decode.py). One JSON line at the end ("JSON ").
"""
import json
import random
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.lower_bound import measure_matmul_peak
from pagedllm.benchmarks.roofline import LLAMA3_8B

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from profile_fp8_decode import LLAMA_7B, category  # noqa: E402

STEPS = 10


def kernel_time(engine, steps: int, before_step) -> tuple[float, dict[str, float], dict[str, float]]:
    """Wall ms per step over `steps` steps (synchronised), then the same number profiled: kernel µs per step by
    category and by name."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(steps):
        before_step(i)
        engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t) / steps * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
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


def main() -> None:
    shape, batch, ctx, kv = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    new, plen = int(sys.argv[5]), int(sys.argv[6])
    quant = sys.argv[7] if len(sys.argv) > 7 else "none"
    lo, hi = map(int, ctx.split(":"))
    cfg = LLAMA_7B if shape == "l7b" else dict(LLAMA3_8B)
    d = tempfile.mkdtemp()
    LlamaConfig(**cfg).save_pretrained(d)
    llm = LLM(model=d, load_format="dummy", skip_tokenizer_init=True, device="cuda", dtype="bfloat16",
              max_model_len=hi + 128, max_num_seqs=batch + 4 * STEPS * new, kv_cache_dtype=kv,
              quantization=None if quant == "none" else quant)
    engine, rng = llm.llm_engine, random.Random(0)
    vocab = cfg["vocab_size"]
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    for i in range(batch):
        n = rng.randint(lo, hi)
        engine.add_request(f"r{i}", {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(n)]}, params)
    sched = engine.scheduler
    steps = 0
    while sched.waiting or any(s.is_prefill for g in sched.running for s in g.get_seqs()):
        engine.step()
        steps += 1
        if steps > 2000:
            raise SystemExit("batch never reached pure decode (pool too small?)")
    for _ in range(4):
        engine.step()
    dec_wall, dec_cat, _ = kernel_time(engine, STEPS, lambda i: None)
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)  # leave soon: the batch stays ~BATCH

    def arrive(i: int) -> None:
        for j in range(new):
            engine.add_request(f"n{i}_{j}", {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(plen)]},
                               short)

    mix_wall, mix_cat, mix_names = kernel_time(engine, STEPS, arrive)
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    kvd = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    linear_params = layers * (h * (h + 2 * kvd) + h * h + 3 * h * cfg["intermediate_size"])
    peak = measure_matmul_peak(fp8=quant == "fp8")
    prompt_flop_ms = 2 * new * plen * linear_params / peak * 1e3
    dec_ms, mix_ms = sum(dec_cat.values()) / 1e3, sum(mix_cat.values()) / 1e3
    print(f"{shape} kv {kv} quant {quant}: {batch} decode rows at ctx {lo}:{hi}; mixed steps add {new} × {plen} "
          f"prompt tokens; matmul peak {peak / 1e12:.0f} TFLOP/s")
    print(f"  decode-only step: wall {dec_wall:.2f} ms, kernels {dec_ms:.2f} ms")
    print(f"  mixed step:       wall {mix_wall:.2f} ms, kernels {mix_ms:.2f} ms; extra over decode-only "
          f"{mix_wall - dec_wall:.2f} ms wall / {mix_ms - dec_ms:.2f} ms kernels, against the prompt tokens' "
          f"linear FLOPs at the peak {prompt_flop_ms:.2f} ms")
    print("  kernel ms per step by category (decode-only → mixed):")
    for c in sorted(set(dec_cat) | set(mix_cat), key=lambda c: -mix_cat.get(c, 0.0)):
        print(f"    {c:14s} {dec_cat.get(c, 0.0) / 1e3:7.2f} → {mix_cat.get(c, 0.0) / 1e3:7.2f}")
    print("  top kernels of the mixed step (µs/step):")
    for name, us in sorted(mix_names.items(), key=lambda kv_: -kv_[1])[:18]:
        print(f"    {us:8.0f}  {name[:110]}")
    print("JSON " + json.dumps(dict(shape=shape, batch=batch, ctx=ctx, kv=kv, quant=quant, new=new, plen=plen,
                                     decode_wall_ms=dec_wall, decode_kernel_ms=dec_ms, mixed_wall_ms=mix_wall,
                                     mixed_kernel_ms=mix_ms, prompt_flop_ms=prompt_flop_ms,
                                     decode_per_category_us=dec_cat, mixed_per_category_us=mix_cat)))


if __name__ == "__main__":
    main()
