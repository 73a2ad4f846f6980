"""The time to run one batch end to end, as vLLM's `vllm bench latency`, with Hugging Face in the same run.

    pagedllm bench latency --input-len 32 --output-len 128 --batch-size 8 [--n 1] [--use-beam-search]
        [--num-iters-warmup 10] [--num-iters 30] [--compare hf] [--output-json FILE] [engine args]

Each iteration sends `--batch-size` prompts of `--input-len` random token ids (seeded) at once, each asking for
`--output-len` tokens (ignore_eos; `--n` samples each at temperature 1, or a beam search of width `--n`), and
times `LLM.generate` (`LLM.beam_search`) until every output is done. vLLM's lines are printed (average latency and
its 10/25/50/75/90/99th percentiles). `--compare hf` runs the same prompts through transformers' `generate` on the
same weights afterwards (the same iteration counts) and prints the ratio of the average latencies.

The hardware's share, measured in the same run: on CUDA, the lower bound of benchmarks/lower_bound.py for one
batch (its prompts' FLOPs at the bf16 matmul peak, each decode step's weight and KV bytes at the copy bandwidth
measured here) against the median latency; on CPU, the timed iterations' GFLOP/s against the fp32 FMA peak
measured here (benchmarks/cpu_flops.py).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

PERCENTILES = (10, 25, 50, 75, 90, 99)


@dataclass(frozen=True)
class LatencyResult:
    system: str
    latencies_s: list[float]

    @property
    def avg_s(self) -> float:
        return statistics.fmean(self.latencies_s)

    def percentiles(self) -> dict[int, float]:
        return {p: percentile(self.latencies_s, p) for p in PERCENTILES}

    def lines(self) -> list[str]:
        return [f"[{self.system}] Avg latency: {self.avg_s:.6f} seconds"] + [
            f"[{self.system}] {p}% percentile latency: {v:.6f} seconds" for p, v in self.percentiles().items()]


def percentile(values: list[float], p: float) -> float:
    """numpy's default (linear) percentile of `values`."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    pos = (len(xs) - 1) * p / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def dummy_prompts(batch_size: int, input_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """vLLM's dummy batch: token ids drawn uniformly below min(10 000, vocab)."""
    rng = random.Random(seed)
    high = min(10_000, vocab_size)
    return [[rng.randrange(high) for _ in range(input_len)] for _ in range(batch_size)]


def add_args(p: argparse.ArgumentParser) -> None:
    from pagedllm.engine.arg_utils import EngineArgs

    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request (default: 32)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (default: 128)")
    p.add_argument("--batch-size", type=int, default=8, help="requests sent at once (default: 8)")
    p.add_argument("--n", type=int, default=1, help="samples per request, or the beam width (default: 1)")
    p.add_argument("--use-beam-search", action="store_true", help="a beam search of width --n per request")
    p.add_argument("--num-iters-warmup", type=int, default=10, help="untimed iterations first (default: 10)")
    p.add_argument("--num-iters", type=int, default=30, help="timed iterations (default: 30)")
    p.add_argument("--disable-detokenize", action="store_true", help="leave the outputs' text empty")
    p.add_argument("--compare", choices=["none", "hf"], default="none",
                   help="hf: transformers' generate on the same weights and prompts, afterwards in this process")
    p.add_argument("--seed-prompts", type=int, default=0, help="seed of the dummy prompts (default: 0)")
    p.add_argument("--lower-bound", action=argparse.BooleanOptionalAction, default=True,
                   help="print the run's share of the hardware bound measured here (see the description)")
    p.add_argument("--output-json", default=None, help="write the latencies and percentiles to this JSON file")
    EngineArgs.add_cli_args(p)


def _check(args: argparse.Namespace) -> None:
    for name in ("input_len", "output_len", "batch_size", "n", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}.")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be at least 0, got {args.num_iters_warmup}.")
    if args.use_beam_search and args.n < 2:
        raise ValueError("--use-beam-search needs --n (the beam width) of at least 2.")


def pagedllm_iteration(llm, prompts: list[list[int]], args: argparse.Namespace) -> Callable[[], None]:
    """One iteration: the whole batch through `LLM.generate` (`LLM.beam_search`) until every output is done."""
    from pagedllm import SamplingParams
    from pagedllm.sampling_params import BeamSearchParams

    inputs = [{"prompt_token_ids": p} for p in prompts]
    if args.use_beam_search:
        beam = BeamSearchParams(beam_width=args.n, max_tokens=args.output_len, ignore_eos=True)
        return lambda: llm.beam_search(inputs, beam)
    params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len,
                            detokenize=not args.disable_detokenize)
    return lambda: llm.generate(inputs, params, use_tqdm=False)


def hf_iteration(model, prompts: list[list[int]], args: argparse.Namespace) -> Callable[[], None]:
    """One iteration through transformers' generate on the same batch (one prompt length: no padding)."""
    import torch

    device = next(model.parameters()).device
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    kw = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, pad_token_id=pad)
    if args.use_beam_search:
        kw.update(do_sample=False, num_beams=args.n, num_return_sequences=args.n, early_stopping=False)
    else:
        kw.update(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, num_return_sequences=args.n)

    def once() -> None:
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return once


def warm_up(once: Callable[[], None], iters: int, name: str) -> None:
    from tqdm.auto import tqdm

    for _ in tqdm(range(iters), desc=f"{name} warm-up"):
        once()


