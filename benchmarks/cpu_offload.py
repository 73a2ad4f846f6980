"""`--cpu-offload-gb` (vLLM's) on a GPU: what it frees, what it costs, against the PCIe floor.

    python benchmarks/cpu_offload.py --model /tmp/l8b --load-format dummy --offload-gb 0 4 8

Runs the same requests once per budget in one process (0 = no offload, the peer every other budget is compared to)
and prints output tok/s, the ratio to no offload, the KV blocks the pool got and the model's device memory. The
floor: every forward copies the offloaded bytes from pinned host memory, so a run costs at least its forwards ×
offloaded bytes ÷ the pinned host-to-device bandwidth measured here more than the run without; the table prints the
measured extra time against that floor.
"""
from __future__ import annotations

import argparse
import gc
import logging
import time

import torch

from pagedllm import LLM, SamplingParams


def pinned_h2d_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second of one pinned host buffer copied to the device (best of `repeats`)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def run(args: argparse.Namespace, offload_gb: float, prompts: list[list[int]], params: SamplingParams) -> dict:
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, skip_tokenizer_init=True,
              max_model_len=args.input_len + args.output_len, gpu_memory_utilization=args.gpu_memory_utilization,
              cpu_offload_gb=offload_gb)
    engine = llm.llm_engine
    worker = engine.executor.driver_worker
    steps = 0
    execute = engine.executor.execute_model

    def counted(req):
        nonlocal steps
        steps += 1
        return execute(req)

    engine.executor.execute_model = counted
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    report = worker.cpu_offload
    result = {
        "offload_gb": offload_gb, "wall": wall, "steps": steps,
        "out_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "blocks": llm.stats()["kv_blocks_total"], "model_gib": worker.model_memory_bytes / 2**30,
        "layers": report.layers if report else 0, "offloaded": report.offloaded_bytes if report else 0,
        "saved_gib": report.saved_bytes / 2**30 if report else 0.0,
    }
    del llm, engine, worker
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--offload-gb", type=float, nargs="+", default=[0, 4, 8])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = ap.parse_args()
    budgets = [0.0] + [g for g in args.offload_gb if g > 0]
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 30000, (args.num_prompts, args.input_len), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    bandwidth = pinned_h2d_bandwidth()
    results = [run(args, gb, prompts, params) for gb in budgets]
    base = results[0]
    print(f"{torch.cuda.get_device_name()}; pinned host-to-device copy {bandwidth / 1e9:.1f} GB/s; "
          f"{args.num_prompts} requests × {args.input_len} in / {args.output_len} out")
    print(f"{'offload GiB':>11} {'layers':>6} {'freed GiB':>9} {'model GiB':>9} {'KV blocks':>9} {'steps':>5} "
          f"{'wall s':>7} {'out tok/s':>9} {'÷ none':>6} {'extra s':>7} {'PCIe floor s':>12} {'floor/extra':>11}")
    for r in results:
        tps = r["out_tokens"] / r["wall"]
        extra = r["wall"] - base["wall"]
        floor = r["steps"] * r["offloaded"] / bandwidth
        frac = f"{floor / extra:.0%}" if r["offloaded"] and extra > 0 else "—"
        print(f"{r['offload_gb']:>11.1f} {r['layers']:>6} {r['saved_gib']:>9.2f} {r['model_gib']:>9.2f} "
              f"{r['blocks']:>9} {r['steps']:>5} {r['wall']:>7.2f} {tps:>9.1f} {tps / (base['out_tokens'] / base['wall']):>5.2f}x "
              f"{extra:>7.2f} {floor:>12.2f} {frac:>11}")


if __name__ == "__main__":
    main()
