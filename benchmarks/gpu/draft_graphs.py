"""A draft checkpoint's passes on CUDA: replayed from its own CUDA graphs against eager (speculative_config
.enforce_eager), same requests, same process. The bundled model drafts for itself (its GGUF file as the draft
checkpoint: the one draft here that shares its tokenizer and agrees with it; a truncated copy accepts almost
nothing, BENCHMARKS.md §88.2), so a draft pass costs what a target step costs and speculation cannot pay here:
what this measures is the pass, and what the goodput rule makes of it.

    python benchmarks/gpu/draft_graphs.py [NUM_PROMPTS] [MAX_TOKENS]     (DEVICE=cpu: a smoke run, float32)

Prints per engine: output tok/s at 1 concurrent (closed loop over the frozen copy prompts), the median draft pass
(one token per sequence, after a proposal's first pass) in ms, acceptance, and outputs identical to plain decoding.
"""
from __future__ import annotations

import os
import statistics
import sys

from pagedllm.benchmarks.copy_prompts import make_copy_prompts
from pagedllm.benchmarks.spec_decode import run_closed_loop
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.model.loader import default_model_path
from pagedllm.sampling_params import SamplingParams


def main() -> None:
    num_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    draft = default_model_path()
    variants = {
        "off": None,
        "fixed k=4, eager draft": {"model": draft, "num_speculative_tokens": 4, "draft_length_policy": "fixed",
                                   "enforce_eager": True},
        "fixed k=4, draft graphs": {"model": draft, "num_speculative_tokens": 4, "draft_length_policy": "fixed"},
        "goodput k<=4, draft graphs": {"model": draft, "num_speculative_tokens": 4},
    }
    device = os.environ.get("DEVICE", "cuda")
    dtype = "bfloat16" if device == "cuda" else "float32"
    engines = {name: LLMEngine(EngineArgs(device=device, dtype=dtype, max_model_len=2048, max_num_seqs=4,
                                          gpu_memory_utilization=0.2, speculative_config=spec))
               for name, spec in variants.items()}
    prompts = make_copy_prompts(engines["off"].tokenizer, num_prompts)
    params = [SamplingParams(temperature=0, max_tokens=max_tokens)] * len(prompts)
    passes: dict[str, list[float]] = {}
    for name, engine in engines.items():
        if engine.spec_decoder is not None:
            proposer = engine.spec_decoder.draft
            propose, got = proposer.propose, passes.setdefault(name, [])

            def timed(seqs, k, propose=propose, proposer=proposer, got=got):
                out = propose(seqs, k)
                got.extend(proposer.pass_seconds)
                return out

            proposer.propose = timed
        run_closed_loop(engine, prompts[:2], [SamplingParams(temperature=0, max_tokens=8)] * 2, 1, f"warm-{name}")
        passes.get(name, []).clear()
    results = {}
    for name, engine in engines.items():
        before = engine.stats()
        seconds, outs = run_closed_loop(engine, prompts, params, 1, name)
        after = engine.stats()
        drafted = after.get("spec_decode_num_draft_tokens", 0) - before.get("spec_decode_num_draft_tokens", 0)
        accepted = after.get("spec_decode_num_accepted_tokens", 0) - before.get("spec_decode_num_accepted_tokens", 0)
        results[name] = (sum(map(len, outs)) / seconds, outs, drafted, accepted)
    ref = results["off"][1]
    print(f"\n{'engine':<30}{'out tok/s':>10}{'vs off':>8}{'draft pass ms':>15}{'drafted':>9}{'accepted':>10}"
          f"{'identical':>11}")
    for name, (tok_s, outs, drafted, accepted) in results.items():
        got = passes.get(name, [])
        pass_ms = f"{statistics.median(got) * 1e3:.3f}" if got else "-"
        same = sum(a == b for a, b in zip(outs, ref))
        print(f"{name:<30}{tok_s:>10.1f}{tok_s / results['off'][0]:>7.2f}x{pass_ms:>15}{drafted:>9}{accepted:>10}"
              f"{f'{same}/{len(ref)}':>11}")


if __name__ == "__main__":
    main()
