"""Issue 20 probe: where device-side n-gram speculation (`ngram_gpu`) spends its steps on the bundled model.

Three engines in one process on the same copy prompts, closed loop at --concurrency: speculation off; `ngram_gpu`
with the mode chooser (spec_decode/mode.py, as shipped); `ngram_gpu` with the chooser removed (always speculate
where the mode applies). Prints tok/s, the device mode's steps and entries, the chooser's rates, and the mean
host time of a `step()` call in each kind of step.

    python benchmarks/gpu/device_ngram_probe.py --num-prompts 30 --concurrency 1 --k 4 --min 1 --max 4
"""
import argparse
import time

from pagedllm.benchmarks.copy_prompts import make_copy_prompts
from pagedllm.benchmarks.spec_decode import run_closed_loop
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-prompts", type=int, default=30)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--min", type=int, default=1)
    p.add_argument("--max", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--profile", action="store_true",
                   help="also time the host's parts of a device step and the device's three replays (CUDA)")
    a = p.parse_args()
    spec = {"method": "ngram_gpu", "num_speculative_tokens": a.k, "prompt_lookup_min": a.min, "prompt_lookup_max": a.max}
    engines = {}
    for label, cfg in (("off", None), ("chooser", spec), ("always", spec)):
        engines[label] = LLMEngine(EngineArgs(dtype=a.dtype, max_model_len=2048, num_gpu_blocks_override=8192,
                                              max_num_seqs=64, speculative_config=cfg))
    engines["always"].spec_decoder.mode = None
    prompts = make_copy_prompts(engines["off"].tokenizer, a.num_prompts)
    params = [SamplingParams(temperature=0, max_tokens=a.max_tokens)] * len(prompts)
    for label, eng in engines.items():
        run_closed_loop(eng, prompts[:2], params[:2], 2, f"warm{label}")
    off_outputs = {}
    for c in a.concurrency:
        ref = None
        for label, eng in engines.items():
            loop = eng.device_spec
            timings: dict[str, list[float]] = {"device": [], "other": []}
            if loop is not None:
                inner = eng.step

                def timed(inner=inner, loop=loop, timings=timings):
                    n0, t0 = loop.num_steps, time.perf_counter()
                    out = inner()
                    timings["device" if loop.num_steps > n0 else "other"].append(time.perf_counter() - t0)
                    return out
                eng.step = timed
                s0, e0 = loop.num_steps, loop.num_entries
            st0 = eng.stats()
            dt, outs = run_closed_loop(eng, prompts, params, c, f"{label}{c}")
            tokens = sum(len(o) for o in outs)
            ref = ref or outs
            if label == "off":
                off_outputs[c] = outs
            same = sum(x == y for x, y in zip(outs, ref))
            line = f"c={c} {label:8s} {tokens} tokens in {dt:.2f} s = {tokens / dt:.1f} tok/s identical to off {same}/{len(outs)}"
            if loop is not None:
                st = eng.stats()
                acc = st["spec_decode_num_accepted_tokens"] - st0["spec_decode_num_accepted_tokens"]
                mode = eng.spec_decoder.mode
                mean = {k: (1e3 * sum(v) / len(v) if v else 0.0, len(v)) for k, v in timings.items()}
                line += (f" device steps {loop.num_steps - s0} entries {loop.num_entries - e0} accepted {acc}"
                         f" step ms (count): device {mean['device'][0]:.3f} ({mean['device'][1]})"
                         f" other {mean['other'][0]:.3f} ({mean['other'][1]})")
                if mode is not None:
                    line += f" rates {dict((k, round(v, 1)) for k, v in mode.rates.items())}"
                del eng.step
            print(line, flush=True)
            if a.profile and label == "always":
                profile(eng, prompts, params, c)
    if len(off_outputs) > 1:  # plain decoding itself at different batch compositions (no speculation)
        (c0, o0), *rest = sorted(off_outputs.items())
        for c1, o1 in rest:
            print(f"off at c={c0} vs off at c={c1}: identical {sum(x == y for x, y in zip(o0, o1))}/{len(o0)}")


def profile(eng, prompts, params, concurrency: int) -> None:
    """Host ms per call of the loop's parts during a closed loop, then CUDA-event ms of each replay."""
    import torch

    loop = eng.device_spec
    spent: dict[str, list[float]] = {}
    originals = {}
    for name in ("_members", "_reserve", "_launch", "_complete"):
        fn = getattr(loop, name)
        originals[name] = fn

        def wrapped(*args, fn=fn, name=name, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent.setdefault(name, []).append(time.perf_counter() - t0)
        setattr(loop, name, wrapped)
    wait = []
    done_sync = torch.cuda.Event.synchronize

    def timed_sync(ev):
        t0 = time.perf_counter()
        done_sync(ev)
        wait.append(time.perf_counter() - t0)
    torch.cuda.Event.synchronize = timed_sync
    try:
        run_closed_loop(eng, prompts, params, concurrency, f"prof{concurrency}")
    finally:
        torch.cuda.Event.synchronize = done_sync
        for name in originals:
            delattr(loop, name)
    parts = " ".join(f"{k} {1e3 * sum(v) / len(v):.3f}" for k, v in spent.items())
    print(f"  host ms per call: {parts}; of _complete, waiting for the device {1e3 * sum(wait) / max(1, len(wait)):.3f}")
    gr = loop.graph_runner
    s0, e0 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s0.record()
    for _ in range(20):
        gr.graphs[1].replay()
    e0.record()
    e0.synchronize()
    print(f"  plain decode graph, bucket 1: {s0.elapsed_time(e0) / 20:.3f} ms", flush=True)
    for n, (pre, b, post) in sorted(loop.graphs.items())[:4]:
        ms = []
        for g in (pre, gr.graphs[b], post):
            s0, e0 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            g.replay()
            s0.record()
            for _ in range(20):
                g.replay()
            e0.record()
            e0.synchronize()
            ms.append(s0.elapsed_time(e0) / 20)
        print(f"  n={n}: device ms pre {ms[0]:.3f} decode graph (bucket {b}) {ms[1]:.3f} post {ms[2]:.3f}", flush=True)


if __name__ == "__main__":
    main()
