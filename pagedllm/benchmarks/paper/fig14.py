"""Fig. 14: parallel sampling (n = 2, 4, 6) and beam search (width 2, 4, 6), paged vs Orca (Oracle).

The Alpaca-like trace (the paper's Fig. 14 workload), Poisson arrivals; every request asks for n sampled
outputs (temperature 1, seeded) or a beam search of width k, with `ignore_eos` and its true output length.
Paged shares the prompt's blocks between the n sequences (and beams share their common prefix, copy on
write); Orca (Oracle) reserves prompt + output for every sequence of the group. One sustained-rate rule
(common.sustained_rate) per panel, reference the panel's lowest lowest-rate latency.
Paper (OPT-13B, Alpaca): the gain over Orca (Oracle) grows with n and beam width; beam 6: 2.3x.
"""
from __future__ import annotations

import logging
import os

from pagedllm.benchmarks.paper import common, rated
from pagedllm.benchmarks.paper.fig12 import trace_requests

logger = logging.getLogger("pagedllm.bench.paper")
WIDTHS = [2, 4, 6]
RATES = {"small": [32, 48, 64, 96, 128, 192, 256, 384, 512, 768], "paper": [0.5, 1, 2, 3, 4, 6, 8, 12, 16]}
PAPER = "the paged gain over Orca (Oracle) grows with n and beam width (beam width 6: 2.3x higher rate)"


def params_for(method: str, width: int):
    from pagedllm import SamplingParams

    def make(r):
        if method == "parallel":
            # no per-request seed: a seeded request samples through its own generator, one at a time,
            # which on a CPU costs more than the step; the engine's seed keeps the run reproducible
            return SamplingParams(n=width, temperature=1.0, max_tokens=r.output_len, ignore_eos=True)
        return SamplingParams(n=width, best_of=width, use_beam_search=True, temperature=0.0,
                              max_tokens=r.output_len, ignore_eos=True)

    return make


def run(args) -> dict:
    trace = (args.traces or ["alpaca"])[0]
    widths = getattr(args, "widths", None) or WIDTHS
    data: dict = {"scale": args.scale, "trace": trace, "sustained_rule": common.SUSTAINED_RULE, "panels": {}}
    with common.EngineCache(args) as engines:
        reqs = trace_requests(args, engines.get("paged"), trace)
        data["num_requests"] = len(reqs)
        rates = args.rates or RATES[args.scale]
        for method, w in ((m, w) for m in ("parallel", "beam") for w in widths):
            name = f"{method} {'n' if method == 'parallel' else 'width'}={w}"
            cfgs = {s: rated.Config(s, params=params_for(method, w)) for s in ("paged", "orca-oracle")}
            per = rated.sweep_configs(args, cfgs, reqs, rates, f"fig14 {name}", engines)
            data["panels"][name] = {"method": method, "width": w, "systems": per,
                                    "paged_over_oracle": rated.ratio(per, "paged", "orca-oracle")}
            logger.info("fig14 %s: paged sustains %s req/s, Orca (Oracle) %s: %s×", name,
                        per["paged"]["sustained_rate"], per["orca-oracle"]["sustained_rate"],
                        data["panels"][name]["paged_over_oracle"])
            common.write_json(os.path.join(args.output_dir, "fig14.json"), data)
        data["engine_builds"] = engines.num_builds
    common.write_json(os.path.join(args.output_dir, "fig14.json"), data)
    write_outputs(args.output_dir, data)
    return data


def write_outputs(out_dir: str, data: dict) -> None:
    panels = {n: p["systems"] for n, p in data["panels"].items()}
    rated.plot_panels(os.path.join(out_dir, "fig14.png"), panels,
                      f"Fig. 14: parallel sampling and beam search ({data['trace']}-like, {data['scale']} scale)",
                      common.STYLE, common.LABELS)
    head = (f"# fig14\n\n{data['trace']}-like trace, {data['num_requests']} requests per point, {data['scale']} "
            f"scale. Sustained rate: {data['sustained_rule']}, per panel.\n\n")
    lines = [head,
             common.md_table(["panel", "paged sustained (req/s)", "Orca (Oracle) sustained", "paged ÷ Oracle"],
                             [[n, common.fmt(p["systems"]["paged"]["sustained_rate"]),
                               common.fmt(p["systems"]["orca-oracle"]["sustained_rate"]), p["paged_over_oracle"] + "×"]
                              for n, p in data["panels"].items()]),
             f"\nPaper: {PAPER}.\n"]
    for n, p in data["panels"].items():
        lines += [f"\n**{n}**\n\n", common.md_table(rated.RATE_HEADER, rated.rate_rows(p["systems"], common.LABELS))]
    text = "".join(lines)
    with open(os.path.join(out_dir, "fig14.md"), "w") as f:
        f.write(text)
    print(text, flush=True)
