"""Online serving benchmark (like vLLM's benchmark_serving): a seeded workload sent to a running server.

Requests arrive as a Poisson process at --request-rate (or gamma-distributed gaps with --burstiness;
1.0 = Poisson), each streamed over HTTP from /v1/completions. Reports request throughput, output
tokens/s and mean/median/p99 of time-to-first-token (TTFT), time-per-output-token (TPOT),
inter-token latency (ITL) and end-to-end latency (E2EL).

    pagedllm serve --num-gpu-blocks-override 512 &
    pagedllm bench serving --num-prompts 50 --request-rate 2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import numpy as np

from pagedllm.benchmarks import sse_client


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="Server URL (default: http://HOST:PORT).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="Model name to send (default: the server's first model).")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--input-len", type=int, default=64, help="Mean prompt length in tokens (random token ids).")
    p.add_argument("--output-len", type=int, default=32, help="Mean output length in tokens (ignore_eos).")
    p.add_argument("--range-ratio", type=float, default=0.5,
                   help="Lengths are uniform in [len*(1-r), len*(1+r)] (default: 0.5).")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Requests per second; inf sends all at once (default: inf).")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="Gamma shape of the arrival gaps; 1 = Poisson, <1 burstier (default: 1).")
    p.add_argument("--max-concurrency", type=int, default=None, help="Cap on requests in flight.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", default=None, help="Write the summary (and settings) to this JSON file.")


def make_workload(args, vocab_lo: int = 1000, vocab_hi: int = 30000) -> list[tuple[list[int], int]]:
    """Seeded (prompt token ids, output length) pairs."""
    rng = random.Random(args.seed)

    def length(mean: int) -> int:
        lo, hi = max(1, int(mean * (1 - args.range_ratio))), max(1, int(mean * (1 + args.range_ratio)))
        return rng.randint(lo, hi)

    return [([rng.randrange(vocab_lo, vocab_hi) for _ in range(length(args.input_len))], length(args.output_len))
            for _ in range(args.num_prompts)]


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    if rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    theta = 1.0 / (rate * burstiness)
    return list(rng.gamma(shape=burstiness, scale=theta, size=n))


async def _one(session, url: str, headers: dict, body: dict, prompt_len: int) -> RequestResult:
    res = RequestResult(prompt_len=prompt_len)
    t0 = time.perf_counter()
    last = t0
    try:
        async for payload in sse_client.stream_events(session, url, body, headers):
            if payload.get("usage"):
                res.output_len = payload["usage"]["completion_tokens"]
            if payload.get("choices") and payload["choices"][0].get("text"):
                now = time.perf_counter()
                if res.ttft == 0.0:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
        res.e2e = time.perf_counter() - t0
        res.ok = True
    except Exception as e:  # a failed request is reported, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


async def benchmark(args) -> dict:
    base = args.base_url or f"http://{args.host}:{args.port}"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with sse_client.new_session() as session:
        model = args.model
        if model is None:
            model = (await sse_client.get_json(session, base + "/v1/models", headers))["data"][0]["id"]
        workload = make_workload(args)
        gaps = arrival_gaps(len(workload), args.request_rate, args.burstiness, args.seed)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def limited(body, plen):
            if sem is None:
                return await _one(session, base + args.endpoint, headers, body, plen)
            async with sem:
                return await _one(session, base + args.endpoint, headers, body, plen)

        tasks = []
        start = time.perf_counter()
        # Arrivals follow the schedule from the start, not gap after gap: a busy client does not slow them.
        due = start
        for (prompt, out_len), gap in zip(workload, gaps):
            due += gap
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            tasks.append(asyncio.create_task(limited(body, len(prompt))))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, args, model)


def _stats(values: list[float], name: str) -> dict[str, float]:
    arr = np.asarray(values, dtype=float) * 1000.0 if values else np.zeros(1)
    return {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
            f"p99_{name}_ms": float(np.percentile(arr, 99))}


def summarize(results: list[RequestResult], duration: float, args, model: str) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    summary = {
        "model": model, "num_prompts": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "request_rate": args.request_rate, "burstiness": args.burstiness, "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput_per_s": len(ok) / duration, "output_throughput_tok_s": out_tokens / duration,
        "total_token_throughput_tok_s": (in_tokens + out_tokens) / duration,
        **_stats([r.ttft for r in ok], "ttft"), **_stats(tpot, "tpot"),
        **_stats([x for r in ok for x in r.itl], "itl"), **_stats([r.e2e for r in ok], "e2el"),
    }
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def print_summary(s: dict) -> None:
    print("=" * 14 + " Serving Benchmark Result " + "=" * 14)
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
            ("Total input tokens", s["total_input_tokens"]), ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput_per_s']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput_tok_s']:.2f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput_tok_s']:.2f}")]
    for metric, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                          ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        rows.append((f"-- {title} --", ""))
        for kind in ("mean", "median", "p99"):
            rows.append((f"{kind.capitalize()} {metric.upper()} (ms)", f"{s[f'{kind}_{metric}_ms']:.2f}"))
    for k, v in rows:
        print(f"{k:<42}{v:>12}")
    for e in s.get("errors", []):
        print("error:", e)


def run(args: argparse.Namespace) -> int:
    summary = sse_client.run(lambda: benchmark(args))
    print_summary(summary)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"settings": {k: v for k, v in vars(args).items() if k != "func"}, "result": summary},
                      f, indent=2, default=str)
    return 0 if summary["failed"] == 0 else 1


__all__ = ["add_args", "run", "benchmark", "make_workload", "arrival_gaps", "summarize", "RequestResult"]
