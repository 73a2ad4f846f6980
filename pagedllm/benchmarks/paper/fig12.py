"""Fig. 12 (normalized latency vs request rate) and Fig. 13 (mean batched requests), five systems, two traces.

Every system runs in this engine (same model code, kernels and scheduler loop); only the KV manager
and the batching differ (common.SYSTEMS). Each point replays the same seeded requests with Poisson
arrivals at one rate; normalized latency = mean over requests of (finish − arrival) ÷ output length.
``sustained_rate`` follows common.sustained_rate: the highest rate whose normalized latency stays
<= 2x the trace's unloaded latency (the lowest lowest-rate value over all systems). A system whose lowest
measured rate is already over it gets 0 and ``sustained_below_lowest_rate``: the ratio is then a bound.
"""
from __future__ import annotations

import logging
import os

from pagedllm.benchmarks.paper import common
from pagedllm.benchmarks.paper.sweep import sweep_system
from pagedllm.benchmarks.paper.workloads import TRACES, make_trace

logger = logging.getLogger("pagedllm.bench.paper")
RATES = {  # default request rates (req/s) per scale and trace
    ("small", "sharegpt"): [4, 8, 16, 32, 64, 128],
    ("small", "alpaca"): [16, 32, 64, 128, 256, 512],
    ("paper", "sharegpt"): [0.5, 1, 2, 3, 4, 6, 8],
    ("paper", "alpaca"): [2, 5, 10, 20, 30, 40, 60],
}
PAPER = {  # §6.2 / Fig. 12-13 (OPT-13B): sustained-rate ratios paged ÷ baseline, batched-requests ratio
    "sharegpt": "paged sustains 1.7–2.7× Orca (Oracle), 2.7–8× Orca (Max), up to 22× FasterTransformer; "
                "OPT-13B batches 2.2× more requests than Orca (Oracle), 4.3× more than Orca (Max)",
    "alpaca": "similar trend; smaller margin where memory does not bind",
}


def trace_requests(args, engine, trace: str, default_n: int | None = None):
    scale = common.SCALES[args.scale]
    spec = TRACES[trace].scaled(scale.length_scale)
    n = args.num_requests or default_n or scale.num_requests
    return make_trace(spec, n, float("inf"), common.vocab_of(engine), args.seed, scale.max_model_len)


def run(args, fig: str = "fig12") -> dict:
    path = os.path.join(args.output_dir, "fig12.json")
    data = common.load_json(path)
    data.setdefault("scale", args.scale)
    data.setdefault("traces", {})
    data["sustained_rule"] = (f"highest rate with normalized latency <= {common.SUSTAINED_FACTOR}x the trace's unloaded "
                              "latency (min over systems of the lowest-rate value)")
    traces = args.traces or ["sharegpt", "alpaca"]
    with common.EngineCache(args) as engines:  # one engine for every system: only the KV manager is swapped
        for system in args.systems or list(common.SYSTEMS):
            for trace in traces:
                rates = common.rates_for(args, system) or RATES[(args.scale, trace)]
                prev = data["traces"].setdefault(trace, {}).get(system)
                if prev and (all(r in prev["rates"] for r in rates) or
                             prev.get("sustained_rate", 0) < max(prev["rates"])):
                    continue
                engine = engines.get(system)
                reqs = trace_requests(args, engine, trace)
                data["traces"][trace]["num_requests"] = len(reqs)
                cc = engine.config.cache_config
                data["kv_pool"] = {"num_gpu_blocks": cc.num_gpu_blocks, "block_size": cc.block_size,
                                   "model": args.model or ("tiny" if args.scale == "small" else "opt-13b")}
                data["traces"][trace]["mean_input"] = sum(len(r.prompt_token_ids) for r in reqs) / len(reqs)
                data["traces"][trace]["mean_output"] = sum(r.output_len for r in reqs) / len(reqs)

                def save(point, trace=trace, system=system):
                    data["traces"][trace][system] = point
                    common.write_json(path, data)

                res = sweep_system(engine, reqs, rates, seed=args.seed, done=prev, max_point_seconds=args.max_point_seconds,
                                   on_point=save, label=f"{trace}/{system}",
                                   point_slack_seconds=getattr(args, "point_slack_seconds", float("inf")),
                                   reference=common.unloaded_latency(
                                       {s: d for s, d in data["traces"][trace].items() if s in common.SYSTEMS}),
                                   give_up_early=getattr(args, "give_up_early", False))
                save(res)
    for trace in data["traces"].values():
        trace["unloaded_normalized_latency"] = common.apply_common_rule(
            {s: d for s, d in trace.items() if s in common.SYSTEMS})
    common.write_json(path, data)
    write_outputs(args.output_dir, data)
    return data


