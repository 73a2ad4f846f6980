"""The schedule of a GPU offline run, replayed on the CPU: the real engine (scheduler, block manager, async
scheduling, chunked prefill) with a one-layer model of tiny width, so only the schedule is real. Given a
pool size, prints how many decode and mixed steps the workload takes, the batch they run at, how full the
pool is, and how long the tail lasts (steps after the waiting queue empties) — what the lower bound
(`pagedllm/benchmarks/lower_bound.py`, which assumes every decode step at the pool's full batch) leaves out.

    python benchmarks/schedule_sim.py --num-prompts 3000 --num-gpu-blocks 6908 13817

The workload is `benchmarks/throughput.py`'s (`--dataset sharegpt-like`, the default here, or `uniform`) drawn with
a 32 000-token vocabulary, so the lengths are those of the GPU runs; token ids are folded into the tiny model's.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

from transformers import LlamaConfig

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.lower_bound import ModelShape, lower_bound, with_step_count
from pagedllm.benchmarks.throughput import make_sharegpt_like, make_workload

TINY_VOCAB = 512


def simulate(model_dir: str, num_blocks: int, prompts: list[list[int]], outputs: list[int], args) -> dict:
    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, device="cpu", dtype="float32",
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, num_gpu_blocks_override=num_blocks,
              async_scheduling=True, swap_space=0)
    engine = llm.llm_engine
    sched = engine.scheduler
    for i, (p, n) in enumerate(zip(prompts, outputs)):
        engine.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=n,
                                                                         ignore_eos=True))
    steps: list[tuple[int, int, float]] = []  # per scheduled step: (sequences, tokens, pool used)
    with_decodes = 0  # steps with at least one decode row (each reads every weight once)
    tail_from = None
    schedule = sched.schedule

    def recording_schedule():
        nonlocal tail_from, with_decodes
        out = schedule()
        with_decodes += any(item.num_new_tokens == 1 for item in out.scheduled)
        if out.scheduled:
            used = 1 - sched.block_manager.get_num_free_gpu_blocks() / num_blocks
            steps.append((len(out.scheduled), out.num_batched_tokens, used))
            if tail_from is None and not sched.waiting and not sched.swapped:
                tail_from = len(steps)
        return out

    sched.schedule = recording_schedule
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.perf_counter() - t0
    decode = [r for r, t, _ in steps if t == r]
    mixed = [r for r, t, _ in steps if t > r]
    tail = steps[tail_from:] if tail_from is not None else []
    body = steps[:tail_from] if tail_from is not None else steps
    st = llm.stats()
    out = {
        "num_gpu_blocks": num_blocks, "steps": len(steps), "decode_steps": len(decode), "mixed_steps": len(mixed),
        "mean_batch_decode": sum(decode) / max(1, len(decode)), "mean_batch_mixed": sum(mixed) / max(1, len(mixed)),
        "body_steps": len(body), "mean_batch_body": sum(r for r, _, _ in body) / max(1, len(body)),
        "mean_pool_used_body": sum(u for _, _, u in body) / max(1, len(body)),
        "tail_steps": len(tail), "mean_batch_tail": sum(r for r, _, _ in tail) / max(1, len(tail)),
        "preemptions": st["num_preemptions"], "wall_s": wall,
        "steps_with_decodes": with_decodes,
    }
    del llm
    return out


def schedule_bound(args, wl, r: dict, kv_bytes: int) -> str:
    """LLaMA-7B's lower bound (`lower_bound.py`) as the GPU run printed it, and the same with the decode
    steps' weight reads counted for every step this schedule runs (its KV bytes and FLOPs do not depend on
    the schedule)."""
    shape = ModelShape(32, 4096, 11008, 32, 32, 128, 32000, kv_dtype_bytes=kv_bytes)
    prompts = list(map(len, wl.prompts))
    lb = lower_bound(shape, prompts, wl.output_len, args.max_num_seqs, r["num_gpu_blocks"] * 16, args.bandwidth,
                     args.matmul_peak)
    steps = r["steps_with_decodes"]
    with_schedule = with_step_count(lb, shape, steps).total_s
    return (f"LLaMA-7B bound (KV {kv_bytes} B): {lb.total_s:.2f} s with {lb.decode_steps} decode steps; "
            f"{with_schedule:.2f} s with this schedule's {steps} steps")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=3000)
    p.add_argument("--num-gpu-blocks", type=int, nargs="+", default=[6908, 13817])
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--dataset", choices=["uniform", "sharegpt-like"], default="sharegpt-like",
                   help="as benchmarks/throughput.py: uniform = prompt lengths in [min, max], fixed output")
    p.add_argument("--input-len-min", type=int, default=8)
    p.add_argument("--input-len-max", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--output-json", default=None)
    p.add_argument("--kv-dtype-bytes", type=int, nargs="+", default=None,
                   help="per pool: KV bytes per element (2 bf16, 1 FP8): also print LLaMA-7B's lower bound with "
                        "this schedule's step count in place of the bound's (H100 ceilings of §36)")
    p.add_argument("--bandwidth", type=float, default=3.00e12, help="copy bandwidth for that bound (bytes/s)")
    p.add_argument("--matmul-peak", type=float, default=7.89e14, help="bf16 matmul peak for that bound (FLOP/s)")
    args = p.parse_args()
    if args.kv_dtype_bytes and len(args.kv_dtype_bytes) != len(args.num_gpu_blocks):
        p.error(f"--kv-dtype-bytes needs one value per pool ({len(args.num_gpu_blocks)}), got {args.kv_dtype_bytes}")
    wl = (make_sharegpt_like(args.num_prompts, 32000, args.workload_seed) if args.dataset == "sharegpt-like" else
          make_workload(args.num_prompts, args.input_len_min, args.input_len_max, args.output_len, 32000,
                        args.workload_seed))
    prompts = [[t % TINY_VOCAB for t in pr] for pr in wl.prompts]
    d = tempfile.mkdtemp()
    LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=args.max_model_len,
                ).save_pretrained(d)
    total_tokens = sum(len(x) + n for x, n in zip(wl.prompts, wl.output_len))
    print(f"workload: {len(prompts)} requests, {sum(map(len, prompts))} prompt / {sum(wl.output_len)} output tokens "
          f"(mean request {total_tokens / len(prompts):.0f} tokens, longest output {max(wl.output_len)})")
    results = []
    for nb in args.num_gpu_blocks:
        r = simulate(d, nb, prompts, wl.output_len, args)
        cap = nb * 16 / (total_tokens / len(prompts))  # sequences of mean final length the pool holds
        r["bound_batch"] = min(args.max_num_seqs, cap)
        r["bound_decode_steps_at_pool_batch"] = sum(wl.output_len) / r["bound_batch"]
        results.append(r)
        print(f"pool {nb} blocks: {r['steps']} steps ({r['decode_steps']} decode at mean batch "
              f"{r['mean_batch_decode']:.0f}, {r['mixed_steps']} mixed at {r['mean_batch_mixed']:.0f}); "
              f"while requests wait: {r['body_steps']} steps at mean batch {r['mean_batch_body']:.0f}, pool "
              f"{r['mean_pool_used_body']:.0%} used; tail {r['tail_steps']} steps at mean batch "
              f"{r['mean_batch_tail']:.0f}; preemptions {r['preemptions']}; the bound's batch "
              f"{r['bound_batch']:.0f} → {r['bound_decode_steps_at_pool_batch']:.0f} decode steps "
              f"({r['wall_s']:.0f} s)", flush=True)
        if args.kv_dtype_bytes:
            print("   " + schedule_bound(args, wl, r, args.kv_dtype_bytes[len(results) - 1]), flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