def timed(once: Callable[[], None], iters: int, name: str) -> LatencyResult:
    from tqdm.auto import tqdm

    out = []
    for _ in tqdm(range(iters), desc=f"{name} timed"):
        t0 = time.perf_counter()
        once()
        out.append(time.perf_counter() - t0)
    return LatencyResult(name, out)


def _cuda_bound(llm, args: argparse.Namespace, measured_s: float) -> dict:
    """One batch's lower bound (benchmarks/lower_bound.py) at the bandwidth and matmul peak measured now."""
    from pagedllm.benchmarks.kernels import copy_bandwidth
    from pagedllm.benchmarks.lower_bound import ModelShape, format_bound, lower_bound, measure_matmul_peak

    eng = llm.llm_engine
    cc = eng.config.cache_config
    shape = ModelShape.from_hf_config(eng.hf_config, dtype_bytes=eng.executor.dtype.itemsize,
                                      kv_dtype_bytes=1 if cc.cache_dtype.startswith("fp8") else None)
    bandwidth, peak = copy_bandwidth(), measure_matmul_peak()
    rows = args.batch_size * args.n  # n samples (or beams) share the prompt: its FLOPs are counted once
    prompt_lens = [args.input_len] * args.batch_size + [0] * (rows - args.batch_size)
    lb = lower_bound(shape, prompt_lens, [args.output_len] * rows, eng.config.scheduler_config.max_num_seqs,
                     cc.num_gpu_blocks * cc.block_size, bandwidth, peak)
    print(f"measured here: copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s")
    print(format_bound(lb, measured_s) + " (the median latency)")
    return {"lower_bound": lb.as_dict(), "efficiency_at_median": lb.total_s / measured_s}


def run(args: argparse.Namespace) -> int:
    import torch

    from pagedllm import LLM
    from pagedllm.engine.arg_utils import EngineArgs

    _check(args)
    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**vars(engine_args))
    eng = llm.llm_engine
    if args.input_len + args.output_len > eng.config.model_config.max_model_len:
        raise ValueError(f"--input-len + --output-len ({args.input_len + args.output_len}) exceeds max_model_len "
                         f"({eng.config.model_config.max_model_len}); pass a larger --max-model-len.")
    prompts = dummy_prompts(args.batch_size, args.input_len, int(eng.hf_config.vocab_size), args.seed_prompts)
    device = str(eng.executor.device)
    print(f"batch: {args.batch_size} prompts x {args.input_len} tokens, {args.output_len} output tokens, "
          f"{'beam width' if args.use_beam_search else 'n'} {args.n}; device={device} dtype={eng.executor.dtype} "
          f"threads={torch.get_num_threads()}", flush=True)
    cpu_shape = peak = stats = None
    has_shape = getattr(eng.hf_config, "num_attention_heads", None) is not None
    if args.lower_bound and has_shape and device == "cpu":
        from pagedllm.benchmarks import cpu_flops

        peak = cpu_flops.measure_cpu_peak()
        print(peak.line(), flush=True)
        cpu_shape = cpu_flops.ModelShape.from_hf_config(eng.hf_config, dtype_bytes=4)
    once = pagedllm_iteration(llm, prompts, args)
    warm_up(once, args.num_iters_warmup, "pagedllm")
    if peak is not None:  # the steps of the timed iterations only
        stats = eng.executor.driver_worker.model_runner.enable_step_stats()
    cpu0 = time.process_time()
    ours = timed(once, args.num_iters, "pagedllm")
    cpu_s = time.process_time() - cpu0
    results = [ours]
    figures: dict = {"pagedllm": {"avg_latency": ours.avg_s, "latencies": ours.latencies_s,
                                  "percentiles": ours.percentiles()}}
    if args.lower_bound and has_shape and device.startswith("cuda"):
        figures["bound"] = _cuda_bound(llm, args, statistics.median(ours.latencies_s))
    elif peak is not None:
        from pagedllm.benchmarks import cpu_flops

        figures["cpu_work"] = cpu_flops.report(cpu_shape, stats, peak, sum(ours.latencies_s), cpu_s)
    if args.compare == "hf":
        from pagedllm.benchmarks.throughput import load_hf_reference

        del llm, eng, once
        hf = load_hf_reference(engine_args.model, args.dtype, device, engine_args.load_format)
        hf_once = hf_iteration(hf, prompts, args)
        warm_up(hf_once, args.num_iters_warmup, "hf")
        peer = timed(hf_once, args.num_iters, "hf")
        results.append(peer)
        figures["hf"] = {"avg_latency": peer.avg_s, "latencies": peer.latencies_s, "percentiles": peer.percentiles()}
        figures["hf_over_pagedllm"] = peer.avg_s / ours.avg_s
    for r in results:
        print("\n".join(r.lines()))
    if args.compare == "hf":
        print(f"average latency, same batch: HF {figures['hf']['avg_latency']:.4f} s / pagedllm {ours.avg_s:.4f} s = "
              f"{figures['hf_over_pagedllm']:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "func"}, **figures}, f, indent=1,
                      default=str)
    return 0


__all__ = ["LatencyResult", "add_args", "dummy_prompts", "hf_iteration", "pagedllm_iteration", "percentile", "run",
           "timed", "warm_up"]
