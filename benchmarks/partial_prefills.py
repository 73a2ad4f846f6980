"""Short prompts queued behind long ones: time to first token with vLLM's chunked-prefill knobs
(long_prefill_token_threshold, max_num_partial_prefills, max_long_partial_prefills) against the default
schedule, on the same requests in the same run.

    python benchmarks/partial_prefills.py [--num-long 4] [--long-words 900] [--num-short 16] [--output-len 16]
        [--threshold 128] [--partial 4] [--long-partial 1] [--max-num-batched-tokens 512]

All requests arrive at once, long prompts first (the worst case for the short ones: first come, first served puts
them behind every long prompt). Each arm runs once to warm up, then `--repeats` times; medians are printed.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

from pagedllm import LLM, SamplingParams


def _run(llm: LLM, prompts: list[str], num_long: int, output_len: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
    return {"wall": wall, "short_ttft": statistics.mean(ttft[num_long:]), "short_ttft_max": max(ttft[num_long:]),
            "long_ttft": statistics.mean(ttft[:num_long]),
            "tokens": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-long", type=int, default=4)
    ap.add_argument("--long-words", type=int, default=900)
    ap.add_argument("--num-short", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--threshold", type=int, default=128, help="long_prefill_token_threshold of the second arm")
    ap.add_argument("--partial", type=int, default=4, help="max_num_partial_prefills of the second arm")
    ap.add_argument("--long-partial", type=int, default=1, help="max_long_partial_prefills of the second arm")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="model directory or GGUF (default: the bundled model)")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                    help="each arm's KV pool in bytes (on a GPU: both engines' weights and pools fit at once)")
    args = ap.parse_args()
    words = "the quick brown fox jumps over the lazy dog".split()
    long_text = " ".join(words[i % len(words)] for i in range(args.long_words))
    prompts = [f"Document {i}: {long_text}\nSummary:" for i in range(args.num_long)]
    prompts += [f"Question {i}: what is {i} plus {i}?" for i in range(args.num_short)]
    common = dict(max_model_len=max(2048, 2 * args.long_words), max_num_batched_tokens=args.max_num_batched_tokens,
                  max_num_seqs=64, load_format=args.load_format, dtype=args.dtype,
                  **{k: v for k, v in (("model", args.model), ("tokenizer", args.tokenizer),
                                       ("kv_cache_memory_bytes", args.kv_cache_memory_bytes)) if v is not None})
    arms = {
        "default": {},
        "partial prefills": dict(long_prefill_token_threshold=args.threshold, max_num_partial_prefills=args.partial,
                                 max_long_partial_prefills=args.long_partial),
    }
    results = {}
    for name, knobs in arms.items():
        llm = LLM(**common, **knobs)
        n_tok = [len(llm.get_tokenizer().encode(p)) for p in prompts]
        _run(llm, prompts, args.num_long, args.output_len)  # warm-up
        runs = [_run(llm, prompts, args.num_long, args.output_len) for _ in range(args.repeats)]
        results[name] = {k: statistics.median(r[k] for r in runs) for k in ("wall", "short_ttft", "short_ttft_max",
                                                                             "long_ttft")}
        results[name]["tokens"] = runs[0]["tokens"]
        del llm
        gc.collect()
    print(f"{args.num_long} long prompts of {n_tok[0]} tokens, then {args.num_short} short ones of "
          f"{min(n_tok[args.num_long:])}-{max(n_tok[args.num_long:])} tokens, all at once; {args.output_len} output "
          f"tokens each; max_num_batched_tokens {args.max_num_batched_tokens}; second arm: "
          f"long_prefill_token_threshold {args.threshold}, max_num_partial_prefills {args.partial}, "
          f"max_long_partial_prefills {args.long_partial}; medians of {args.repeats}")
    print(f"{'arm':18s} {'short TTFT mean':>16s} {'short TTFT max':>15s} {'long TTFT mean':>15s} {'wall':>8s}")
    for name, r in results.items():
        print(f"{name:18s} {1e3 * r['short_ttft']:13.0f} ms {1e3 * r['short_ttft_max']:12.0f} ms "
              f"{1e3 * r['long_ttft']:12.0f} ms {r['wall']:7.2f} s")
    a, b = results["default"], results["partial prefills"]
    print(f"ratios (default / partial prefills): short TTFT mean {a['short_ttft'] / b['short_ttft']:.2f}x, "
          f"short TTFT max {a['short_ttft_max'] / b['short_ttft_max']:.2f}x, long TTFT mean "
          f"{a['long_ttft'] / b['long_ttft']:.2f}x, wall {a['wall'] / b['wall']:.2f}x")
    same = sum(x == y for x, y in zip(a["tokens"], b["tokens"]))
    print(f"greedy outputs identical: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
