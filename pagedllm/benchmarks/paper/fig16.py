"""Fig. 16: a shared prefix (1-shot / 5-shot translation-style prompts), prefix caching on vs off vs Orca.

Every request is prefix + its own sentence (16-48 tokens) and asks for a 16-48-token translation
(`ignore_eos`, true length); the 1-shot prefix is 80 tokens, the 5-shot 341 (as benchmarks/sharing.py,
the paper's WMT16 prompts in size). Configurations on the same requests and Poisson rates: paged with
automatic prefix caching (the prefix's blocks are shared, computed once), paged without, Orca (Oracle).
Small scale: lengths x1/4 with block 4 (the same in blocks). Paper (LLaMA-13B, Fig. 16): vLLM sustains
1.67x Orca (Oracle) with the 1-shot prefix and 3.58x with the 5-shot one.
"""
from __future__ import annotations

import logging
import os
import random

from pagedllm.benchmarks.paper import common, rated
from pagedllm.benchmarks.paper.workloads import TraceRequest, random_prompt

logger = logging.getLogger("pagedllm.bench.paper")
SHOTS = {1: 80, 5: 341}
SCALE = {"small": 0.25, "paper": 1.0}
RATES = {"small": [32, 48, 64, 96, 128, 192, 256, 384, 512, 768], "paper": [1, 2, 4, 6, 8, 12, 16, 24, 32]}
PAPER = {1: "1.67x", 5: "3.58x"}
LABELS = {"prefix-caching": "paged + prefix caching", "paged": "paged, no prefix caching",
          "orca-oracle": "Orca (Oracle)"}


def prefix_trace(shots: int, n: int, vocab: int, scale: float, seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    prefix = random_prompt(rng, max(1, round(SHOTS[shots] * scale)), vocab)
    lo, hi = max(1, round(16 * scale)), max(2, round(48 * scale))
    return [TraceRequest(f"{shots}shot-{i}", 0.0, prefix + random_prompt(rng, rng.randint(lo, hi), vocab),
                         rng.randint(lo, hi)) for i in range(n)]


def run(args) -> dict:
    scale = SCALE[args.scale]
    bs = max(1, round(16 * scale))
    data: dict = {"scale": args.scale, "length_scale": scale, "block_size": bs, "sustained_rule": common.SUSTAINED_RULE,
                  "panels": {}}
    with common.EngineCache(args) as engines:
        vocab = common.vocab_of(engines.get("paged", block_size=bs))
        for shots in getattr(args, "shots", None) or [1, 5]:
            reqs = prefix_trace(shots, args.num_requests or 100, vocab, scale, args.seed)
            cfgs = {"prefix-caching": rated.Config("paged", {"block_size": bs, "prefix_caching": True}),
                    "paged": rated.Config("paged", {"block_size": bs}),
                    "orca-oracle": rated.Config("orca-oracle", {"block_size": bs})}
            per = rated.sweep_configs(args, cfgs, reqs, args.rates or RATES[args.scale], f"fig16 {shots}-shot", engines)
            data["panels"][f"{shots}-shot"] = {
                "prefix_len": max(1, round(SHOTS[shots] * scale)), "num_requests": len(reqs), "systems": per,
                "caching_over_oracle": rated.ratio(per, "prefix-caching", "orca-oracle"),
                "caching_over_paged": rated.ratio(per, "prefix-caching", "paged"), "paper_over_oracle": PAPER[shots]}
            common.write_json(os.path.join(args.output_dir, "fig16.json"), data)
        data["engine_builds"] = engines.num_builds
    common.write_json(os.path.join(args.output_dir, "fig16.json"), data)
    write_outputs(args.output_dir, data)
    return data


def write_outputs(out_dir: str, data: dict) -> None:
    panels = {n: p["systems"] for n, p in data["panels"].items()}
    styles = {"prefix-caching": ("tab:red", "o"), "paged": ("tab:orange", "D"), "orca-oracle": ("tab:blue", "s")}
    rated.plot_panels(os.path.join(out_dir, "fig16.png"), panels,
                      f"Fig. 16: shared prefix ({data['scale']} scale, lengths x{data['length_scale']:g}, block "
                      f"{data['block_size']})", styles, LABELS)
    head = (f"# fig16\n\nShared few-shot prefix, {data['scale']} scale (lengths x{data['length_scale']:g}, block "
            f"{data['block_size']}). Sustained rate: {data['sustained_rule']}, per panel.\n\n")
    lines = [head,
             common.md_table(["prefix", "caching on", "caching off", "Orca (Oracle)", "on ÷ Oracle", "on ÷ off",
                              "paper: vLLM ÷ Oracle"],
                             [[n, *(common.fmt(p["systems"][c]["sustained_rate"]) for c in LABELS),
                               p["caching_over_oracle"] + "×", p["caching_over_paged"] + "×", p["paper_over_oracle"]]
                              for n, p in data["panels"].items()])]
    for n, p in data["panels"].items():
        lines += [f"\n**{n}**\n\n", common.md_table(rated.RATE_HEADER, rated.rate_rows(p["systems"], LABELS))]
    text = "".join(lines)
    with open(os.path.join(out_dir, "fig16.md"), "w") as f:
        f.write(text)
    print(text, flush=True)
