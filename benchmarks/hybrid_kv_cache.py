"""The hybrid KV cache (a block table per group of layers, sliding groups freeing blocks behind their window) against
one block table for every layer (`--disable-hybrid-kv-cache-manager`, pagedllm before it and vLLM's flag), at the
same KV cache bytes, on the same requests, in one run:

    python benchmarks/gpu/make_random_windowed.py /tmp/g270 gemma3-270m
    python benchmarks/hybrid_kv_cache.py --model /tmp/g270 --num-prompts 32 --input-len 1024 --output-len 128 \\
        --kv-cache-memory-bytes 400000000

Each layout gets a fresh engine; the table shows the pool (blocks, the token-layers a block holds), how many
full-length sequences its bytes hold (a sliding group needs its window plus one step's chunk), the mean rows of the
decode steps (how many sequences ran together), preemptions, wall time and output throughput, and the ratios. The
greedy outputs of the two layouts are compared token for token (the attention reads the same K/V either way). Each
layout's steps are listed by kind and path (count, mean and total time: device time on CUDA), against its wall time.
The layouts alternate over `--rounds` engines each (hybrid first, then one table first, ...), since a process's first
engine runs slower, and each layout's fastest engine is reported.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from pagedllm import LLM, SamplingParams
from pagedllm.core.kv_cache_groups import blocks_for_sequence
from pagedllm.worker.step_stats import format_summary


def sequences_that_fit(llm: LLM, length: int) -> float:
    """Full-length sequences (prompt + output) the pool's blocks hold at once in decode (after a step's chunk)."""
    bm = llm.llm_engine.scheduler.block_manager
    return bm.num_gpu_blocks / blocks_for_sequence(bm.group_windows, length, bm.block_size)


def prompt_id_limit(model: str) -> int:
    """Prompt ids are drawn below this: 30 000, or an HF model directory's smaller vocabulary (its text config's,
    for a multimodal one). A GGUF file's vocabulary is not read here (Gemma's are over 256 000 ids)."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return 30000
    config = json.loads(path.read_text())
    return min(30000, int(config.get("vocab_size") or config["text_config"]["vocab_size"]))


def run_layout(args: argparse.Namespace, hybrid: bool, prompts: list[list[int]]) -> dict:
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype, device=args.device, load_format=args.load_format,
              block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              max_model_len=args.input_len + args.output_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, disable_hybrid_kv_cache_manager=not hybrid,
              enforce_eager=args.enforce_eager, disable_log_stats=True)
    bm = llm.llm_engine.scheduler.block_manager
    if hybrid and bm.num_groups == 1:
        raise SystemExit("the hybrid layout is off for this model (one KV cache group): give a model mixing full and "
                         "sliding-window layers (Gemma 2/3)")
    worker = llm.llm_engine.executor.driver_worker
    steps = worker.model_runner.enable_step_stats()
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    decode_rows = [n for kind, _, n, *_ in steps.records if kind == "decode"]
    stats = llm.stats()
    summary = steps.summary()
    result = {
        "layout": "hybrid" if hybrid else "one table",
        "groups": bm.num_groups, "blocks": bm.num_gpu_blocks, "layers_per_block": worker.cache_engine.num_slots,
        "sequences_that_fit": sequences_that_fit(llm, args.input_len + args.output_len),
        "mean_decode_rows": sum(decode_rows) / max(1, len(decode_rows)), "decode_steps": len(decode_rows),
        "preemptions": stats["num_preemptions"], "elapsed_s": elapsed,
        "output_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "steps": summary, "steps_total_s": sum(v["total_s"] for v in summary.values()),
    }
    del llm
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model mixing full and sliding-window layers (Gemma 2/3)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=400_000_000)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto", help="dummy: random weights from config.json alone")
    p.add_argument("--device", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true",
                   help="both layouts without CUDA graphs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2,
                   help="engines per layout, in the order hybrid, one table, one table, hybrid, ... (the first "
                        "engine of a process runs slower); the table shows each layout's fastest")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    rng = random.Random(args.seed)
    top = prompt_id_limit(args.model)
    prompts = [[rng.randrange(min(100, top // 2), top) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    order = [layout for i in range(args.rounds) for layout in ((True, False) if i % 2 == 0 else (False, True))]
    every = {True: [], False: []}
    for hybrid in order:
        every[hybrid].append(run_layout(args, hybrid, prompts))
    runs = [min(every[hybrid], key=lambda r: r["elapsed_s"]) for hybrid in (True, False)]
    same = sum(a == b for a, b in zip(runs[0]["tokens"], runs[1]["tokens"]))
    print(f"\n{args.num_prompts} requests of {args.input_len} prompt + {args.output_len} output tokens, "
          f"KV cache {args.kv_cache_memory_bytes / 2**20:.0f} MiB")
    print(f"{'layout':<10}{'groups':>7}{'blocks':>8}{'layers/blk':>11}{'seqs fit':>9}{'decode rows':>12}"
          f"{'preempt':>8}{'wall s':>8}{'out tok/s':>10}")
    for r in runs:
        print(f"{r['layout']:<10}{r['groups']:>7}{r['blocks']:>8}{r['layers_per_block']:>11}"
              f"{r['sequences_that_fit']:>9.1f}{r['mean_decode_rows']:>12.1f}{r['preemptions']:>8}"
              f"{r['elapsed_s']:>8.2f}{r['output_tok_s']:>10.1f}")
    for hybrid, r in zip((True, False), runs):
        print(f"{r['layout']}: wall s per engine, in order {[round(x['elapsed_s'], 2) for x in every[hybrid]]}")
    for r in runs:  # the steps' own time (device time on CUDA) against the wall: the rest is the host's
        print(f"\n{r['layout']}: steps {r['steps_total_s']:.2f} s of {r['elapsed_s']:.2f} s wall\n"
              f"{format_summary(r['steps'])}")
    h, o = runs
    print(f"hybrid / one table: sequences that fit {h['sequences_that_fit'] / o['sequences_that_fit']:.2f}x, "
          f"mean decode rows {h['mean_decode_rows'] / o['mean_decode_rows']:.2f}x, "
          f"output throughput {h['output_tok_s'] / o['output_tok_s']:.2f}x; "
          f"identical greedy outputs {same}/{len(prompts)}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs],
                       "elapsed_s_per_engine": {("hybrid" if h else "one table"): [r["elapsed_s"] for r in every[h]]
                                                for h in (True, False)},
                       "identical_outputs": same}, f, indent=1)


if __name__ == "__main__":
    main()
