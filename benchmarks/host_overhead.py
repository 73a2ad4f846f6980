"""The engine's host work per step at large batch (issues 16, 21): the real engine (scheduler, block manager,
input staging, sampler, output building) with a one-layer model of tiny width on the CPU, so nearly all that is
timed is the Python that, on a GPU, must hide under the device's step (async scheduling overlaps the two; once
the host's share of a step exceeds the device's, the GPU idles).

    python benchmarks/host_overhead.py [--num-prompts 1000] [--dataset uniform|sharegpt-like] [--rounds 3]
        [--output-kinds final_only cumulative delta]

Prints, per round, the `generate` wall time, the host milliseconds per step of each phase (schedule, the
forward's input staging and launch, sampling launch, completing a step: appending tokens, stop checks, outputs),
and the tiny model's own time, which on a GPU is the device's. `--output-kinds` runs the same requests with each
RequestOutputKind in turn (rounds interleaved) and prints each kind's host time per step against the first's:
``final_only`` is `LLM.generate`; ``cumulative`` and ``delta`` drive `LLMEngine.step()` and read every output, as a
streaming caller does (a cumulative output copies each completion's tokens so far: O(length) per request per step).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import tempfile
import time

from transformers import LlamaConfig

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.throughput import make_sharegpt_like, make_workload
from pagedllm.sampling_params import RequestOutputKind

TINY_VOCAB = 512
PHASES = {  # (attribute path from the engine, method) -> label
    ("scheduler", "schedule"): "schedule",
    ("", "_launch_forward"): "launch forward (incl. model)",
    ("executor", "execute_model"): "model (staging + tiny forward)",
    ("", "_launch_sampling"): "launch sampling",
    ("", "_complete_step"): "complete step",
}


def instrument(engine, totals: collections.Counter, counts: collections.Counter) -> None:
    """Wrap each phase's method on its instance so every call adds its wall time to `totals`."""
    for (path, name), label in PHASES.items():
        owner = getattr(engine, path) if path else engine
        inner = getattr(owner, name)

        def timed(*a, _inner=inner, _label=label, **kw):
            t = time.perf_counter()
            try:
                return _inner(*a, **kw)
            finally:
                totals[_label] += time.perf_counter() - t
                counts[_label] += 1

        setattr(owner, name, functools.wraps(inner)(timed))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--dataset", choices=["uniform", "sharegpt-like"], default="uniform")
    p.add_argument("--input-len-min", type=int, default=8)
    p.add_argument("--input-len-max", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-kinds", nargs="+", choices=["final_only", "cumulative", "delta"], default=["final_only"])
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    wl = (make_sharegpt_like(args.num_prompts, 32000, 0) if args.dataset == "sharegpt-like" else
          make_workload(args.num_prompts, args.input_len_min, args.input_len_max, args.output_len, 32000, 0))
    prompts = [{"prompt_token_ids": [t % TINY_VOCAB for t in pr]} for pr in wl.prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in wl.output_len]
    d = tempfile.mkdtemp()
    LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=args.max_model_len,
                ).save_pretrained(d)
    llm = LLM(model=d, load_format="dummy", skip_tokenizer_init=True, device="cpu", dtype="float32",
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=8192,
              async_scheduling=True, swap_space=0)
    totals: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    instrument(llm.llm_engine, totals, counts)
    llm.generate(prompts[:8], params[:8], use_tqdm=False)
    print(f"workload: {len(prompts)} requests ({args.dataset}), {sum(map(len, wl.prompts))} prompt / "
          f"{sum(wl.output_len)} output tokens; max_num_seqs {args.max_num_seqs}")
    rounds = {kind: [] for kind in args.output_kinds}
    for r in range(args.rounds):
        for kind in args.output_kinds:
            totals.clear()
            counts.clear()
            t0 = time.perf_counter()
            if kind == "final_only":
                llm.generate(prompts, params, use_tqdm=False)
            else:
                drive_steps(llm.llm_engine, prompts, params, RequestOutputKind[kind.upper()], r)
            wall = time.perf_counter() - t0
            steps = counts["schedule"]
            model = totals["model (staging + tiny forward)"]
            per_step = {k: 1e3 * v / steps for k, v in totals.items()}
            host = wall - model
            rounds[kind].append({"wall_s": wall, "steps": steps, "host_ms_per_step": 1e3 * host / steps,
                                 "phase_ms_per_step": per_step})
            print(f"round {r} {kind}: wall {wall:.3f} s, {steps} steps, host (wall - model) "
                  f"{1e3 * host / steps:.2f} ms/step; " + ", ".join(f"{k} {v:.2f}" for k, v in per_step.items()),
                  flush=True)
    first = min(rounds[args.output_kinds[0]], key=lambda x: x["wall_s"])
    for kind, rs in rounds.items():
        best = min(rs, key=lambda x: x["wall_s"])
        print(f"{kind}: best round wall {best['wall_s']:.3f} s, host {best['host_ms_per_step']:.2f} ms per step"
              + (f" ({best['host_ms_per_step'] / first['host_ms_per_step']:.2f}x {args.output_kinds[0]}'s)"
                 if kind != args.output_kinds[0] else ""))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "rounds": rounds}, f, indent=1)


def drive_steps(engine, prompts: list[dict], params: list[SamplingParams], kind: RequestOutputKind, r: int) -> int:
    """Every request added, then `engine.step()` until done, reading each output's new tokens as a streaming
    caller would; returns the output tokens read (a check that both kinds delivered the same amount)."""
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"{kind.name}-{r}-{i}", prompt, dataclasses.replace(sp, output_kind=kind))
    seen: dict[str, int] = {}
    total = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            n = len(out.outputs[0].token_ids)
            if kind == RequestOutputKind.DELTA:
                total += n
            else:
                total += n - seen.get(out.request_id, 0)
                seen[out.request_id] = n
    return total


if __name__ == "__main__":
    main()
