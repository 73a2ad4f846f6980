"""Fig. 19: recovery from preemption, swapping vs recomputation.

(a) Per block size, the time to bring back a preempted sequence of L tokens (small: 128, paper: 1024):
swapping = its blocks copied out to the CPU swap pool and back in (CacheEngine.swap_out/swap_in with the
engine's own block mapping; on CUDA synchronised), recomputation = the prefill step of an L-token prompt
(what a recomputed sequence runs). Median of 5. (b) End to end: paged, the ShareGPT-like trace at a rate
that forces preemption, `preemption_mode` swap vs recompute, per block size (pool: the same token slots).
Paper (Fig. 19): swapping costs more at small block sizes (many small transfers), recomputation is flat;
end to end both are close for block sizes 16-64.
"""
from __future__ import annotations

import logging
import os
import random
import statistics
import time

from pagedllm.benchmarks.paper import common
from pagedllm.benchmarks.paper.fig12 import trace_requests
from pagedllm.benchmarks.paper.sweep import sweep_system

logger = logging.getLogger("pagedllm.bench.paper")
BLOCK_SIZES = {"small": [1, 2, 4, 8, 16, 32], "paper": [1, 2, 4, 8, 16, 32, 64, 128, 256]}
SEQ_LEN = {"small": 128, "paper": 1024}
RATE = {"small": 64.0, "paper": 4.0}


def _sync(engine) -> None:
    dev = engine.executor.driver_worker.cache_engine.device
    if dev.type == "cuda":
        import torch

        torch.cuda.synchronize(dev)


def recovery_point(engine, seq_len: int, repeats: int = 5) -> dict:
    """(swap out + in ms, recompute ms) for one sequence of `seq_len` tokens on this engine's block size."""
    from pagedllm import SamplingParams

    ce = engine.executor.driver_worker.cache_engine
    bs = engine.config.cache_config.block_size
    seq_len = min(seq_len, (engine.config.cache_config.num_gpu_blocks - 1) * bs)  # a small pool: what fits
    n = -(-seq_len // bs)
    if n > min(engine.config.cache_config.num_gpu_blocks, engine.config.cache_config.num_cpu_blocks or 0):
        raise ValueError(f"fig19a needs {n} device and swap blocks of {bs}; raise --num-blocks or the swap space")
    mapping = [(i, i) for i in range(n)]
    swap = []
    for _ in range(repeats + 1):
        _sync(engine)
        t0 = time.perf_counter()
        ce.swap_out(mapping)
        ce.swap_in(mapping)
        _sync(engine)
        swap.append(time.perf_counter() - t0)
    rng = random.Random(seq_len)
    prefill = []
    for i in range(repeats + 1):
        prompt = [rng.randrange(100, common.vocab_of(engine)) for _ in range(seq_len)]
        engine.add_request(f"recompute-{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        t0 = time.perf_counter()
        engine.step()
        _sync(engine)
        prefill.append(time.perf_counter() - t0)
        while engine.has_unfinished_requests():
            engine.step()
    return {"block_size": bs, "seq_len": seq_len, "num_blocks": n, "swap_ms": 1e3 * statistics.median(swap[1:]),
            "recompute_ms": 1e3 * statistics.median(prefill[1:])}


def run(args) -> dict:
    scale = common.SCALES[args.scale]
    slots = (args.num_blocks or scale.num_blocks or 0) * scale.block_size
    rate = (args.rates or [RATE[args.scale]])[0]
    data: dict = {"scale": args.scale, "seq_len": SEQ_LEN[args.scale], "rate": rate, "recovery": [], "end_to_end": {}}
    with common.EngineCache(args) as engines:  # one engine per block size; the preemption mode is switched
        for bs in args.block_sizes or BLOCK_SIZES[args.scale]:
            nb = max(1, slots // bs) if slots else None
            for mode in ("recompute", "swap"):
                engine = engines.get("paged", block_size=bs, num_blocks=nb, preemption_mode=mode)
                if mode == "recompute":
                    data["recovery"].append(recovery_point(engine, SEQ_LEN[args.scale]))
                reqs = trace_requests(args, engine, "sharegpt")
                swaps0 = engine.stats()["num_swap_outs"]
                r = sweep_system(engine, reqs, [rate], seed=args.seed, max_point_seconds=args.max_point_seconds,
                                 label=f"fig19 block {bs} {mode}")
                e = data["end_to_end"].setdefault(mode, {"block_sizes": [], "normalized_latency": [],
                                                         "num_preemptions": [], "num_swap_outs": []})
                e["block_sizes"].append(bs)
                e["normalized_latency"].append(r["normalized_latency"][0])
                e["num_preemptions"].append(r["num_preemptions"][0])
                e["num_swap_outs"].append(engine.stats()["num_swap_outs"] - swaps0)
            data["num_requests"] = len(reqs)
            common.write_json(os.path.join(args.output_dir, "fig19.json"), data)
        data["engine_builds"] = engines.num_builds
    common.write_json(os.path.join(args.output_dir, "fig19.json"), data)
    write_outputs(args.output_dir, data)
    return data


def write_outputs(out_dir: str, data: dict) -> None:
    plt = common.pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6))
    rec = data["recovery"]
    bss = [p["block_size"] for p in rec]
    ax.plot(bss, [p["swap_ms"] for p in rec], marker="o", color="tab:orange", label="swap out + in")
    ax.plot(bss, [p["recompute_ms"] for p in rec], marker="s", color="tab:green", label="recompute (prefill)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(f"(a) recovering a {data['seq_len']}-token sequence", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    for mode, color in (("recompute", "tab:green"), ("swap", "tab:orange")):
        e = data["end_to_end"].get(mode)
        if e:
            bx.plot(e["block_sizes"], [common.finite(y) for y in e["normalized_latency"]], marker="o", color=color,
                    label=mode)
    bx.set_xscale("log", base=2)
    bx.set_xlabel("block size (tokens)")
    bx.set_ylabel("normalized latency (s/token)")
    bx.set_title(f"(b) ShareGPT-like @ {data['rate']:g} req/s ({data['scale']} scale)", fontsize=9)
    bx.legend(fontsize=7)
    bx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "fig19.png"), dpi=120)
    plt.close(fig)
    e_r, e_s = data["end_to_end"].get("recompute", {}), data["end_to_end"].get("swap", {})
    rows = []
    for i, p in enumerate(rec):
        rows.append([p["block_size"], p["num_blocks"], common.fmt(p["swap_ms"]), common.fmt(p["recompute_ms"]),
                     common.fmt(e_r["normalized_latency"][i]), e_r["num_preemptions"][i],
                     common.fmt(e_s["normalized_latency"][i]), e_s["num_preemptions"][i], e_s["num_swap_outs"][i]])
    text = (f"# fig19\n\nSwap vs recompute, {data['scale']} scale. (a) recovering one {data['seq_len']}-token "
            f"sequence (median ms); (b) ShareGPT-like trace, {data.get('num_requests')} requests at "
            f"{data['rate']:g} req/s.\n\n" +
            common.md_table(["block", "blocks moved", "swap out+in (ms)", "recompute (ms)",
                             "e2e recompute (s/token)", "preemptions", "e2e swap (s/token)", "preemptions",
                             "swap-outs"], rows) +
            "\nPaper: swapping is slower at small block sizes, recomputation flat; end to end close at 16-64.\n")
    with open(os.path.join(out_dir, "fig19.md"), "w") as f:
        f.write(text)
    print(text, flush=True)
