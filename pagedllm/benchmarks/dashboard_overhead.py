"""Cost of the live KV-cache dashboard: server throughput with /dashboard/events open vs closed.

One `pagedllm serve` process, one seeded workload (the serving benchmark's: random-token prompts,
ignore_eos, all sent at once), run in alternating rounds with no dashboard client and with a client
process consuming /dashboard/events (~4 snapshots/s, each parsed as JSON like the page does).
Prints output tokens/s of every round and the open/closed ratios (goal: within 2 %).

    python benchmarks/dashboard_overhead.py --rounds 3 --num-prompts 24
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

from pagedllm.benchmarks.server_process import ServerProcess

logger = logging.getLogger("pagedllm.bench.dashboard")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=3, help="Closed/open pairs to run (default: 3).")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-gpu-blocks", type=int, default=2048, help="KV pool size in blocks (default: 2048).")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", default=None)
    p.add_argument("--scale", type=int, nargs="*", default=[2048, 16384, 65536],
                   help="Also time one snapshot's capture / build / JSON on synthetic pools of these sizes "
                        "(blocks; 70 %% used by 64 n=4 groups sharing their prompts). Default: 2048 16384 65536.")
    p.add_argument("--consume", default=None, help=argparse.SUPPRESS)  # internal: the SSE client process


def consume(url: str) -> int:
    """The dashboard client: read /dashboard/events, parse every event; print counts on SIGTERM."""
    import httpx

    n, size, t0 = 0, 0, time.monotonic()
    capture_ms, build_ms, json_ms = [], [], []

    def _stop(*_):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _stop)
    try:
        with httpx.stream("GET", url, timeout=None) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = json.loads(line[6:])
                    n += 1
                    size += len(line)
                    if isinstance(data, dict) and "cost_ms" in data:
                        capture_ms.append(data["cost_ms"]["capture"])
                        build_ms.append(data["cost_ms"]["build"])
                        t1 = time.perf_counter()  # the server's json.dumps of the same dict, reproduced
                        json.dumps(data, separators=(",", ":"))
                        json_ms.append(1e3 * (time.perf_counter() - t1))
                    if n == 2:
                        print("ready", flush=True)
    finally:
        print(json.dumps({"events": n, "bytes": size, "seconds": time.monotonic() - t0, "capture_ms": capture_ms,
                          "build_ms": build_ms, "json_ms": json_ms}), flush=True)
    return 0


def _synthetic_scheduler(num_blocks: int, block_size: int = 16) -> SimpleNamespace:
    """A block manager 70 % full: 64 groups of n=4, each sharing a 256-token prompt, plus own tokens."""
    from pagedllm.core.block_manager import BlockManager
    from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus

    bm = BlockManager(block_size=block_size, num_gpu_blocks=num_blocks, num_cpu_blocks=num_blocks // 8,
                      enable_caching=True)
    groups, prompt = 64, 256
    own = max(1, (int(0.7 * num_blocks) - groups * prompt // block_size) // (4 * groups)) * block_size - 5
    running = []
    for g in range(groups):
        parent = Sequence(4 * g, list(range(g * 1000, g * 1000 + prompt)))
        bm.allocate_slots(parent, prompt)
        parent.num_computed_tokens = prompt
        seqs = [parent] + [parent.fork(4 * g + i) for i in (1, 2, 3)]
        for child in seqs[1:]:
            bm.fork(parent, child)
        for seq in seqs:
            bm.allocate_slots(seq, own)
            seq.num_computed_tokens += own
            seq.status = SequenceStatus.RUNNING
        running.append(SequenceGroup(f"cmpl-{g}", seqs, None, 0.0))
    return SimpleNamespace(block_manager=bm, running=running, waiting=[], swapped=[])


def cost_at_scale(sizes: list[int], reps: int = 10) -> list[dict]:
    """Median milliseconds of one snapshot's three parts on synthetic pools (engine thread: capture)."""
    from pagedllm.core.kv_snapshot import build_kv_snapshot, capture_kv_state

    rows = []
    for n in sizes:
        sched = _synthetic_scheduler(n)
        t = {"capture": [], "build": [], "json": []}
        for _ in range(reps):
            t0 = time.perf_counter()
            cap = capture_kv_state(sched)
            t1 = time.perf_counter()
            snap = build_kv_snapshot(cap)
            t2 = time.perf_counter()
            body = json.dumps(snap, separators=(",", ":"))
            t3 = time.perf_counter()
            t["capture"].append(t1 - t0), t["build"].append(t2 - t1), t["json"].append(t3 - t2)
        row = {"num_blocks": n, "used": snap["counts"]["kv_blocks_total"] - snap["counts"]["kv_blocks_free"],
               "seqs": 4 * len(sched.running), "json_kib": len(body) / 1024,
               **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in t.items()}}
        rows.append(row)
        logger.warning("pool %6d blocks (%d used, %d seqs): capture %.2f ms (engine thread), build %.2f ms, "
                       "JSON %.2f ms, %.0f KiB", n, row["used"], row["seqs"], row["capture_ms"], row["build_ms"],
                       row["json_ms"], row["json_kib"])
    return rows


