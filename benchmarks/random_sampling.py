"""Random sampling's cost per step: the sampler's modes against the Gumbel-max race for every row.

    python benchmarks/random_sampling.py [--device cuda] [--rows 1 8 64] [--vocab 49152] [--arms auto race inverse_cdf]

For each batch size, the same logits (temperature 1; float32 on a CPU, the model's bf16 on a GPU) go through
`Sampler.launch(...).result()` once per arm, alternating: `Sampler("auto")` with the generators the engine gives
seeded requests (a `random.Random`: one uniform per sample, drawn on the host; one kernel for the batch,
`CpuKernels.sample_rows` on a CPU, `triton_sample` on a GPU), `Sampler("race")` with a torch generator per
seeded row on the logits' device and torch ops (what every device ran before: an exponential per vocabulary
entry; `native_cpu=False`), and optionally
`Sampler("inverse_cdf")` with host generators. Seeded rows (a generator each, as `SamplingParams(seed=...)`
gives) and unseeded rows. Median wall time of `--repeats`; each ratio is race ÷ that arm. All are exact
samplers: the token frequencies of each over many draws of one small row are printed against the softmax
(total variation distance).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from pagedllm.model.layers.sampler import Sampler, SamplingRow
from pagedllm.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--vocab", type=int, default=49152, help="the bundled model's vocabulary")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--check-draws", type=int, default=20000)
    ap.add_argument("--e2e", type=int, default=0, metavar="ROUNDS",
                    help="also run the bundled model end to end (64 unseeded requests of 64 tokens, temperature 1 "
                         "then greedy) with the engine's sampler switched between the default and the previous "
                         "one (race, torch ops), ROUNDS times each")
    ap.add_argument("--model", default=None, help="the end-to-end model (default: the bundled one)")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--arms", nargs="+", default=["auto", "race"], choices=["auto", "race", "inverse_cdf"],
                    help="Sampler modes to time (ratios are against race, which must be one of them)")
    args = ap.parse_args()
    if "race" not in args.arms:
        ap.error("--arms must include race (the ratios' reference)")
    dev = torch.device(args.device)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    print(f"device {dev} ({torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU'}), torch threads "
          f"{torch.get_num_threads()}, vocab {args.vocab}, logits {dtype}", flush=True)
    params = SamplingParams(temperature=1.0)

    def make_gen(arm: str, seed: int):
        """The arm's generator for a seeded row: a device generator for the race (what the engine gave seeded
        requests before), else the engine's (LLMEngine._make_generator: a random.Random)."""
        return torch.Generator(dev).manual_seed(seed) if arm == "race" else random.Random(seed)

    samplers = {arm: Sampler(arm, native_cpu=arm != "race") for arm in args.arms}
    for n in args.rows:
        logits = (torch.randn(n, args.vocab, generator=torch.Generator().manual_seed(n)) * 2).to(dev, dtype)
        for seeded in (True, False):
            rows = {arm: [SamplingRow(params, [], [], make_gen(arm, i) if seeded else None) for i in range(n)]
                    for arm in args.arms}
            times: dict[str, list[float]] = {arm: [] for arm in args.arms}
            arms = list(samplers.items())
            for rep in range(args.repeats + 2):
                for arm, sampler in arms[rep % len(arms):] + arms[:rep % len(arms)]:  # each arm leads in turn
                    sync()
                    t0 = time.perf_counter()
                    sampler.launch(logits, rows[arm]).result()
                    times[arm].append(time.perf_counter() - t0)
            ms = {arm: 1e3 * statistics.median(t[2:]) for arm, t in times.items()}
            cells = ", ".join(f"{arm} {ms[arm]:8.3f} ms ({ms['race'] / ms[arm]:5.2f}x)" for arm in args.arms)
            print(f"rows {n:4d} {'seeded  ' if seeded else 'unseeded'}: {cells}", flush=True)
    vocab, draws = 50, args.check_draws
    row = (torch.randn(1, vocab, generator=torch.Generator().manual_seed(7)) * 1.5).to(dev)
    target = row.float().softmax(-1)[0].cpu().double()
    for arm, sampler in samplers.items():
        one_row = [SamplingRow(params, [], [], make_gen(arm, 1), num_samples=draws)]
        got = sampler.launch(row, one_row).result()[0][0].token_ids
        freq = torch.bincount(torch.tensor(got), minlength=vocab).double() / draws
        print(f"{arm}: total variation from the softmax over {draws} draws = {0.5 * (freq - target).abs().sum():.4f}",
              flush=True)
    if args.e2e:
        model = {k: v for k, v in (("model", args.model), ("tokenizer", args.tokenizer)) if v is not None}
        end_to_end(args.e2e, args.device, load_format=args.load_format, dtype=args.dtype, **model)


def end_to_end(rounds: int, device: str, **llm_kwargs) -> None:
    """The model (default: the bundled one) generates 64 × 64 tokens at temperature 1 (unseeded: the race needs
    torch generators for seeded rows, and the engine's are random.Random) and greedily, the engine's sampler
    alternating between the default and the previous one (`Sampler("race", native_cpu=False)`: torch ops and
    the race); output tok/s per round and the ratio of summed times."""
    from pagedllm import LLM

    llm = LLM(max_model_len=1024, device=device, **llm_kwargs)
    prompts = [f"Write a short story number {i} about a robot who" for i in range(64)]
    llm.generate(prompts[:4], SamplingParams(max_tokens=8), use_tqdm=False)
    arms = {"default": Sampler(), "previous": Sampler("race", native_cpu=False)}
    for temperature in (1.0, 0.0):
        params = SamplingParams(temperature=temperature, max_tokens=64, ignore_eos=True)
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        for sampler in arms.values():  # a warm-up round of each (first-use costs)
            llm.llm_engine.sampler = sampler
            llm.generate(prompts, params, use_tqdm=False)
        for _ in range(rounds):
            for arm, sampler in arms.items():
                llm.llm_engine.sampler = sampler
                t0 = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                times[arm].append(time.perf_counter() - t0)
        tok = 64 * 64
        per = {arm: ", ".join(f"{tok / t:.0f}" for t in ts) for arm, ts in times.items()}
        print(f"end to end ({device}, {llm_kwargs.get('model', 'bundled model')}, 64 requests x 64 tokens, "
              f"temperature {temperature}): out tok/s "
              f"per round: default {per['default']}; previous {per['previous']} -> default / previous = "
              f"{sum(times['previous']) / sum(times['default']):.2f}x", flush=True)
    llm.llm_engine.sampler = Sampler()


if __name__ == "__main__":
    main()
