"""`pagedllm bench paper <figure>`: the paper's Figures 2 and 12-19 (Kwon et al., SOSP 2023), one command each.

fig2 KV memory breakdown; fig12/fig13 normalized latency and batched requests vs rate (five systems);
fig14 parallel sampling / beam search; fig15 sharing savings; fig16 shared prefix; fig17 chatbot;
fig18 kernel latency and block size; fig19 swap vs recompute. `all` runs every one.

Each writes DIR/<fig>.json, DIR/<fig>.png and DIR/<fig>.md. ``--scale small``: a tiny random-weight
Llama (2 layers, hidden 64; ``--model bundled`` for SmolLM2-135M) on CPU, lengths x1/8, block size 2,
max_model_len 256, a 256-block pool (the paper's workload measured in blocks), 24 requests per point.
``--scale paper``: OPT-13B (or ``--model llama-13b``) config with dummy weights on CUDA, block size 16,
max_model_len 2048 and 12 GB of KV (Table 1). Rate sweeps resume from an existing DIR/<fig>.json.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import time

from pagedllm.benchmarks.paper import common

FIGURES = ["fig2", "fig12", "fig13", "fig14", "fig15", "fig16", "fig17", "fig18", "fig19"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("figure", choices=FIGURES + ["all"])
    common.add_common_args(p)
    p.add_argument("--widths", type=int, nargs="+", default=None,
                   help="fig14/fig15: n of parallel sampling and beam widths (default 2 4 6)")
    p.add_argument("--block-sizes", type=int, nargs="+", default=None,
                   help="fig18/fig19: block sizes to sweep (default: small 1..32, paper 1..256)")
    p.add_argument("--shots", type=int, nargs="+", default=None, choices=[1, 5],
                   help="fig16: few-shot prefixes to run (default 1 5)")
    p.add_argument("--cpu-threads", type=int, default=1,
                   help="torch threads on --device cpu (default 1: on a shared CPU, OpenMP barriers across busy "
                        "cores cost a scheduler quantum per op and swamp a small model's steps)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("pagedllm").setLevel(logging.WARNING)
    logging.getLogger("pagedllm.bench.paper").setLevel(logging.INFO)
    os.makedirs(args.output_dir, exist_ok=True)
    if (args.device or common.SCALES[args.scale].device) == "cpu":
        import torch

        torch.set_num_threads(args.cpu_threads)
    for fig in FIGURES if args.figure == "all" else [args.figure]:
        t0 = time.perf_counter()
        if fig == "fig13" and args.figure == "all":
            continue  # written by fig12
        module = importlib.import_module(f"pagedllm.benchmarks.paper.{'fig12' if fig == 'fig13' else fig}")
        module.run(args)
        logging.getLogger("pagedllm.bench.paper").info("%s done in %.0f s → %s", fig, time.perf_counter() - t0,
                                                      args.output_dir)
    return 0


def main() -> int:
    """`python -m pagedllm.benchmarks.paper.cli <figure> ...`: the same without the server's imports (GPU boxes)."""
    p = argparse.ArgumentParser(prog="pagedllm bench paper", description=__doc__.split("\n")[0])
    add_args(p)
    return run(p.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
