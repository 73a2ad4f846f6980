"""Where a speculative step's time goes (issue 20): the copy workload at `--concurrency` requests with
speculation off and on (same engine settings as `pagedllm bench spec-decode`), per-step wall time by step
kind (the model runner's path), then a cProfile of the host side of the "on" engine.

    python benchmarks/gpu/profile_spec.py [MODEL_DIR] [--load-format dummy] [--dtype float32] [--concurrency 4]
"""
import argparse
import cProfile
import collections
import pstats
import time

import torch

from pagedllm.benchmarks.copy_prompts import make_copy_prompts
from pagedllm.benchmarks.spec_decode import run_closed_loop
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams


def timed_steps(engine: LLMEngine) -> collections.defaultdict:
    """Wrap engine.step: wall time per step, keyed by the largest chunk's query length (1 = decode)."""
    times = collections.defaultdict(list)
    runner = engine.executor.driver_worker.model_runner
    orig_exec, orig_step = runner.execute_model, engine.step
    last = {"q": 0}

    def exec_model(chunks, *a, **k):
        last["q"] = max(len(c.token_ids) for c in chunks) if chunks else 0
        return orig_exec(chunks, *a, **k)

    def step():
        t = time.perf_counter()
        out = orig_step()
        q = last["q"]
        times["prefill" if q > 8 else f"q{q}"].append(time.perf_counter() - t)
        return out

    runner.execute_model, engine.step = exec_model, step
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?", default=None, help="default: the bundled model")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--dump", default=None, help="also write each cProfile to DUMP_<label>.prof")
    p.add_argument("--profile", nargs="*", default=["on"], help="engines to run under cProfile (off, on)")
    a = p.parse_args()
    engines = {}
    for label, spec in (("off", None), ("on", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}')):
        engines[label] = LLMEngine(EngineArgs(model=a.model, device="cuda", dtype=a.dtype, load_format=a.load_format,
                                              max_model_len=2048, max_num_seqs=64, num_gpu_blocks_override=8192,
                                              speculative_config=spec, seed=0))
    prompts = make_copy_prompts(engines["off"].tokenizer, a.prompts, 0)
    params = [SamplingParams(temperature=0, max_tokens=64)] * len(prompts)
    for label, eng in engines.items():
        run_closed_loop(eng, prompts[:2], params[:2], 1, f"warm{label}")
        times = timed_steps(eng)
        dt, outs = run_closed_loop(eng, prompts, params, a.concurrency, label)
        torch.cuda.synchronize()
        n = sum(len(o) for o in outs)
        print(f"== {label}: {n} tokens in {dt:.3f} s = {n / dt:.1f} tok/s; "
              + "; ".join(f"{k}: {len(v)} steps, mean {1e3 * sum(v) / len(v):.3f} ms" for k, v in sorted(times.items())))
        st = eng.stats()
        print(f"   drafts {st.get('spec_decode_num_draft_tokens')} accepted {st.get('spec_decode_num_accepted_tokens')}")
    for label in a.profile:
        print(f"==== cProfile of the '{label}' engine")
        pr = cProfile.Profile()
        pr.enable()
        run_closed_loop(engines[label], prompts, params, a.concurrency, "prof")
        torch.cuda.synchronize()
        pr.disable()
        pstats.Stats(pr).sort_stats("cumulative").print_stats(80)
        pstats.Stats(pr).sort_stats("tottime").print_stats(40)
        if a.dump:
            pr.dump_stats(f"{a.dump}_{label}.prof")


if __name__ == "__main__":
    main()
