"""Fig. 17: chatbot — each request's prompt is a conversation history truncated to its last 1024 tokens.

A history is 1-10 earlier ShareGPT-like turns (prompt + answer lengths of the synthetic trace) plus the new
user message, of which the last 1024 tokens are kept; the answer is a ShareGPT-like output length capped at
1024 (`ignore_eos`, true length). Small scale: x1/8 (last 128 tokens, answers <= 128, block 2). Paged vs
the three Orca managers on the same requests and Poisson rates; one sustained-rate rule.
Paper (OPT-13B, Fig. 17): vLLM sustains 2x the rate of all three Orca baselines (long prompts make
every reservation large, so they behave alike).
"""
from __future__ import annotations

import logging
import os
import random

from pagedllm.benchmarks.paper import common, rated
from pagedllm.benchmarks.paper.workloads import TRACES, TraceRequest, random_prompt

logger = logging.getLogger("pagedllm.bench.paper")
SYSTEMS = ["paged", "orca-oracle", "orca-pow2", "orca-max"]
RATES = {"small": [4, 6, 8, 12, 16, 24, 32, 48, 64], "paper": [0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4]}
HISTORY, ANSWER = 1024, 1024  # paper: last 1024 tokens of history, at most 1024 output tokens


def chat_trace(n: int, vocab: int, scale: float, seed: int) -> list[TraceRequest]:
    spec = TRACES["sharegpt"].scaled(scale)
    rng = random.Random(seed)
    keep, cap = round(HISTORY * scale), round(ANSWER * scale)
    reqs = []
    for i in range(n):
        turns = rng.randint(1, 10)
        hist = sum(spec.input.sample(rng, turns)) + sum(spec.output.sample(rng, turns - 1))
        out = min(cap, spec.output.sample(rng, 1)[0])
        reqs.append(TraceRequest(f"chat-{i}", 0.0, random_prompt(rng, min(keep, hist), vocab), out))
    return reqs


def run(args) -> dict:
    scale = common.SCALES[args.scale].length_scale
    with common.EngineCache(args) as engines:
        reqs = chat_trace(args.num_requests or 100, common.vocab_of(engines.get("paged")), scale, args.seed)
        cfgs = {s: rated.Config(s) for s in (args.systems or SYSTEMS) if s in SYSTEMS}
        per = rated.sweep_configs(args, cfgs, reqs, args.rates or RATES[args.scale], "fig17", engines)
    data = {"scale": args.scale, "num_requests": len(reqs), "sustained_rule": common.SUSTAINED_RULE,
            "engine_builds": engines.num_builds,
            "mean_input": sum(len(r.prompt_token_ids) for r in reqs) / len(reqs),
            "mean_output": sum(r.output_len for r in reqs) / len(reqs),
            "truncated_to": round(HISTORY * scale), "systems": per,
            "paged_over": {s: rated.ratio(per, "paged", s) for s in per if s != "paged" and "paged" in per}}
    common.write_json(os.path.join(args.output_dir, "fig17.json"), data)
    write_outputs(args.output_dir, data)
    return data


def write_outputs(out_dir: str, data: dict) -> None:
    rated.plot_panels(os.path.join(out_dir, "fig17.png"), {"chatbot": data["systems"]},
                      f"Fig. 17: chatbot (history truncated to {data['truncated_to']} tokens, {data['scale']} scale)",
                      common.STYLE, common.LABELS)
    text = (f"# fig17\n\nChatbot, {data['num_requests']} requests, history truncated to the last "
            f"{data['truncated_to']} tokens (mean prompt {data['mean_input']:.1f}, mean answer "
            f"{data['mean_output']:.1f} tokens), {data['scale']} scale. Sustained rate: {data['sustained_rule']}.\n\n"
            + common.md_table(rated.RATE_HEADER, rated.rate_rows(data["systems"], common.LABELS))
            + "\npaged ÷ baseline, sustained rate: " + ", ".join(f"{common.LABELS[s]} {r}×" for s, r in
                                                                data["paged_over"].items())
            + "  (paper: 2× all three Orca baselines)\n")
    with open(os.path.join(out_dir, "fig17.md"), "w") as f:
        f.write(text)
    print(text, flush=True)