def ratios(per_system: dict) -> dict[str, str]:
    """paged's sustained rate ÷ each baseline's, as text: '>= x' when a bound (paged sustained its highest
    measured rate, or the baseline sustained none: then its lowest measured rate bounds it)."""
    p = per_system.get("paged", {})
    out = {}
    for s in common.SYSTEMS:
        b = per_system.get(s)
        if s == "paged" or not p.get("rates") or not b or not b.get("rates"):
            continue
        pr, br = p["sustained_rate"], b["sustained_rate"]
        bound = pr >= max(p["rates"]) or br == 0.0
        den = br or min(b["rates"])
        out[s] = (">= " if bound else "") + f"{pr / den:.2f}"
    return out


def write_outputs(out_dir: str, data: dict) -> None:
    lines = [f"Scale: {data['scale']}. Sustained rate: {data['sustained_rule']}.\n"]
    plt = common.pyplot()
    traces = [t for t in ("sharegpt", "alpaca") if t in data["traces"]]
    fig, axes = plt.subplots(1, max(1, len(traces)), figsize=(5 * max(1, len(traces)), 3.6), squeeze=False)
    fig13, axes13 = plt.subplots(1, max(1, len(traces)), figsize=(5 * max(1, len(traces)), 3.2), squeeze=False)
    for ax, ax13, trace in zip(axes[0], axes13[0], traces):
        per = data["traces"][trace]
        rows = []
        for s in common.SYSTEMS:
            if s not in per:
                continue
            d = per[s]
            color, marker = common.STYLE[s]
            ys = [common.finite(y) for y in d["normalized_latency"]]
            ax.plot(d["rates"], ys, marker=marker, color=color, label=common.LABELS[s])
            rows.append([common.LABELS[s], common.fmt(d["sustained_rate"]),
                         ", ".join(f"{r:g}: {common.fmt(y)}" for r, y in zip(d["rates"], d["normalized_latency"])),
                         ", ".join(f"{b:.1f}" for b in d["mean_batched_requests"])])
        rat = ratios(per)
        top = ax.get_ylim()[1]
        for s in common.SYSTEMS:  # points stopped over the threshold (no latency): hollow, at the top
            bad = [r for r, y in zip(per.get(s, {}).get("rates", []), per.get(s, {}).get("normalized_latency", []))
                   if common.finite(y) is None]
            if bad:
                color, marker = common.STYLE[s]
                hollow = {"color": color} if marker in ("x", "+") else {"facecolors": "none", "edgecolors": color}
                ax.scatter(bad, [top] * len(bad), marker=marker, clip_on=False, **hollow)  # "x" has no face to hollow
        ax.set_title(f"{trace} ({per.get('num_requests', '?')} requests; hollow: stopped, not sustained)", fontsize=9)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("normalized latency (s/token)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        names = [s for s in common.SYSTEMS if s in per]
        batched = [_batched_at_common_rate(per, s) for s in names]
        ax13.bar(range(len(names)), batched, color=[common.STYLE[s][0] for s in names])
        ax13.set_xticks(range(len(names)), [common.LABELS[s].split(" (")[0] + ("\n(" + common.LABELS[s].split(" (")[1] if " (" in common.LABELS[s] else "") for s in names], fontsize=7)
        ax13.set_ylabel("mean batched requests")
        ax13.set_title(f"{trace}: at the highest rate paged sustains")
        lines.append(f"\n**{trace}** ({per.get('num_requests')} requests, mean input {per.get('mean_input', 0):.1f}, "
                     f"mean output {per.get('mean_output', 0):.1f} tokens)\n\n")
        lines.append(common.md_table(["system", "sustained rate (req/s)", "normalized latency (s/token) by rate",
                                      "mean batched requests by rate"], rows))
        lines.append("\npaged ÷ baseline, sustained rate: " + ", ".join(
            f"{s} {r}×" for s, r in rat.items()) + f"  (paper: {PAPER[trace]})\n")
        lines.append("mean batched requests at the highest rate paged sustains: " + ", ".join(
            f"{s} {b:.1f}" for s, b in zip(names, batched)) + "\n")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "fig12.png"), dpi=120)
    fig13.tight_layout()
    fig13.savefig(os.path.join(out_dir, "fig13.png"), dpi=120)
    plt.close("all")
    text = "".join(lines)
    for name in ("fig12", "fig13"):
        with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
            f.write(f"# {name}\n\n{text}")
    common.write_json(os.path.join(out_dir, "fig13.json"), {"source": "fig12.json", "traces": {
        t: {s: {"rates": d["rates"], "mean_batched_requests": d["mean_batched_requests"]}
            for s, d in data["traces"][t].items() if isinstance(d, dict)} for t in traces}})
    print(text, flush=True)


def _batched_at_common_rate(per: dict, system: str) -> float:
    """Mean batched requests at the highest rate paged sustains (or the system's nearest measured rate below)."""
    r = per.get("paged", {}).get("sustained_rate") or 0
    d = per[system]
    cands = [(rate, b) for rate, b in zip(d["rates"], d["mean_batched_requests"]) if rate <= r] or \
        list(zip(d["rates"], d["mean_batched_requests"]))[:1]
    return max(cands)[1] if cands else 0.0
