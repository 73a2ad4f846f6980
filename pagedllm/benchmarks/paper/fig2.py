"""Fig. 2: where the KV pool's memory goes — token states, reservation, internal and external fragmentation.

Paged and the three Orca managers serve the same ShareGPT-like requests, all arriving at once, so memory
binds. The breakdown (core/kv_accounting.py) is read right after every scheduling decision, with the tokens
of the step being launched counted as computed (the memory that step computes with), and time-averaged
over the steps after whose decision a request still waits: the scheduler could not admit it, the pool is
as full as the system can make it. Same rule for every system.

Pool: at small scale 915 blocks of 2 (PAPER_POOL_BLOCKS: the paper's 12 GB of OPT-13B KV is 915 blocks
of 16, and lengths are x1/8), so the pool holds as many requests as the paper's; at paper scale 12 GB.
Why not the fig12 small pool (256 blocks): there the head-of-line request's prompt is ~9 % of the pool, and
the gap it leaves while it cannot be admitted sat in "free" (measured: 7.2 % free at step end, 4.8 % at
the decision). Paper (Fig. 2, OPT-13B): paged 96.3 % token states, Orca 20.4-38.2 %.
"""
from __future__ import annotations

import logging
import os

from pagedllm.benchmarks.paper import common
from pagedllm.benchmarks.paper.driver import BREAKDOWN_KEYS, run_trace
from pagedllm.benchmarks.paper.fig12 import trace_requests
from pagedllm.benchmarks.paper.sweep import greedy_params
from pagedllm.benchmarks.paper.workloads import with_arrivals

logger = logging.getLogger("pagedllm.bench.paper")
FIG2_SYSTEMS = ["paged", "orca-oracle", "orca-pow2", "orca-max"]
FIG2_REQUESTS = {"small": 300}  # a 915-block pool holds ~31 of them: ~10 waves, a long full-pool average
PAPER = {"paged": 0.963, "orca-oracle": 0.382, "orca-pow2": 0.265, "orca-max": 0.204}  # token-state shares


def run(args) -> dict:
    trace = (args.traces or ["sharegpt"])[0]
    data: dict = {"scale": args.scale, "trace": trace, "averaged_over": "steps after whose scheduling decision a request still waits "
                  "(read at the decision, the launched step's tokens counted as computed)",
                  "paper_token_states": PAPER, "systems": {}}
    with common.EngineCache(args) as engines:  # one engine; each system gets a fresh KV manager over its pool
        for system in [s for s in (args.systems or FIG2_SYSTEMS) if s in FIG2_SYSTEMS]:
            blocks = None if args.num_blocks or args.scale == "paper" else common.PAPER_POOL_BLOCKS
            engine = engines.get(system, num_blocks=blocks)
            data["num_gpu_blocks"] = engine.config.cache_config.num_gpu_blocks
            reqs = with_arrivals(trace_requests(args, engine, trace, FIG2_REQUESTS.get(args.scale)), float("inf"),
                                 args.seed)
            res = run_trace(engine, reqs, greedy_params, max_wall_s=args.max_point_seconds, breakdown_at="schedule")
            b = res.mean_breakdown()
            if not b:  # no request ever waited: memory did not bind, so average over every step
                b = res.mean_breakdown(only_when_waiting=False)
                data.setdefault("averaged_over_all_steps", []).append(system)
            data["systems"][system] = {k: b.get(k, 0.0) for k in BREAKDOWN_KEYS} | {
                "mean_batched_requests": res.mean_batched_requests, "num_steps": len(res.steps),
                "num_averaged_steps": sum(1 for st in res.steps if st.num_waiting), "num_requests": len(reqs)}
            logger.info("fig2 %s: token states %.1f %%, %.1f batched requests", system, 100 * b.get("token_states", 0),
                        res.mean_batched_requests)
    common.write_json(os.path.join(args.output_dir, "fig2.json"), data)
    write_outputs(args.output_dir, data)
    return data


def write_outputs(out_dir: str, data: dict) -> None:
    plt = common.pyplot()
    names = list(data["systems"])
    fig, ax = plt.subplots(figsize=(7.6, 3.4))
    colors = {"token_states": "tab:green", "reservation": "tab:orange", "internal_fragmentation": "tab:red",
              "external_fragmentation": "tab:purple", "free": "lightgray"}
    left = [0.0] * len(names)
    for k in BREAKDOWN_KEYS:
        vals = [100 * data["systems"][s][k] for s in names]
        ax.barh(range(len(names)), vals, left=left, color=colors[k], label=k.replace("_", " "))
        left = [a + b for a, b in zip(left, vals)]
    ax.set_yticks(range(len(names)), [common.LABELS[s] for s in names])
    ax.set_xlabel("KV pool (%)")
    ax.set_title(f"KV memory breakdown ({data['trace']}-like trace, {data['scale']} scale)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the bars, never over them
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "fig2.png"), dpi=120)
    plt.close(fig)
    rows = [[common.LABELS[s]] + [f"{100 * data['systems'][s][k]:.1f}" for k in BREAKDOWN_KEYS] +
            [f"{100 * PAPER[s]:.1f}"] for s in names]
    text = (f"# fig2\n\nKV pool use (%), time-averaged over the {data['averaged_over']}, {data['trace']}-like "
            f"trace, {data['scale']} scale, {data.get('num_gpu_blocks')}-block pool.\n\n" +
            common.md_table(["system", *BREAKDOWN_KEYS, "paper: token states"], rows))
    with open(os.path.join(out_dir, "fig2.md"), "w") as f:
        f.write(text)
    print(text, flush=True)
