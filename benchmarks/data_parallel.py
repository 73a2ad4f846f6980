"""One engine against `--data-parallel-size N` engines, same server flags, same seeded requests, alternating rounds.

    python benchmarks/data_parallel.py --data-parallel-size 2 --num-prompts 128 --input-len 128 --output-len 128

Each configuration gets a fresh `pagedllm serve` (the bundled model unless --model) and the whole workload of
`pagedllm bench serving`; the table shows output tok/s, mean TTFT and median TPOT per round, and the ratio of the
data-parallel server's output throughput to the single engine's. On a CPU host the ranks split the cores (a
2-core machine: one torch thread each against two threads for the single engine).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics

from pagedllm.benchmarks import serving
from pagedllm.benchmarks.server_process import ServerProcess


def _preemptions(server: ServerProcess) -> float:
    """vllm:num_preemptions_total from the server's /metrics (all ranks)."""
    import httpx

    text = httpx.get(server.url("/metrics"), timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(r"^vllm:num_preemptions_total(?:\{[^}]*\})? (\S+)$", text,
                                                       re.MULTILINE))


def _serve_and_measure(flags: list[str], args: argparse.Namespace) -> dict:
    server = ServerProcess(flags)
    try:
        args.base_url = server.base_url
        summary = asyncio.run(serving.benchmark(args))
        summary["preemptions"] = _preemptions(server)
        return summary
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serving.add_args(p)
    p.add_argument("--data-parallel-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--server-args", default="--num-gpu-blocks-override 4096 --max-model-len 1024 --no-dashboard",
                   help="Flags given to both servers (a pool override applies to each rank; the default pool holds "
                        "the default workload without preemption in either configuration).")
    args = p.parse_args()
    common = args.server_args.split()
    configs = {"1 engine": common, f"{args.data_parallel_size} engines (DP)":
               [*common, "--data-parallel-size", str(args.data_parallel_size)]}
    results: dict[str, list[dict]] = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, flags in configs.items():
            s = _serve_and_measure(flags, args)
            if s["failed"]:
                raise SystemExit(f"{name}: {s['failed']} request(s) failed: {s.get('errors')}")
            results[name].append(s)
            print(f"round {r + 1} {name:<18} {s['output_throughput_tok_s']:8.1f} out tok/s  "
                  f"mean TTFT {s['mean_ttft_ms']:8.1f} ms  median TPOT {s['median_tpot_ms']:7.1f} ms  "
                  f"preemptions {s['preemptions']:.0f}", flush=True)
    print(f"\n{args.num_prompts} requests, ~{args.input_len} in / ~{args.output_len} out, rate {args.request_rate}")
    print(f"{'server':<20}{'out tok/s (rounds)':>28}{'mean TTFT ms':>14}{'median TPOT ms':>16}")
    for name, runs in results.items():
        tput = [s["output_throughput_tok_s"] for s in runs]
        print(f"{name:<20}{' / '.join(f'{t:.1f}' for t in tput):>28}"
              f"{statistics.mean(s['mean_ttft_ms'] for s in runs):>14.1f}"
              f"{statistics.mean(s['median_tpot_ms'] for s in runs):>16.1f}")
    single, dp = (statistics.mean(s["output_throughput_tok_s"] for s in runs) for runs in results.values())
    print(f"DP / 1 engine output throughput: {dp / single:.2f}x")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"results": results, "ratio": dp / single}, f, indent=1)


if __name__ == "__main__":
    main()
