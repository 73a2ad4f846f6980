"""Speculative decoding on vs off, same engine settings, same requests, same run.

Workloads:
- input-copying (default 100 prompts, chat template of the bundled model, greedy): three kinds in turn,
  drawn once from this repository's own text and frozen in data/copy_prompts.json (copy_prompts.py):
  (1) "repeat this code exactly" over a 12-30 line window of a pagedllm/*.py file, (2) "rename function X
  to X_v2 and output the whole code" over a window that defines a function, (3) "summarize this text
  quoting its key sentences verbatim" over a README.md / ARCHITECTURE.md passage. Run closed-loop at each
  --concurrency (1 and 4 by default): that many requests in flight, a new one joins when one finishes.
- JSON extraction (`--json-prompts`, off by default): contacts to extract as JSON under a schema, each prompt
  with one worked example (structured_output/sample_schemas.py `extraction_requests`), greedy, grammar-
  constrained: speculation under a grammar (its drafts cut to what the grammar accepts, rows masked), at each
  --concurrency as the copy workload.
- ShareGPT-like (random token ids with the paper's Fig. 11 length fits, ignore_eos) at
  --sharegpt-concurrency (64) in flight: speculation must cost nothing here (it turns itself off).

Both engines (off and on, same settings) live in one process; each workload runs on both in interleaved
slices (off, on, off, on, ... `--rounds`), so that a change in the machine's load hits both alike.
Prints output tok/s on and off and their ratio, the acceptance rate and mean acceptance length, and
whether greedy outputs were token-for-token identical.
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from collections import deque
from pathlib import Path

from pagedllm.benchmarks.copy_prompts import make_copy_prompts
from pagedllm.benchmarks.throughput import make_sharegpt_like
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.params import StructuredOutputsParams
from pagedllm.structured_output.sample_schemas import CONTACT_SCHEMA, extraction_requests

logger = logging.getLogger("pagedllm.bench")


def run_closed_loop(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams],
                    concurrency: int, tag: str) -> tuple[float, list[list[int]]]:
    """Keep `concurrency` requests in flight until all are done → (seconds, output token ids per prompt)."""
    todo = deque(range(len(prompts)))
    results: dict[int, list[int]] = {}
    active = 0
    t0 = time.perf_counter()
    while todo or engine.has_unfinished_requests():
        while todo and active < concurrency:
            i = todo.popleft()
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompts[i]}, params[i])
            active += 1
        for out in engine.step():
            if out.finished:
                results[int(out.request_id.rsplit("-", 1)[1])] = list(out.outputs[0].token_ids)
                active -= 1
    return time.perf_counter() - t0, [results[i] for i in range(len(prompts))]


def _spec_delta(before: dict, after: dict) -> dict:
    keys = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
            "spec_decode_num_emitted_tokens")
    d = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
    d["acceptance_rate"] = d[keys[2]] / d[keys[1]] if d[keys[1]] else 0.0
    d["mean_acceptance_length"] = d[keys[3]] / d[keys[0]] if d[keys[0]] else 0.0
    return d


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto", help="dummy: random weights (then acceptance means little)")
    p.add_argument("--quantization", default=None,
                   help="none: a GGUF model's weights dequantized to --dtype at load (default: served quantized on CPU)")
    p.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 6, '
                                                   '"prompt_lookup_min": 3, "prompt_lookup_max": 4}',
                   help="default: the n-gram setting that did best on a 2-core CPU at 4 concurrent (BENCHMARKS §74.1)")
    p.add_argument("--num-prompts", type=int, default=100, help="input-copying prompts (0: skip that workload)")
    p.add_argument("--copy-prompts", choices=("frozen", "draw"), default="frozen",
                   help="frozen: the 100 prompts of data/copy_prompts.json; draw: drawn from this tree with --seed")
    p.add_argument("--max-tokens", type=int, default=128, help="input-copying: output cap (stops at EOS)")
    p.add_argument("--json-prompts", type=int, default=0,
                   help="JSON-extraction prompts under a JSON schema (0: skip that workload)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--sharegpt-prompts", type=int, default=128, help="0: skip the ShareGPT-like part")
    p.add_argument("--sharegpt-concurrency", type=int, default=64)
    p.add_argument("--sharegpt-max-out", type=int, default=None, help="cap ShareGPT-like output lengths")
    p.add_argument("--sharegpt-repeats", type=int, default=3,
                   help="ShareGPT-like: the whole workload this many times per engine, alternating off/on")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="per engine (both live at once)")
    p.add_argument("--rounds", type=int, default=5, help="copy workload: interleaved off/on slices")
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")


def slice_rounds(num_prompts: int, concurrency: int, rounds: int) -> int:
    """At most `rounds` slices, each of at least 2 × `concurrency` prompts where there are that many: a closed
    loop keeps `concurrency` requests in flight only while its slice has requests left to add, so a slice of
    fewer prompts than that (10 prompts in 3 slices at 4 concurrent) would mostly run fewer sequences."""
    fewer = max(1, num_prompts // (2 * concurrency))
    if fewer < rounds:
        logger.info("%d prompts at %d concurrent: %d interleaved slices instead of %d (a slice holds at least "
                    "%d prompts)", num_prompts, concurrency, fewer, rounds, 2 * concurrency)
    return max(1, min(rounds, fewer))


def _measure(engines: dict, name: str, prompts: list[list[int]], params: list[SamplingParams], concurrency: int,
             rounds: int, results: dict, outputs: dict, repeats: int = 1) -> None:
    """Run the workload on both engines in `rounds` interleaved slices (off, on, off, on, ...) so that a
    change in the machine's load hits both sides alike; sums the times. `repeats`: the whole workload that
    many times per engine, alternating (for workloads whose concurrency needs all of their requests)."""
    n = len(prompts)
    rounds = slice_rounds(n, concurrency, rounds)
    cuts = [n * r // rounds for r in range(rounds + 1)]
    for label, engine in engines.items():
        results[label] = {"seconds": 0.0, "output_tokens": 0, "round_tok_s": [], "_before": engine.stats()}
        outputs[label] = []
    for r in [r for _ in range(repeats) for r in range(rounds)]:
        lo, hi = cuts[r], cuts[r + 1]
        if lo == hi:
            continue
        for label, engine in engines.items():
            dt, outs = run_closed_loop(engine, prompts[lo:hi], params[lo:hi], concurrency, f"{name}{label}r{r}")
            tokens = sum(len(o) for o in outs)
            results[label]["seconds"] += dt
            results[label]["output_tokens"] += tokens
            results[label]["round_tok_s"].append(tokens / dt)
            outputs[label] += outs
    for label, engine in engines.items():
        e = results[label]
        e["output_tok_s"] = e["output_tokens"] / e["seconds"]
        e.update(_spec_delta(e.pop("_before"), engine.stats()))
        logger.info("%s c=%d spec %s: %d output tokens in %.1f s = %.1f tok/s, acceptance %.2f, length %.2f", name,
                    concurrency, label, e["output_tokens"], e["seconds"], e["output_tok_s"], e["acceptance_rate"],
                    e["mean_acceptance_length"])


def round_ratios(result: dict) -> list[float]:
    """On ÷ off tok/s of each interleaved slice or repeat (`_measure`'s rounds, in order): the spread of the
    machine's noise around the summed ratio."""
    return [on / off for on, off in zip(result["on"]["round_tok_s"], result["off"]["round_tok_s"])]


def _spread(ratios: list[float]) -> str:
    ordered = sorted(ratios)
    return f"{ordered[0]:.2f}-{ordered[-1]:.2f} (median {ordered[len(ordered) // 2]:.2f}, {len(ordered)} rounds)"


def print_batching_reference(copy_results: dict, outputs: dict) -> None:
    """How many greedy outputs of the off engine agree between two concurrencies: without speculation, only the
    batching differs. Where the dtype's GEMMs and attention are not batch-invariant (bf16 on CUDA), this is the
    agreement to hold the on/off `identical` count against."""
    counts = list(copy_results)
    for c in counts[1:]:
        a, b = outputs[f"copy{counts[0]}"]["off"], outputs[f"copy{c}"]["off"]
        same = sum(x == y for x, y in zip(a, b))
        copy_results[c]["identical_off_vs_concurrency_" + counts[0]] = f"{same}/{len(a)}"
        print(f"off engine, {c} vs {counts[0]} concurrent (batching alone): {same}/{len(a)} identical")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    results: dict = {"speculative_config": json.loads(args.speculative_config), "copy": {}, "json": {},
                     "sharegpt": {}}
    outputs: dict[str, dict] = {}
    engines = {}
    for label, spec in (("off", None), ("on", args.speculative_config)):
        eargs = EngineArgs(model=args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
                           max_model_len=args.max_model_len,
                           max_num_seqs=max([*args.concurrency, args.sharegpt_concurrency]),
                           num_gpu_blocks_override=args.num_gpu_blocks, speculative_config=spec, seed=args.seed,
                           quantization=args.quantization,
                           gpu_memory_utilization=args.gpu_memory_utilization)
        engines[label] = LLMEngine(eargs)
    engine = engines["off"]
    prompts = make_copy_prompts(engine.tokenizer, max(args.num_prompts, 2), args.seed, args.copy_prompts)
    for label, eng in engines.items():
        run_closed_loop(eng, prompts[:2], [SamplingParams(temperature=0, max_tokens=8)] * 2, 2, f"warm{label}")
    prompts = prompts[: args.num_prompts]
    greedy = [SamplingParams(temperature=0, max_tokens=args.max_tokens)] * len(prompts)
    for c in args.concurrency if args.num_prompts else []:
        _measure(engines, f"copy{c}", prompts, greedy, c, args.rounds, results["copy"].setdefault(str(c), {}),
                 outputs.setdefault(f"copy{c}", {}))
    if args.json_prompts:
        json_prompts = [engine.tokenizer.encode(t) for t in extraction_requests(args.json_prompts, args.seed)]
        constrained = [SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                      structured_outputs=StructuredOutputsParams(json=CONTACT_SCHEMA))] * len(json_prompts)
        for c in args.concurrency:
            _measure(engines, f"json{c}", json_prompts, constrained, c, args.rounds,
                     results["json"].setdefault(str(c), {}), outputs.setdefault(f"json{c}", {}))
    if args.sharegpt_prompts:
        wl = make_sharegpt_like(args.sharegpt_prompts, int(engine.hf_config.vocab_size), args.seed,
                                max_prompt=args.max_model_len // 2, max_total=args.max_model_len)
        outs_len = [min(o, args.sharegpt_max_out or o) for o in wl.output_len]
        params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs_len]
        _measure(engines, "sharegpt", wl.prompts, params, args.sharegpt_concurrency, 1, results["sharegpt"], {},
                 repeats=args.sharegpt_repeats)
    print(f"\n{'workload':<22}{'off tok/s':>11}{'on tok/s':>11}{'ratio':>8}{'accept':>8}{'acc.len':>8}{'identical':>11}")
    for kind in ("copy", "json"):
        for c, e in results[kind].items():
            same = sum(a == b for a, b in zip(outputs[f"{kind}{c}"]["off"], outputs[f"{kind}{c}"]["on"]))
            e["ratio"] = e["on"]["output_tok_s"] / e["off"]["output_tok_s"]
            e["identical"] = f"{same}/{len(outputs[f'{kind}{c}']['off'])}"
            print(f"{kind + ', ' + c + ' concurrent':<22}{e['off']['output_tok_s']:>11.1f}"
                  f"{e['on']['output_tok_s']:>11.1f}{e['ratio']:>7.2f}x{e['on']['acceptance_rate']:>8.2f}"
                  f"{e['on']['mean_acceptance_length']:>8.2f}{e['identical']:>11}")
    print_batching_reference(results["copy"], outputs)
    if results["sharegpt"]:
        e = results["sharegpt"]
        e["ratio"] = e["on"]["output_tok_s"] / e["off"]["output_tok_s"]
        print(f"{'sharegpt-like, ' + str(args.sharegpt_concurrency):<22}{e['off']['output_tok_s']:>11.1f}"
              f"{e['on']['output_tok_s']:>11.1f}{e['ratio']:>7.2f}x{e['on']['acceptance_rate']:>8.2f}"
              f"{e['on']['mean_acceptance_length']:>8.2f}{'':>11}")
    for label, e in [*((f"{kind}, {c} concurrent", e) for kind in ("copy", "json") for c, e in results[kind].items()),
                     *([("sharegpt-like", results["sharegpt"])] if results["sharegpt"] else [])]:
        e["round_ratios"] = round_ratios(e)
        print(f"{label}: on/off per round {_spread(e['round_ratios'])}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    raise SystemExit(run(p.parse_args()))


if __name__ == "__main__":
    main()
