"""KV offloading (a CPU tier under the prefix cache, `--kv-offloading-size`) against the prefix cache alone and
no prefix caching, on the same requests, same KV pool, in one run.

Workload (long shared documents, short answers: multi-turn chat over a document, retrieval over the same
documents): `--num-docs` documents of `--doc-len` random tokens; each round asks one new question (16 random tokens)
about every document in turn, for `--rounds` rounds, `--max-tokens` output tokens each (ignore_eos), closed loop at
`--concurrency` requests in flight. The pool (`--num-gpu-blocks`) holds fewer tokens than all the documents, so by the
time a document comes back its cached blocks were evicted (LRU); the tier holds them all, and its prefix hits copy
them back instead of recomputing them.

Prints per configuration: wall time, output and prompt tok/s, mean and p50/p90 time to first token, prefix-cache
hit rate (of prompt tokens), blocks stored to and loaded from the tier; and the tier's ratios to the prefix cache
alone. Each configuration's greedy outputs are compared with the no-caching run's (exact where the copies are).
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from collections import deque
from pathlib import Path

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm.bench")

CONFIGS = {  # name: engine options on top of the shared ones
    "no prefix caching": {"enable_prefix_caching": False},
    "prefix caching": {"enable_prefix_caching": True},
    "prefix caching + offloading": {"enable_prefix_caching": True},  # + kv_offloading_size (run())
}


def make_requests(num_docs: int, doc_len: int, rounds: int, vocab: int, seed: int) -> list[list[int]]:
    """Round r asks question r about document 0, 1, ..., num_docs - 1 (token ids)."""
    rng = random.Random(seed)
    docs = [[rng.randrange(100, vocab) for _ in range(doc_len)] for _ in range(num_docs)]
    return [doc + [rng.randrange(100, vocab) for _ in range(16)] for _ in range(rounds) for doc in docs]


def run_closed_loop(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                    concurrency: int) -> tuple[float, list[float], list[list[int]]]:
    """Keep `concurrency` requests in flight → (seconds, time to first token per request, output token ids)."""
    todo = deque(range(len(prompts)))
    started: dict[str, float] = {}
    ttft: dict[int, float] = {}
    outs: dict[int, list[int]] = {}
    active = 0
    t0 = time.perf_counter()
    while todo or engine.has_unfinished_requests():
        while todo and active < concurrency:
            i = todo.popleft()
            started[str(i)] = time.perf_counter()
            engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, params)
            active += 1
        for out in engine.step():
            i = int(out.request_id)
            if i not in ttft and out.outputs and out.outputs[0].token_ids:
                ttft[i] = time.perf_counter() - started[out.request_id]
            if out.finished:
                outs[i] = list(out.outputs[0].token_ids)
                active -= 1
    return time.perf_counter() - t0, [ttft[i] for i in range(len(prompts))], [outs[i] for i in range(len(prompts))]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto", help="dummy: random weights")
    p.add_argument("--quantization", default=None)
    p.add_argument("--skip-tokenizer-init", action="store_true", help="a model directory without a tokenizer")
    p.add_argument("--num-docs", type=int, default=12)
    p.add_argument("--doc-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="KV pool in blocks (default: a third of the documents' blocks)")
    p.add_argument("--kv-offloading-size", type=float, default=2.0, help="GiB of the CPU tier")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    block_size = 16
    doc_blocks = -(-(args.doc_len + 16) // block_size)
    blocks = args.num_gpu_blocks or max(doc_blocks * args.num_docs // 3, doc_blocks * args.concurrency + 8)
    max_len = args.max_model_len or args.doc_len + 16 + args.max_tokens + block_size
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    results: dict = {"num_gpu_blocks": blocks, "num_docs": args.num_docs, "doc_len": args.doc_len,
                     "rounds": args.rounds, "concurrency": args.concurrency, "configs": {}}
    outputs: dict[str, list[list[int]]] = {}
    prompts: list[list[int]] = []
    for name, extra in CONFIGS.items():
        opts = dict(extra)
        if name.endswith("offloading"):
            opts["kv_offloading_size"] = args.kv_offloading_size
        engine = LLMEngine(EngineArgs(
            model=args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
            quantization=args.quantization, max_model_len=max_len, num_gpu_blocks_override=blocks,
            max_num_seqs=max(args.concurrency, 1), seed=args.seed, swap_space=0.1,
            skip_tokenizer_init=args.skip_tokenizer_init, **opts))
        if not prompts:
            prompts = make_requests(args.num_docs, args.doc_len, args.rounds, int(engine.hf_config.vocab_size),
                                    args.seed)
        run_closed_loop(engine, [[7] * 40, [9] * 40], SamplingParams(max_tokens=2), 2)  # warm-up
        if engine.scheduler.block_manager.reset_prefix_cache() is False:
            raise RuntimeError("the warm-up left blocks in use")
        before = engine.stats()
        seconds, ttft, outs = run_closed_loop(engine, prompts, params, args.concurrency)
        st = engine.stats()
        outputs[name] = outs
        q = st["prefix_cache_queries"] - before["prefix_cache_queries"]
        h = st["prefix_cache_hits"] - before["prefix_cache_hits"]
        ordered = sorted(ttft)
        e = {"seconds": seconds, "output_tok_s": sum(len(o) for o in outs) / seconds,
             "prompt_tok_s": sum(len(p) for p in prompts) / seconds,
             "mean_ttft_ms": 1e3 * statistics.fmean(ttft), "p50_ttft_ms": 1e3 * ordered[len(ordered) // 2],
             "p90_ttft_ms": 1e3 * ordered[int(0.9 * (len(ordered) - 1))],
             "prefix_hit_rate": h / q if q else 0.0,
             "stored_blocks": st.get("kv_offload_stored_blocks", 0) - before.get("kv_offload_stored_blocks", 0),
             "loaded_blocks": st.get("kv_offload_loaded_blocks", 0) - before.get("kv_offload_loaded_blocks", 0)}
        results["configs"][name] = e
        logger.info("%s: %.2f s, mean TTFT %.1f ms, prefix hits %.1f %%", name, seconds, e["mean_ttft_ms"],
                    100 * e["prefix_hit_rate"])
        del engine
    base = outputs["no prefix caching"]
    print(f"\n{len(prompts)} requests ({args.num_docs} documents of {args.doc_len} tokens × {args.rounds} rounds, "
          f"{args.max_tokens} output tokens, {args.concurrency} in flight), KV pool {blocks} blocks "
          f"({blocks * block_size} tokens; the documents: {args.num_docs * doc_blocks * block_size})")
    print(f"{'configuration':<30}{'wall s':>8}{'out tok/s':>11}{'mean TTFT ms':>14}{'p90 TTFT ms':>13}"
          f"{'hit rate':>10}{'stored':>8}{'loaded':>8}{'same outputs':>14}")
    for name, e in results["configs"].items():
        same = sum(a == b for a, b in zip(outputs[name], base))
        e["identical_to_no_caching"] = f"{same}/{len(base)}"
        print(f"{name:<30}{e['seconds']:>8.2f}{e['output_tok_s']:>11.1f}{e['mean_ttft_ms']:>14.1f}"
              f"{e['p90_ttft_ms']:>13.1f}{100 * e['prefix_hit_rate']:>9.1f}%{e['stored_blocks']:>8}"
              f"{e['loaded_blocks']:>8}{e['identical_to_no_caching']:>14}")
    tier, plain = results["configs"]["prefix caching + offloading"], results["configs"]["prefix caching"]
    results["speedup_over_prefix_caching"] = plain["seconds"] / tier["seconds"]
    results["ttft_ratio_to_prefix_caching"] = tier["mean_ttft_ms"] / plain["mean_ttft_ms"]
    print(f"offloading ÷ prefix caching alone: {results['speedup_over_prefix_caching']:.2f}× throughput, mean TTFT "
          f"{results['ttft_ratio_to_prefix_caching']:.2f}×")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    raise SystemExit(run(p.parse_args()))


if __name__ == "__main__":
    main()
