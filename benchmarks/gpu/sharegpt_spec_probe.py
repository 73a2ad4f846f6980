"""Issue 20 probe: where speculation's time goes on the ShareGPT-like workload at 64 concurrent (bundled model).

Engines in one process (speculation off, and each --methods entry with k/min/max), the same ShareGPT-like
requests (greedy, ignore_eos, outputs capped at --max-out) in a closed loop at --concurrency, the whole workload
--repeats times per engine, alternating. Prints each engine's start-up seconds, per-repeat seconds, the device
mode's counters, and the per-step device-timeline breakdown by kind and path (worker/step_stats.py).

    python benchmarks/gpu/sharegpt_spec_probe.py --num-prompts 128 --repeats 4 --methods ngram_gpu ngram
"""
import argparse
import json
import time

from pagedllm.benchmarks.spec_decode import run_closed_loop
from pagedllm.benchmarks.throughput import make_sharegpt_like
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.step_stats import format_summary


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-out", type=int, default=256)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--methods", nargs="*", default=["ngram_gpu"], help="none: the off engine alone")
    p.add_argument("--k", type=int, default=12)
    p.add_argument("--min", type=int, default=1)
    p.add_argument("--max", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model", default=None, help="default: the bundled model")
    p.add_argument("--load-format", default="auto", help="dummy: random weights (timing only)")
    p.add_argument("--max-model-len", type=int, default=2048)
    a = p.parse_args()
    engines, startup = {}, {}
    for label in ["off", *a.methods]:
        spec = None if label == "off" else json.dumps({"method": label, "num_speculative_tokens": a.k,
                                                       "prompt_lookup_min": a.min, "prompt_lookup_max": a.max})
        t0 = time.perf_counter()
        engines[label] = LLMEngine(EngineArgs(model=a.model, load_format=a.load_format, dtype=a.dtype,
                                              max_model_len=a.max_model_len,
                                              num_gpu_blocks_override=8192, max_num_seqs=a.concurrency,
                                              speculative_config=spec, gpu_memory_utilization=0.3))
        startup[label] = time.perf_counter() - t0
    eng0 = engines["off"]
    wl = make_sharegpt_like(a.num_prompts, int(eng0.hf_config.vocab_size), 0, max_prompt=a.max_model_len // 2,
                            max_total=a.max_model_len)
    params = [SamplingParams(temperature=0, max_tokens=min(o, a.max_out), ignore_eos=True) for o in wl.output_len]
    for label, eng in engines.items():
        run_closed_loop(eng, wl.prompts[:2], [SamplingParams(temperature=0, max_tokens=8)] * 2, 2, f"warm{label}")
    stats = {label: eng.executor.driver_worker.model_runner.enable_step_stats() for label, eng in engines.items()}
    secs: dict[str, list[float]] = {label: [] for label in engines}
    tokens = {}
    for r in range(a.repeats):
        for label, eng in engines.items():
            dt, outs = run_closed_loop(eng, wl.prompts, params, a.concurrency, f"{label}r{r}")
            secs[label].append(dt)
            tokens[label] = sum(len(o) for o in outs)
    off = sum(secs["off"])
    for label, eng in engines.items():
        total = sum(secs[label])
        print(f"== {label}: start-up {startup[label]:.1f} s; repeats {', '.join(f'{s:.3f}' for s in secs[label])} s; "
              f"{tokens[label] * a.repeats / total:.1f} tok/s; ÷ off {off / total:.3f}")
        st = eng.stats()
        print("   " + ", ".join(f"{k}={v}" for k, v in st.items() if k.startswith("spec_decode")))
        loop = eng.device_spec
        if loop is not None:
            print(f"   device mode: steps {loop.num_steps}, entries {loop.num_entries} (in flight "
                  f"{loop.num_entries_in_flight}), admissions {loop.num_admissions}, pool fallbacks "
                  f"{loop.num_pool_fallbacks}")
        if eng.spec_decoder is not None and eng.spec_decoder.mode is not None:
            print(f"   chooser rates {eng.spec_decoder.mode.rates}")
        print(format_summary(stats[label].summary()))


if __name__ == "__main__":
    main()
