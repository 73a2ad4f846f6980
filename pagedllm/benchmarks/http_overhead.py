"""What the HTTP path costs: the same batch through `LLM.generate` and through a real `pagedllm serve`.

One run times N concurrent requests (default 64 × 50 random prompt tokens, greedy, ignore_eos) for each
output length (default 8 and 64) through a `pagedllm serve` process this benchmark starts with the same
engine flags (every request streamed over its own new HTTP connection, all sent at once) and through
`LLM.generate` in this process, both engines up at once and the rounds alternating (HTTP, offline, HTTP,
...), so a change in the machine's load hits both alike. Each figure is the median of --repeats timed
rounds after one warm-up round of each. It prints both times, their ratio (the target is ≤ 1.3×), the
first request's time to first token, and whether the greedy texts are identical. On a GPU give the
server part of the memory (--server-arg=--gpu-memory-utilization=0.4): the in-process engine sizes its
pool from what is left.

    pagedllm bench http-overhead --num-gpu-blocks-override 512                       # CPU, bundled model
    pagedllm bench http-overhead --model DIR --load-format dummy --device cuda --dtype bfloat16 \\
        --server-arg=--gpu-memory-utilization=0.4
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import random
import statistics
import sys
import time
from dataclasses import dataclass, field, fields

from pagedllm.benchmarks import sse_client
from pagedllm.benchmarks.server_process import ServerProcess
from pagedllm.engine.arg_utils import EngineArgs

logger = logging.getLogger("pagedllm.bench.http_overhead")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=64, help="Concurrent requests per round (default: 64).")
    p.add_argument("--input-len", type=int, default=50, help="Prompt tokens per request (default: 50).")
    p.add_argument("--output-lens", type=int, nargs="+", default=[8, 64],
                   help="Output tokens per request, one measurement each (default: 8 64).")
    p.add_argument("--repeats", type=int, default=3, help="Timed rounds per measurement (default: 3).")
    p.add_argument("--prompt-seed", type=int, default=0, help="Seed of the random prompts (default: 0).")
    p.add_argument("--vocab-hi", type=int, default=30000,
                   help="Prompt token ids are drawn from [1000, VOCAB_HI) (default: 30000).")
    p.add_argument("--no-stream", action="store_true", help="Non-streaming HTTP requests (default: streamed).")
    p.add_argument("--server-startup-timeout", type=float, default=600.0)
    p.add_argument("--server-arg", action="append", default=[],
                   help="Extra argument for `pagedllm serve` only (repeatable), e.g. --server-arg=--foo.")
    p.add_argument("--output-json", default=None, help="Write settings and results to this JSON file.")
    EngineArgs.add_cli_args(p)


def engine_cli_flags(engine_args: EngineArgs) -> list[str]:
    """The `pagedllm serve` flags that rebuild `engine_args` (fields left at their default are omitted)."""
    flags: list[str] = []
    for f in fields(EngineArgs):
        value = getattr(engine_args, f.name)
        if value == f.default:
            continue
        name = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(name if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, (dict, list)):  # JSON flags (--hf-overrides, --compilation-config, ...)
            flags += [name, json.dumps(value)]
        elif value is not None:
            flags += [name, str(value)]
    return flags


def make_prompts(n: int, input_len: int, seed: int, vocab_hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab_hi) for _ in range(input_len)] for _ in range(n)]


@dataclass
class Round:
    seconds: float
    first_ttft: float  # time to first token of request 0, from the round's start
    texts: list[str] = field(default_factory=list)


@dataclass
class Measurement:
    output_len: int
    offline: list[Round] = field(default_factory=list)
    http: list[Round] = field(default_factory=list)

    def summary(self) -> dict:
        off = statistics.median(r.seconds for r in self.offline)
        web = statistics.median(r.seconds for r in self.http)
        same = sum(a == b for a, b in zip(self.offline[-1].texts, self.http[-1].texts))
        return {
            "output_len": self.output_len,
            "offline_s": off, "http_s": web, "ratio": web / off,
            "offline_rounds_s": [r.seconds for r in self.offline], "http_rounds_s": [r.seconds for r in self.http],
            "offline_first_ttft_s": statistics.median(r.first_ttft for r in self.offline),
            "http_first_ttft_s": statistics.median(r.first_ttft for r in self.http),
            "identical_texts": same, "num_requests": len(self.offline[-1].texts),
        }


async def _http_round(session, url: str, model: str, prompts: list[list[int]], output_len: int,
                      stream: bool) -> Round:
    t0 = time.perf_counter()
    first_ttft = [float("nan")]

    async def one(i: int, prompt: list[int]) -> str:
        body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": stream}
        if not stream:
            r = await sse_client.post_json(session, url, body)
            if i == 0:
                first_ttft[0] = time.perf_counter() - t0  # no stream: the whole response
            return r["choices"][0]["text"]
        text = []
        async for payload in sse_client.stream_events(session, url, body):
            for ch in payload["choices"]:
                if ch.get("text"):
                    if i == 0 and not text:
                        first_ttft[0] = time.perf_counter() - t0
                    text.append(ch["text"])
        return "".join(text)

    texts = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    return Round(time.perf_counter() - t0, first_ttft[0], list(texts))


def _model_name(base_url: str) -> str:
    async def go() -> str:
        async with sse_client.new_session() as s:
            return (await sse_client.get_json(s, base_url + "/v1/models"))["data"][0]["id"]

    return sse_client.run(go)


def _http_once(base_url: str, model: str, prompts, n_out: int, stream: bool) -> Round:
    """One round on a fresh client, each request on a connection of its own (as independent clients)."""

    async def go() -> Round:
        async with sse_client.new_session(force_close=True) as s:
            return await _http_round(s, base_url + "/v1/completions", model, prompts, n_out, stream)

    return sse_client.run(go)


def _offline_once(llm, prompts, n_out: int) -> Round:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
    t0 = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    m = res[0].metrics
    # arrival_time is monotonic; generate() added request 0 right after t0.
    ttft = (m["first_token_time"] - m["arrival_time"]) if m.get("first_token_time") else float("nan")
    return Round(seconds, ttft, [o.outputs[0].text for o in res])


def _measure(server: ServerProcess, engine_args: EngineArgs, prompts, output_lens, repeats: int,
             stream: bool) -> dict[int, Measurement]:
    """Rounds alternate HTTP / LLM.generate, so a change in the machine's load hits both alike."""
    from pagedllm import LLM

    model = _model_name(server.base_url)
    llm = LLM(**dataclasses.asdict(engine_args))
    out: dict[int, Measurement] = {}
    for n_out in output_lens:
        _http_once(server.base_url, model, prompts, n_out, stream)  # warm-up
        _offline_once(llm, prompts, n_out)
        m = out[n_out] = Measurement(n_out)
        for k in range(repeats):
            for kind in ("http", "offline"):
                if kind == "http":
                    r = _http_once(server.base_url, model, prompts, n_out, stream)
                    m.http.append(r)
                else:
                    r = _offline_once(llm, prompts, n_out)
                    m.offline.append(r)
                logger.info("%-7s out=%d round %d: %.3f s (first TTFT %.1f ms)", kind, n_out, k, r.seconds,
                            r.first_ttft * 1e3)
    del llm
    return out


