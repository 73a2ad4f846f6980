"""Where a mixed step's time goes (issue 21): in the ShareGPT-like FP8 runs a third of the wall time is steps that
carry prompt tokens next to ~300 decode rows (§37). This builds such steps on purpose: BATCH sequences decode at
contexts in [CTX_LO, CTX_HI]; then, before each timed step, NEW prompts of PLEN tokens arrive, so every timed step
carries BATCH decode rows + NEW × PLEN prompt tokens. Decode-only steps of the same batch are timed first, so the
mixed step's extra time can be set against the prompt tokens' FLOPs at the measured matmul peak.

    python benchmarks/gpu/profile_mixed_step.py SHAPE BATCH CTX_LO:CTX_HI KV NEW PLEN [QUANT]

SHAPE l7b | l8b, KV auto | fp8, QUANT none | fp8 (as profile_fp8_decode.py). One JSON line at the end ("JSON ").
"""
import json
import sys

import torch

from pagedllm import SamplingParams
from pagedllm.benchmarks.lower_bound import measure_matmul_peak

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from profile_fp8_decode import decoding_batch, kernel_time  # noqa: E402

STEPS = 10


def main() -> None:
    shape, batch, ctx, kv = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    new, plen = int(sys.argv[5]), int(sys.argv[6])
    quant = sys.argv[7] if len(sys.argv) > 7 else "none"
    lo, hi = map(int, ctx.split(":"))
    llm, engine, rng, cfg = decoding_batch(shape, batch, lo, hi, kv, quant, max_tokens=100,
                                           max_num_seqs=batch + 4 * STEPS * new, extra_len=128)
    vocab = cfg["vocab_size"]
    for _ in range(4):
        engine.step()
    clocks: dict[str, list[tuple[int, float]]] = {"decode": [], "mixed": []}

    def sample_clock(phase: str) -> None:
        """SM clock (MHz) and power (W) while the previous step runs: is a GEMM-heavy mixed step clocked lower?"""
        try:
            clocks[phase].append((torch.cuda.clock_rate(), torch.cuda.power_draw() / 1e3))
        except Exception:  # no NVML here
            pass

    dec_wall, dec_cat, dec_names = kernel_time(engine, STEPS, lambda i: sample_clock("decode"))
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)  # leave soon: the batch stays ~BATCH

    def arrive(i: int) -> None:
        sample_clock("mixed")
        for j in range(new):
            engine.add_request(f"n{i}_{j}", {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(plen)]},
                               short)

    mix_wall, mix_cat, mix_names = kernel_time(engine, STEPS, arrive)
    # Is the decode kernel slower inside mixed steps because of the step around it, or because it is launched
    # eagerly between piecewise graphs? Decode-only steps through the piecewise path, then through the decode
    # graphs again (the contexts grew meanwhile: the two graph phases bracket that growth).
    runner = engine.executor.driver_worker.model_runner
    decode_graphs, runner.graph_runner = runner.graph_runner, None
    pw_wall, pw_cat, pw_names = kernel_time(engine, STEPS)
    runner.graph_runner = decode_graphs
    dec2_wall, dec2_cat, dec2_names = kernel_time(engine, STEPS)
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
    decode_kernel_us = {phase: names.get("_decode_kernel", 0.0) for phase, names in (
        ("decode graphs", dec_names), ("mixed (piecewise)", mix_names), ("decode-only piecewise", pw_names),
        ("decode graphs again", dec2_names))}
    print(f"  decode-only through the piecewise path: wall {pw_wall:.2f} ms; through the graphs again: {dec2_wall:.2f} ms")
    print("  _decode_kernel µs per step: " + ", ".join(f"{k} {v:.0f}" for k, v in decode_kernel_us.items()))
    for phase, rows in clocks.items():
        if rows:
            print(f"  {phase} steps: SM clock {sum(c for c, _ in rows) / len(rows):.0f} MHz "
                  f"(min {min(c for c, _ in rows)}), power {sum(w for _, w in rows) / len(rows):.0f} W")
    print("  kernel ms per step by category (decode-only → mixed):")
    for c in sorted(set(dec_cat) | set(mix_cat), key=lambda c: -mix_cat.get(c, 0.0)):
        print(f"    {c:14s} {dec_cat.get(c, 0.0) / 1e3:7.2f} → {mix_cat.get(c, 0.0) / 1e3:7.2f}")
    print("  top kernels of the mixed step (µs/step):")
    for name, us in sorted(mix_names.items(), key=lambda kv_: -kv_[1])[:18]:
        print(f"    {us:8.0f}  {name[:110]}")
    print("JSON " + json.dumps(dict(shape=shape, batch=batch, ctx=ctx, kv=kv, quant=quant, new=new, plen=plen,
                                     decode_wall_ms=dec_wall, decode_kernel_ms=dec_ms, mixed_wall_ms=mix_wall,
                                     mixed_kernel_ms=mix_ms, prompt_flop_ms=prompt_flop_ms,
                                     decode_per_category_us=dec_cat, mixed_per_category_us=mix_cat,
                                     clocks_mhz_watts=clocks, decode_kernel_us=decode_kernel_us,
                                     decode_piecewise_wall_ms=pw_wall, decode_again_wall_ms=dec2_wall)))


if __name__ == "__main__":
    main()
