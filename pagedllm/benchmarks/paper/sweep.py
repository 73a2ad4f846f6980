"""Rate sweeps: one system, one trace, increasing Poisson rates, until normalized latency blows up."""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from tqdm import tqdm

from pagedllm.benchmarks.paper import common
from pagedllm.benchmarks.paper.driver import run_trace
from pagedllm.benchmarks.paper.workloads import TraceRequest, with_arrivals

logger = logging.getLogger("pagedllm.bench.paper")


def greedy_params(r: TraceRequest):
    from pagedllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)


def sweep_system(engine, requests: list[TraceRequest], rates: list[float], make_params: Callable = greedy_params,
                 seed: int = 0, done: dict | None = None, max_point_seconds: float = math.inf,
                 on_point: Callable[[dict], None] | None = None, label: str = "",
                 point_slack_seconds: float = math.inf, reference: float | None = None,
                 give_up_early: bool = False) -> dict:
    """Run `requests` at each rate (ascending) on `engine`; stops after the first point over the sustained
    threshold (higher rates can only be worse). `done` holds points of an earlier, interrupted run.
    A point stops (counted not sustained) after `max_point_seconds`, or `point_slack_seconds` after its
    last arrival, whichever comes first, or (`give_up_early`) once its normalized latency is sure to end over
    the sustained threshold: `common.SUSTAINED_FACTOR` x min(`reference`, this system's lowest-rate value)."""
    out = done or {"rates": [], "normalized_latency": [], "mean_batched_requests": [], "throughput_tok_s": [],
                   "num_preemptions": [], "completed": []}
    if any(r not in out["rates"] for r in rates):
        # warm-up (kernel compilation, CUDA-graph capture, allocator): otherwise the first, lowest rate pays it
        # and the unloaded latency that every sustained rate is measured against comes out too high
        t0 = time.perf_counter()
        run_trace(engine, with_arrivals(requests[:4], float("inf"), seed), make_params, record_breakdown=False)
        logger.info("%s warm-up (4 requests) in %.1f s", label, time.perf_counter() - t0)
    for rate in tqdm(sorted(rates), desc=label, leave=False):
        if rate in out["rates"]:
            continue
        if out["rates"] and common.sustained_rate(out["rates"], out["normalized_latency"]) < max(out["rates"]):
            break  # already over the threshold at a lower rate
        timed = with_arrivals(requests, rate, seed)
        cap = min(max_point_seconds, max(r.arrival for r in timed) + point_slack_seconds)
        refs = [x for x in ([reference] + out["normalized_latency"][:1]) if x is not None and math.isfinite(x)]
        give_up = common.SUSTAINED_FACTOR * min(refs) if refs and give_up_early else math.inf
        res = run_trace(engine, timed, make_params, max_wall_s=cap, record_breakdown=False, give_up_above=give_up)
        logger.info("%s rate %.3g: %d steps, trace clock %.1f s, wall %.1f s", label, rate, len(res.steps),
                    res.duration, res.wall_s)
        for k, v in (("rates", rate), ("normalized_latency", res.normalized_latency),
                     ("mean_batched_requests", res.mean_batched_requests),
                     ("throughput_tok_s", res.output_tokens_per_s()), ("num_preemptions", res.num_preemptions),
                     ("completed", res.completed)):
            out[k].append(v)
        order = sorted(range(len(out["rates"])), key=lambda j: out["rates"][j])
        for k in list(out):
            if isinstance(out[k], list):
                out[k] = [out[k][j] for j in order]
        out["sustained_rate"] = common.sustained_rate(out["rates"], out["normalized_latency"])
        logger.info("%s rate %.3g req/s: normalized latency %s s/token, %.1f batched requests, %d preemptions, "
                    "%.0f s wall", label, rate, common.fmt(res.normalized_latency), res.mean_batched_requests,
                    res.num_preemptions, res.wall_s)
        if on_point:
            on_point(out)
    out["sustained_rate"] = common.sustained_rate(out["rates"], out["normalized_latency"])
    return out
