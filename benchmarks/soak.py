"""Soak test of `pagedllm serve`: schema fuzz + hostile bodies, then N concurrent streams (default 1 000)
on a pool of a few dozen blocks with mixed n, best_of, stop strings, prefix caching, bad requests,
client disconnects, aborts, choice / regex / JSON-schema constraints, named tool calls and requests whose
allowed_token_ids and logit_bias leave a few words, repeated for
--rounds. Prints requests sent / completed / failed by class / lost / blocks leaked / server RSS per round /
latency, and exits non-zero if anything was lost, leaked, answered with a 5xx, or the server's memory grew
after the first round, if a constrained output that the grammar ended (or any allowed_token_ids output) breaks its
constraint, or if a greedy
request's output differed from the same request served alone (with --check-seeded, the default under
VLLM_BATCH_INVARIANT=1, seeded sampled ones too). --server-args adds serve flags (an FP8 pool, speculation);
more --max-tokens makes the pool preempt.

    python benchmarks/soak.py --num-requests 1000 --num-gpu-blocks 48
    VLLM_BATCH_INVARIANT=1 python benchmarks/soak.py --max-tokens 24 --server-args "--kv-cache-dtype fp8"
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conftest_server import RemoteServer  # noqa: E402
from reliability import LoadResult, fuzz_schema, run_load, send_hostile  # noqa: E402

from pagedllm.batch_invariance import batch_invariant_from_env  # noqa: E402

logging.basicConfig(level=logging.INFO, format="%(asctime)s soak: %(message)s")
log = logging.getLogger("soak")
logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
KEY = "soak-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name"))
    except Exception:
        return platform.processor() or "unknown"


def _rss_mib(pid: int) -> float:
    """Resident memory of a process (Linux /proc), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc): the API server's engine-core process among them."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited while we looked
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def _idle_rss_mib(server: RemoteServer) -> float:
    """RSS of the server and its engine-core process together, once the engine has been idle past its
    release of freed memory (`idle_release_s`, 1 s)."""
    time.sleep(2.0)
    pid = server.proc.pid
    total = 0.0
    for p in (pid, *_descendants(pid)):
        try:
            total += _rss_mib(p)
        except OSError:  # a helper process that exited meanwhile
            pass
    return round(total, 1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--num-gpu-blocks", type=int, default=48)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=128)
    p.add_argument("--fuzz-examples", type=int, default=25, help="schemathesis cases per route and mode")
    p.add_argument("--rounds", type=int, default=3, help="load rounds (memory must not grow after the first)")
    p.add_argument("--max-rss-growth-mib", type=float, default=64.0,
                   help="allowed server RSS growth (API server + engine core) from the end of round 1 to the end of the last round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--check-seeded", action=argparse.BooleanOptionalAction, default=None,
                   help="also require seeded sampled requests (n=2, best_of, stop strings) to equal themselves served "
                        "alone; default: on when VLLM_BATCH_INVARIANT=1 is set for the server")
    p.add_argument("--server-args", default="",
                   help="more `pagedllm serve` flags, e.g. \"--kv-cache-dtype fp8\" or a --speculative-config")
    args = p.parse_args()

    check_seeded = batch_invariant_from_env() if args.check_seeded is None else args.check_seeded
    server = RemoteServer(["--num-gpu-blocks-override", str(args.num_gpu_blocks), "--max-model-len",
                           str(args.max_model_len), "--swap-space", "0.05", "--max-num-seqs", str(args.max_num_seqs),
                           "--enable-prefix-caching", "--api-key", KEY, *shlex.split(args.server_args)])
    report: dict = {"cpu": _cpu_model(), "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
                    "date": time.strftime("%Y-%m-%d"), "pool_blocks": args.num_gpu_blocks,
                    "server_args": args.server_args, "check_seeded": check_seeded}
    try:
        t0 = time.monotonic()
        statuses, fuzz_failures = fuzz_schema(server.base_url, AUTH, args.fuzz_examples, args.seed)
        log.info("schemathesis: %d cases %s in %.0f s, %d failures", sum(statuses.values()), dict(statuses),
                 time.monotonic() - t0, len(fuzz_failures))
        hstat, hostile_failures = send_hostile(server.base_url, AUTH)
        log.info("hostile bodies: %s, %d failures", dict(hstat), len(hostile_failures))
        for f in (fuzz_failures + hostile_failures)[:20]:
            log.error("  %s", f)
        m = server.wait_idle(120)
        fuzz_leaked = int(m["pagedllm:kv_blocks_total"] - m["pagedllm:kv_blocks_free"])
        rss_mb = [_idle_rss_mib(server)]  # after the fuzz, before any load
        before = server.metrics()
        total = LoadResult()
        leaked_per_round: list[int] = []
        wall = 0.0
        for r in range(args.rounds):
            t0 = time.monotonic()
            res = asyncio.run(run_load(server.base_url, AUTH, args.num_requests, args.max_tokens, args.seed + r,
                                       check_seeded=check_seeded))
            wall += time.monotonic() - t0
            m = server.wait_idle(120)
            leaked_per_round.append(int(m["pagedllm:kv_blocks_total"] - m["pagedllm:kv_blocks_free"]))
            rss_mb.append(_idle_rss_mib(server))
            total.sent += res.sent
            total.outcomes.update(res.outcomes)
            total.problems += res.problems
            total.latencies += res.latencies
            total.constrained.update(res.constrained)
            log.info("round %d/%d: %s, p99 %.2f s, blocks leaked %d, server RSS %.0f MiB", r + 1, args.rounds,
                     dict(res.outcomes), res.p(0.99), leaked_per_round[-1], rss_mb[-1])
        # Memory is stable when the last round ends where the first one did (the first warms allocators up).
        rss_growth = round(rss_mb[-1] - rss_mb[1], 1)
        accounted = sum(total.outcomes.values()) - total.outcomes["lost"]
        report.update(
            fuzz_cases=sum(statuses.values()), fuzz_failures=len(fuzz_failures), hostile_cases=sum(hstat.values()),
            hostile_failures=len(hostile_failures), blocks_leaked_after_fuzz=fuzz_leaked, rounds=args.rounds,
            sent=total.sent, accounted=accounted, outcomes=dict(sorted(total.outcomes.items())), lost=total.lost,
            output_problems=len(total.problems), constrained_outputs=dict(sorted(total.constrained.items())),
            blocks_leaked=max(leaked_per_round), running_after=m["vllm:num_requests_running"],
            preemptions=m["vllm:num_preemptions_total"] - before["vllm:num_preemptions_total"],
            server_rss_mib=rss_mb, rss_growth_mib=rss_growth,
            rss_growth_per_round_mib=[round(b - a, 1) for a, b in zip(rss_mb[1:], rss_mb[2:])],
            wall_s=round(wall, 1), p50_s=round(total.p(0.5), 2), p99_s=round(total.p(0.99), 2),
        )
        for prob in total.problems[:20]:
            log.error("  %s", prob)
    finally:
        server.stop(signal.SIGTERM)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    bad = (report["lost"] or report["blocks_leaked"] or report["output_problems"] or report["fuzz_failures"]
           or report["hostile_failures"] or report["running_after"] or report["blocks_leaked_after_fuzz"]
           or report["accounted"] != report["sent"] or (args.rounds > 1 and rss_growth > args.max_rss_growth_mib))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
