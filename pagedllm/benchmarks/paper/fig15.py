"""Fig. 15: KV memory saved by sharing, parallel sampling (n) and beam search (width), Alpaca- and
ShareGPT-like lengths — pagedllm/benchmarks/sharing.py's measurement, in the `bench paper` family.

Metric (sharing.run_sharing_point): blocks saved by sharing ÷ blocks a non-sharing layout would need,
sampled after every step and averaged. Small scale: the tiny model, Alpaca lengths x1 with block 16 and
ShareGPT lengths x1/4 with block 4 (in blocks the same workload; max_model_len 256). Paper scale: x1,
block 16. Paper (OPT-13B, Fig. 15): parallel 6.1-9.8 % (Alpaca) / 16.2-30.5 % (ShareGPT), beam
37.6-55.2 % / 44.3-66.3 %.
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict
from types import SimpleNamespace

from pagedllm.benchmarks import sharing
from pagedllm.benchmarks.paper import common

logger = logging.getLogger("pagedllm.bench.paper")
SCALE = {"small": {"alpaca": 1.0, "sharegpt": 0.25}, "paper": {"alpaca": 1.0, "sharegpt": 1.0}}


def run(args) -> dict:
    widths = args.widths or [2, 4, 6]
    n = args.num_requests or 20
    data: dict = {"scale": args.scale, "num_requests": n, "paper": {f"{w}/{m}": v for (w, m), v in
                                                                    sharing.PAPER_FIG15.items()}, "points": []}
    with common.EngineCache(args) as engines:
        for workload in args.traces or ["alpaca", "sharegpt"]:
            scale = SCALE[args.scale][workload]
            bs = max(1, round(16 * scale))
            engine = engines.get("paged", block_size=bs, num_blocks=args.num_blocks or 4096, max_num_seqs=512)
            for method, w in ((m, w) for m in ("parallel", "beam") for w in widths):
                r = sharing.run_sharing_point(SimpleNamespace(llm_engine=engine), workload, method, w, n, scale,
                                              args.seed)
                data["points"].append(asdict(r))
                logger.info("fig15 %s %s %d: %.1f %% of blocks saved (block %d)", workload, method, w, r.saving_pct, bs)
    common.write_json(os.path.join(args.output_dir, "fig15.json"), data)
    write_outputs(args.output_dir, data)
    return data


def write_outputs(out_dir: str, data: dict) -> None:
    pts = [sharing.SharingResult(**p) for p in data["points"]]
    sharing.plot_fig15(pts, os.path.join(out_dir, "fig15.png"))
    rows = [[p.workload, p.method, p.width, p.block_size, f"{p.mean_in:.1f} / {p.mean_out:.1f}", f"{p.saving_pct:.1f}",
             "{:.1f}–{:.1f}".format(*sharing.PAPER_FIG15[(p.workload, p.method)])] for p in pts]
    text = (f"# fig15\n\nKV blocks saved by sharing (% of what a non-sharing layout needs), {data['num_requests']} "
            f"requests per point, {data['scale']} scale.\n\n" +
            common.md_table(["trace", "method", "n / width", "block", "mean in / out", "saved (%)",
                             "paper, width 2→6 (%)"], rows))
    with open(os.path.join(out_dir, "fig15.md"), "w") as f:
        f.write(text)
    print(text, flush=True)
