"""What custom logits processors cost per step: the same requests through an engine without processors, one with a
processor registered that no request uses, and one whose every request uses it (vLLM's DummyLogitsProcessor
shape: a per-row target token kept in a dict by row index), interleaved in rounds in one process.

    python benchmarks/logits_processors_cost.py [--num-prompts 32] [--max-tokens 64] [--rounds 3] [--device cpu]

Prints output tok/s per engine and round, and each engine's median and per-round ratios against the plain one.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.logits_processor import BatchUpdate, LogitsProcessor, process_dict_updates


class BoostTokenProcessor(LogitsProcessor):
    """extra_args {"boost": [token, value]} adds value to that token's logit."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.boosts: dict[int, tuple[int, float]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.boosts, batch_update, lambda params, _p, _o: (params.extra_args or {}).get("boost"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (token, value) in self.boosts.items():
            logits[index, token] += value
        return logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    kw = dict(device=args.device, max_model_len=1024, max_num_seqs=args.num_prompts)
    engines = {"no processors": (LLM(**kw), None),
               "registered, unused": (LLM(logits_processors=[BoostTokenProcessor], **kw), None),
               "every request": (LLM(logits_processors=[BoostTokenProcessor], **kw), {"boost": [13, 0.5]})}
    prompts = [f"Write a short story about the number {i}." for i in range(args.num_prompts)]
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for name, (llm, xargs) in engines.items():  # warm-up
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, extra_args=xargs), use_tqdm=False)
    for r in range(args.rounds):
        for name, (llm, xargs) in engines.items():
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, extra_args=xargs)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
            rates[name].append(rate)
            print(f"round {r}: {name:<20} {rate:8.1f} out tok/s", flush=True)
    base = statistics.median(rates["no processors"])
    for name, got in rates.items():
        per_round = [g / b for g, b in zip(got, rates["no processors"])]
        print(f"{name:<20} median {statistics.median(got):8.1f} out tok/s  {statistics.median(got) / base:.3f}x; "
              f"per round {min(per_round):.3f}-{max(per_round):.3f}x (median {statistics.median(per_round):.3f}x)")


if __name__ == "__main__":
    main()