def run(args: argparse.Namespace) -> int:
    engine_args = EngineArgs.from_cli_args(args)
    prompts = make_prompts(args.num_requests, args.input_len, args.prompt_seed, args.vocab_hi)
    flags = engine_cli_flags(engine_args) + list(args.server_arg)
    server = ServerProcess(flags, args.server_startup_timeout)
    try:
        measured = _measure(server, engine_args, prompts, args.output_lens, args.repeats, not args.no_stream)
    except BaseException:
        print(server.tail(), file=sys.stderr)
        raise
    finally:
        server.stop()
    results = []
    print(f"{args.num_requests} concurrent requests, {args.input_len} prompt tokens, greedy, ignore_eos; "
          f"median of {args.repeats} rounds after a warm-up; HTTP {'streamed' if not args.no_stream else 'whole'}")
    print(f"{'out tok':>8} {'LLM.generate s':>15} {'HTTP s':>9} {'ratio':>7} {'TTFT#0 offline ms':>18} "
          f"{'TTFT#0 HTTP ms':>15} {'same text':>10}")
    for n_out in args.output_lens:
        s = measured[n_out].summary()
        results.append(s)
        print(f"{n_out:>8} {s['offline_s']:>15.3f} {s['http_s']:>9.3f} {s['ratio']:>6.2f}x "
              f"{s['offline_first_ttft_s'] * 1e3:>18.1f} {s['http_first_ttft_s'] * 1e3:>15.1f} "
              f"{s['identical_texts']:>5}/{s['num_requests']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"settings": {k: v for k, v in vars(args).items() if k != "func"},
                       "server_flags": flags, "results": results}, f, indent=2, default=str)
    return 0


__all__ = ["add_args", "engine_cli_flags", "make_prompts", "run"]
