"""Shared pieces of the rate-sweep figures (14, 16, 17, 18b, 19b): several engine configurations serve the
same requests at the same Poisson rates; each gets a sustained rate under the one rule of common."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.benchmarks.paper import common
from pagedllm.benchmarks.paper.sweep import greedy_params, sweep_system
from pagedllm.benchmarks.paper.workloads import TraceRequest

logger = logging.getLogger("pagedllm.bench.paper")


@dataclass
class Config:
    """One line of a figure: a system (common.SYSTEMS) plus engine options and request parameters."""

    system: str
    engine: dict[str, Any] = field(default_factory=dict)  # extra common.make_engine keywords
    params: Callable[[TraceRequest], object] = greedy_params


def sweep_configs(args, configs: dict[str, Config], reqs: list[TraceRequest], rates: list[float],
                  label: str, engines: common.EngineCache) -> dict[str, dict]:
    """Sweep every configuration over `rates` on `reqs`, then apply the common sustained-rate rule over them
    (reference: the lowest lowest-rate latency of the configurations). Configurations that differ only in
    system, prefix caching, preemption mode or request parameters share one engine (`engines`)."""
    per: dict[str, dict] = {}
    for name, cfg in configs.items():
        engine = engines.get(cfg.system, **cfg.engine)
        per[name] = sweep_system(engine, reqs, rates, make_params=cfg.params, seed=args.seed,
                                 max_point_seconds=args.max_point_seconds, label=f"{label}/{name}")
        per[name]["num_gpu_blocks"] = engine.config.cache_config.num_gpu_blocks
    per_ref = common.apply_common_rule(per)
    for d in per.values():
        d["unloaded_normalized_latency"] = per_ref
    return per


def ratio(per: dict[str, dict], num: str, den: str) -> str:
    """Sustained rate of `num` ÷ `den` as text; '>= ' when a bound (num sustained its highest rate, or den
    sustained none, its lowest measured rate then bounding it)."""
    a, b = per[num], per[den]
    bound = a["sustained_rate"] >= max(a["rates"]) or b["sustained_rate"] == 0.0
    d = b["sustained_rate"] or min(b["rates"])
    return ("≥ " if bound else "") + f"{a['sustained_rate'] / d:.2f}"


def plot_panels(path: str, panels: dict[str, dict[str, dict]], title: str, styles: dict[str, tuple[str, str]] | None = None,
                labels: dict[str, str] | None = None) -> None:
    """One subplot per panel: normalized latency vs rate for each configuration in it."""
    plt = common.pyplot()
    n = max(1, len(panels))
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, (name, per) in zip(axes.flat, panels.items()):
        for i, (cfg, d) in enumerate(per.items()):
            color, marker = (styles or {}).get(cfg, (f"C{i}", "o"))
            ax.plot(d["rates"], [common.finite(y) for y in d["normalized_latency"]], marker=marker, color=color,
                    label=(labels or {}).get(cfg, cfg))
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("normalized latency (s/token)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def rate_rows(per: dict[str, dict], labels: dict[str, str] | None = None) -> list[list[str]]:
    """Markdown rows: configuration, sustained rate, latency by rate, batched requests by rate."""
    return [[(labels or {}).get(c, c), common.fmt(d["sustained_rate"]),
             ", ".join(f"{r:g}: {common.fmt(y)}" for r, y in zip(d["rates"], d["normalized_latency"])),
             ", ".join(f"{b:.1f}" for b in d["mean_batched_requests"])] for c, d in per.items()]


RATE_HEADER = ["configuration", "sustained rate (req/s)", "normalized latency (s/token) by rate",
               "mean batched requests by rate"]
