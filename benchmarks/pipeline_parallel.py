"""One process against two pipeline stages (--pipeline-parallel-size 2) and two tensor-parallel ranks, on the same
seeded requests, each configuration in a fresh engine, alternating rounds.

    python benchmarks/pipeline_parallel.py --num-prompts 32 --min-in 16 --max-in 256 --output-len 64

Steps overlap in the stages (one batch per stage in flight; CPU, mp executor). Prints each configuration's output tok/s and wall time, the ratio to the one-process engine, the largest weight
bytes and KV pool bytes any rank holds (a stage holds its layers only: what pipeline parallelism is for), and
whether every configuration generated the same greedy tokens. The weights are float32 (quantization='none') in
every configuration: the stages dequantize a GGUF file at load, so the one-process engine does too. Each stage's
batch is half of the sequences, so decoding reads every weight twice as often per token as one process does.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.throughput import make_workload
from pagedllm.distributed.parallel_state import PP_LAYER_PARTITION_ENV

PARTITION = "_partition"  # (a config's VLLM_PP_LAYER_PARTITION, set in the environment around its run)


def _rank_bytes(llm: LLM) -> tuple[int, int]:
    """(largest weight bytes, largest KV pool bytes) over the engine's ranks."""
    def measure(w) -> tuple[int, int]:
        from pagedllm.model.layers.quantized_linear import resident_weight_bytes

        weights = resident_weight_bytes(w.model)  # (oneDNN-packed copies included)
        kv = sum(t.numel() * t.element_size() for layer in w.cache_engine.gpu_cache for t in layer)
        return weights, kv

    per_rank = llm.collective_rpc(measure)
    return max(w for w, _ in per_rank), max(k for _, k in per_rank)


def _run(kw: dict, wl) -> dict:
    llm = LLM(**kw)
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in wl.output_len]
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in wl.prompts], params, use_tqdm=True)
        elapsed = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        weights, kv = _rank_bytes(llm)
        return {"out_tok_s": sum(map(len, tokens)) / elapsed, "elapsed_s": elapsed, "weights_bytes": weights,
                "kv_bytes": kv, "preemptions": llm.stats().get("num_preemptions", 0), "tokens": tokens}
    finally:
        executor = llm.llm_engine.executor
        if hasattr(executor, "shutdown"):
            executor.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M GGUF")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--min-in", type=int, default=16)
    p.add_argument("--max-in", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-gpu-blocks-override", type=int, default=1024,
                   help="KV blocks per configuration (the same for all, so they schedule alike)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--pp-partition", default=None,
                   help="also run PP=2 with this VLLM_PP_LAYER_PARTITION (e.g. 18,12: fewer layers on the last stage, "
                        "which also runs the LM head)")
    p.add_argument("--result-json", default=None)
    args = p.parse_args()
    wl = make_workload(args.num_prompts, args.min_in, args.max_in, args.output_len, 49152, seed=0)
    common = dict(quantization="none", dtype="float32", num_gpu_blocks_override=args.num_gpu_blocks_override,
                  max_model_len=1024, swap_space=0.05)
    if args.model:
        common["model"] = args.model
    configs = {"1 process": {}, "PP=2 (mp)": {"pipeline_parallel_size": 2},
               "TP=2 (mp)": {"tensor_parallel_size": 2}}
    if args.pp_partition:
        configs[f"PP=2 ({args.pp_partition})"] = {"pipeline_parallel_size": 2, PARTITION: args.pp_partition}
    results: dict[str, list[dict]] = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, extra in configs.items():
            partition = extra.pop(PARTITION, None)
            if partition:
                os.environ[PP_LAYER_PARTITION_ENV] = partition
            try:
                res = _run({**common, **extra}, wl)
            finally:
                os.environ.pop(PP_LAYER_PARTITION_ENV, None)
                if partition:
                    extra[PARTITION] = partition
            results[name].append(res)
            print(f"round {r + 1} {name:<14} {res['out_tok_s']:8.1f} out tok/s  {res['elapsed_s']:7.2f} s  "
                  f"weights/rank {res['weights_bytes'] / 2**20:7.1f} MiB  KV pool/rank {res['kv_bytes'] / 2**20:7.1f} "
                  f"MiB  preemptions {res['preemptions']}", flush=True)
    base = statistics.mean(r["out_tok_s"] for r in results["1 process"])
    print(f"\n{args.num_prompts} requests, {args.min_in}-{args.max_in} in, {args.output_len} out, float32 weights, "
          f"{args.num_gpu_blocks_override} KV blocks")
    print(f"{'config':<16}{'out tok/s (rounds)':>24}{'vs 1 process':>14}{'weights/rank MiB':>18}{'KV pool/rank MiB':>18}")
    for name, runs in results.items():
        tput = [r["out_tok_s"] for r in runs]
        print(f"{name:<16}{' / '.join(f'{t:.1f}' for t in tput):>24}{statistics.mean(tput) / base:>13.2f}x"
              f"{runs[0]['weights_bytes'] / 2**20:>18.1f}{runs[0]['kv_bytes'] / 2**20:>18.1f}")
    reference = results["1 process"][0]["tokens"]
    same = {name: all(r["tokens"] == reference for r in runs) for name, runs in results.items()}
    print("same greedy tokens as the one-process engine: " + ", ".join(f"{n}: {'yes' if v else 'NO'}"
                                                                       for n, v in same.items()))
    if args.result_json:
        for runs in results.values():
            for r in runs:
                r.pop("tokens")
        with open(args.result_json, "w") as f:
            json.dump({"args": vars(args), "results": results, "same_tokens": same}, f, indent=1)


if __name__ == "__main__":
    main()
