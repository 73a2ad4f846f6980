"""Memory sharing (paper Fig. 15) and prefix caching throughput (paper Fig. 16) on the real engine.

Fig. 15's metric: KV blocks saved by sharing ÷ blocks a non-sharing layout would need, sampled
after every engine step and averaged over the run, for parallel sampling (n) and beam search
(beam width), on synthetic workloads whose length distributions follow the paper's Alpaca
(mean 19.3 in / 58.5 out) and ShareGPT (161.3 / 338.0) traces. Prompts are random token ids,
``ignore_eos`` is set and each request generates its drawn output length. Lengths may be scaled
down together with the block size (``--sharegpt-scale 0.25`` with ``block_size`` 16·0.25 = 4):
counted in blocks, the workload is then the same, and so is the ratio.

Fig. 16: end-to-end throughput with vs without automatic prefix caching when every request
carries the same few-shot prefix (1-shot ≈ 80 tokens, 5-shot ≈ 341 tokens). The prefix is
computed once before timing in both configurations (the system prompt's first use).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass

WORKLOADS = {"alpaca": (19.3, 58.5), "sharegpt": (161.3, 338.0)}
PAPER_FIG15 = {  # (low, high) % over n / beam width 2..6, read off the paper's Fig. 15
    ("alpaca", "parallel"): (6.1, 9.8), ("sharegpt", "parallel"): (16.2, 30.5),
    ("alpaca", "beam"): (37.6, 55.2), ("sharegpt", "beam"): (44.3, 66.3),
}


def lognormal_lengths(rng: random.Random, mean: float, sigma: float, n: int, lo: int, hi: int) -> list[int]:
    """n integer lengths from a log-normal with the given mean, clipped to [lo, hi]."""
    mu = math.log(mean) - sigma * sigma / 2
    return [min(hi, max(lo, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


@dataclass
class SharingResult:
    workload: str
    method: str  # "parallel" | "beam"
    width: int
    num_requests: int
    mean_in: float
    mean_out: float
    block_size: int
    saving_pct: float  # mean over steps of saved / (used + saved)
    saving_pct_weighted: float  # Σ saved / Σ (used + saved) over steps
    steps: int
    elapsed_s: float


def run_sharing_point(llm, workload: str, method: str, width: int, num_requests: int, scale: float,
                      seed: int) -> SharingResult:
    from pagedllm import SamplingParams

    engine = llm.llm_engine
    mean_in, mean_out = WORKLOADS[workload]
    rng = random.Random(seed)
    vocab = int(engine.hf_config.vocab_size)
    ins = lognormal_lengths(rng, mean_in * scale, 0.6, num_requests, 2, int(4 * mean_in * scale))
    outs = lognormal_lengths(rng, mean_out * scale, 0.7, num_requests, 2, int(3 * mean_out * scale))
    for i, (n_in, n_out) in enumerate(zip(ins, outs)):
        prompt = [rng.randrange(100, vocab) for _ in range(n_in)]
        if method == "parallel":
            params = SamplingParams(n=width, temperature=1.0, seed=seed + i, max_tokens=n_out, ignore_eos=True)
        else:
            params = SamplingParams(use_beam_search=True, best_of=width, n=width, temperature=0.0,
                                    max_tokens=n_out, ignore_eos=True)
        engine.add_request(f"{workload}-{method}-{width}-{i}", {"prompt_token_ids": prompt}, params)
    ratios: list[float] = []
    saved_sum = without_sum = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        s = engine.stats()
        used = s["kv_blocks_total"] - s["kv_blocks_free"]
        saved = s["kv_blocks_saved_by_sharing"]
        if used:
            ratios.append(saved / (used + saved))
            saved_sum += saved
            without_sum += used + saved
    if engine.stats()["num_preemptions"]:
        raise RuntimeError("the pool was too small: preemption distorts the sharing metric; raise --num-blocks")
    return SharingResult(
        workload, method, width, num_requests, sum(ins) / len(ins), sum(outs) / len(outs),
        llm.llm_engine.config.cache_config.block_size,
        100 * sum(ratios) / max(1, len(ratios)), 100 * saved_sum / max(1, without_sum), len(ratios),
        time.perf_counter() - t0,
    )


@dataclass
class PrefixResult:
    shots: int
    prefix_len: int
    num_requests: int
    caching: bool
    elapsed_s: float
    requests_per_s: float
    output_tokens_per_s: float
    cached_tokens: int


def run_prefix_point(llm, shots: int, prefix_len: int, num_requests: int, output_len: int, seed: int) -> PrefixResult:
    from pagedllm import SamplingParams

    rng = random.Random(seed)
    vocab = int(llm.llm_engine.hf_config.vocab_size)
    prefix = [rng.randrange(100, vocab) for _ in range(prefix_len)]
    suffixes = [[rng.randrange(100, vocab) for _ in range(rng.randint(16, 48))] for _ in range(num_requests + 1)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prefix + suffixes[-1]}], params, use_tqdm=False)  # first use (untimed)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": prefix + s} for s in suffixes[:-1]], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return PrefixResult(shots, prefix_len, num_requests, llm.llm_engine.config.cache_config.enable_prefix_caching,
                        elapsed, num_requests / elapsed, n_out / elapsed, sum(o.num_cached_tokens for o in outs))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=20, help="requests per Fig. 15 point")
    p.add_argument("--widths", type=int, nargs="+", default=[2, 4, 6])
    p.add_argument("--workloads", nargs="+", default=["alpaca", "sharegpt"], choices=list(WORKLOADS))
    p.add_argument("--methods", nargs="+", default=["parallel", "beam"], choices=["parallel", "beam"])
    p.add_argument("--block-size", type=int, default=16, help="block size at full scale (the paper's 16)")
    p.add_argument("--alpaca-scale", type=float, default=1.0)
    p.add_argument("--sharegpt-scale", type=float, default=0.25,
                   help="scale ShareGPT lengths and the block size by this factor (CPU time)")
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--prefix-requests", type=int, default=32)
    p.add_argument("--prefix-output-len", type=int, default=32)
    p.add_argument("--skip-fig15", action="store_true")
    p.add_argument("--skip-fig16", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="sharing_results.json")
    p.add_argument("--plot", default=None, help="write a PNG of the Fig. 15 reproduction here")
    p.add_argument("--model", default=None, help="Fig. 16's model (default: the bundled one); any HF dir or GGUF")
    p.add_argument("--skip-tokenizer-init", action="store_true", help="Fig. 16 with a model that has no tokenizer")
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--mamba-block-size", type=int, default=None,
                   help="a state-space model's tokens between prefix-cache state snapshots (Fig. 16 with caching)")


def _llm(block_size: int, num_blocks: int, caching: bool = False, args: argparse.Namespace | None = None):
    from pagedllm import LLM

    extra = {}
    if args is not None:  # Fig. 16's model and options
        extra = dict(model=args.model, skip_tokenizer_init=args.skip_tokenizer_init, max_num_seqs=args.max_num_seqs)
        if caching and args.mamba_block_size is not None:
            extra["mamba_block_size"] = args.mamba_block_size
    return LLM(block_size=block_size, num_gpu_blocks_override=num_blocks, max_model_len=2048,
               **{"max_num_seqs": 512, **extra}, enable_prefix_caching=caching, swap_space=0.1)


def run(args: argparse.Namespace) -> int:
    fig15: list[SharingResult] = []
    if not args.skip_fig15:
        for workload in args.workloads:
            scale = args.alpaca_scale if workload == "alpaca" else args.sharegpt_scale
            block_size = max(1, round(args.block_size * scale))
            llm = _llm(block_size, args.num_blocks)
            for method in args.methods:
                for width in args.widths:
                    r = run_sharing_point(llm, workload, method, width, args.num_requests, scale, args.seed)
                    fig15.append(r)
                    _dump(args.json, fig15, [])
                    print(f"{workload:9s} {method:8s} {width}: saving {r.saving_pct:5.1f} % "
                          f"(weighted {r.saving_pct_weighted:5.1f} %), in {r.mean_in:.1f} out {r.mean_out:.1f}, "
                          f"block {block_size}, {r.steps} steps, {r.elapsed_s:.0f} s", flush=True)
            del llm
    fig16: list[PrefixResult] = []
    if not args.skip_fig16:
        for caching in (False, True):
            llm = _llm(16, 2048, caching, args)
            for shots, prefix_len in ((1, 80), (5, 341)):
                r = run_prefix_point(llm, shots, prefix_len, args.prefix_requests, args.prefix_output_len, args.seed)
                fig16.append(r)
                print(f"{shots}-shot prefix {prefix_len}: caching={caching} {r.requests_per_s:.2f} req/s "
                      f"{r.output_tokens_per_s:.1f} out tok/s, cached tokens {r.cached_tokens}", flush=True)
            del llm
        for shots in (1, 5):
            off = next(r for r in fig16 if r.shots == shots and not r.caching)
            on = next(r for r in fig16 if r.shots == shots and r.caching)
            print(f"{shots}-shot: prefix caching speedup {on.requests_per_s / off.requests_per_s:.2f}x")
    _dump(args.json, fig15, fig16)
    if args.plot and fig15:
        plot_fig15(fig15, args.plot)
    return 0


def _dump(path: str, fig15: list[SharingResult], fig16: list[PrefixResult]) -> None:
    with open(path, "w") as f:
        json.dump({"fig15": [asdict(r) for r in fig15], "fig16": [asdict(r) for r in fig16]}, f, indent=1)


def plot_fig15(results: list[SharingResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
    for ax, method, label in ((axes[0], "parallel", "# output sequences (n)"), (axes[1], "beam", "beam width")):
        for workload, marker in (("alpaca", "o"), ("sharegpt", "s")):
            pts = sorted((r.width, r.saving_pct) for r in results if r.method == method and r.workload == workload)
            if pts:
                ax.plot(*zip(*pts), marker=marker, label=f"pagedllm {workload}")
            lo, hi = PAPER_FIG15[(workload, method)]
            ax.plot([2, 6], [lo, hi], linestyle="--", marker=marker, alpha=0.5, label=f"paper {workload} (2→6)")
        ax.set_xlabel(label)
        ax.set_title("parallel sampling" if method == "parallel" else "beam search")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("memory saving (%)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