def _start_server(args) -> ServerProcess:
    return ServerProcess(["--num-gpu-blocks-override", str(args.num_gpu_blocks), "--max-num-seqs",
                          str(args.max_num_seqs), "--max-model-len", "1024", "--seed", str(args.seed)],
                         startup_timeout=300, port=args.port)


def _one_round(args, num_prompts: int) -> dict:
    from pagedllm.benchmarks import serving

    ns = SimpleNamespace(base_url=f"http://127.0.0.1:{args.port}", host="127.0.0.1", port=args.port,
                         endpoint="/v1/completions", model=None, api_key=None, num_prompts=num_prompts,
                         input_len=args.input_len, output_len=args.output_len, range_ratio=0.0,
                         request_rate=float("inf"), burstiness=1.0, max_concurrency=None, seed=args.seed,
                         result_json=None)
    return asyncio.run(serving.benchmark(ns))


def _round_with_dashboard(args) -> tuple[dict, dict]:
    url = f"http://127.0.0.1:{args.port}/dashboard/events"
    client = subprocess.Popen([sys.executable, "-m", "pagedllm.benchmarks.dashboard_overhead", "--consume", url],
                              stdout=subprocess.PIPE, text=True)
    if client.stdout.readline().strip() != "ready":
        raise RuntimeError("the dashboard client got no events")
    try:
        summary = _one_round(args, args.num_prompts)
    finally:
        client.send_signal(signal.SIGTERM)
        out, _ = client.communicate(timeout=30)
    return summary, json.loads(out.strip().splitlines()[-1])


def _cost_summary(client: dict) -> dict:
    """Per-snapshot costs the server reported (capture, build) and the JSON cost reproduced by the client."""
    out = {k: client[k] for k in ("events", "bytes", "seconds")}
    for k in ("capture", "build", "json"):
        v = client[f"{k}_ms"] or [0.0]
        out[f"{k}_ms_mean"], out[f"{k}_ms_max"] = statistics.mean(v), max(v)
    per_s = client["events"] / client["seconds"]
    out["engine_thread_pct"] = 100 * out["capture_ms_mean"] * per_s / 1e3
    out["loop_pct"] = 100 * (out["build_ms_mean"] + out["json_ms_mean"]) * per_s / 1e3
    return out


def run(args: argparse.Namespace) -> int:
    if args.consume:
        return consume(args.consume)
    scale = cost_at_scale(args.scale) if args.scale else []
    server = _start_server(args)
    rows = []
    try:
        _one_round(args, max(4, args.num_prompts // 4))  # warm-up
        for r in range(args.rounds):
            # Alternate which mode goes first, so a drift in machine load does not favour one.
            for mode in (("closed", "open") if r % 2 == 0 else ("open", "closed")):
                if mode == "open":
                    summary, client = _round_with_dashboard(args)
                else:
                    summary, client = _one_round(args, args.num_prompts), None
                if summary["completed"] != args.num_prompts:
                    raise RuntimeError(f"only {summary['completed']} of {args.num_prompts} requests completed")
                row = {"round": r, "mode": mode, "out_tok_s": summary["output_throughput_tok_s"],
                       "duration_s": summary["duration_s"], "client": client}
                rows.append(row)
                extra = ""
                if client:
                    rate = client["events"] / client["seconds"]
                    row["client"] = client = _cost_summary(client)
                    extra = (f", dashboard client got {client['events']} events ({rate:.1f}/s, "
                             f"{client['bytes'] / max(1, client['events']) / 1024:.1f} KiB each); engine thread "
                             f"held {client['capture_ms_mean']:.2f} ms per snapshot ({client['engine_thread_pct']:.3f} "
                             f"% of the time), build + JSON {client['build_ms_mean'] + client['json_ms_mean']:.2f} ms "
                             f"({client['loop_pct']:.2f} % of the time)")
                logger.warning("round %d %-6s: %.1f output tok/s in %.1f s%s", r, mode, row["out_tok_s"],
                               row["duration_s"], extra)
    finally:
        server.stop()
    ratios = []
    for r in range(args.rounds):
        pair = {row["mode"]: row["out_tok_s"] for row in rows if row["round"] == r}
        ratios.append(pair["open"] / pair["closed"])
    closed = [row["out_tok_s"] for row in rows if row["mode"] == "closed"]
    opened = [row["out_tok_s"] for row in rows if row["mode"] == "open"]
    print(f"{'round':>5} {'closed tok/s':>13} {'open tok/s':>11} {'open/closed':>12}")
    for r, ratio in enumerate(ratios):
        print(f"{r:>5} {closed[r]:>13.1f} {opened[r]:>11.1f} {ratio:>12.3f}")
    result = {"scale": scale, "rounds": rows, "ratios": ratios, "median_ratio": statistics.median(ratios),
              "mean_closed": statistics.mean(closed), "mean_open": statistics.mean(opened),
              "closed_spread": (max(closed) - min(closed)) / statistics.mean(closed)}
    print(f"median open/closed {result['median_ratio']:.3f}; mean {result['mean_open']:.1f} vs "
          f"{result['mean_closed']:.1f} tok/s ({result['mean_open'] / result['mean_closed']:.3f}); "
          f"closed rounds spread {100 * result['closed_spread']:.1f} %")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"settings": {k: v for k, v in vars(args).items() if k != "consume"}, **result}, f, indent=1)
    return 0


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
