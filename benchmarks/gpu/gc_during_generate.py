"""Issue 16 probe: how much of an offline run's wall time is Python's cyclic garbage collector? Runs
benchmarks/throughput.py with the given arguments and, for every `LLM.generate` call of at least 100 prompts,
prints the collections that ran inside it by generation (count, total and longest pause) and the call's wall time.
`python-thresholds` keeps Python's default thresholds during `generate` (the code before engine/gc_heap.py's
`fewer_young_collections`), `engine` runs the engine's.

    python benchmarks/gpu/gc_during_generate.py {engine|python-thresholds} <throughput.py arguments>
"""
import contextlib
import gc
import runpy
import sys
import time
from collections import defaultdict

import pagedllm.entrypoints.llm as llm_module
from pagedllm.entrypoints.llm import LLM

pauses: dict[int, list[float]] = defaultdict(list)
started: list[float] = []


def on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        started.append(time.perf_counter())
    elif started:
        pauses[info["generation"]].append(time.perf_counter() - started.pop())


real_generate = LLM.generate


def generate(self, prompts, *args, **kwargs):
    if not isinstance(prompts, list) or len(prompts) < 100:
        return real_generate(self, prompts, *args, **kwargs)
    pauses.clear()
    gc.callbacks.append(on_gc)
    t0 = time.perf_counter()
    try:
        return real_generate(self, prompts, *args, **kwargs)
    finally:
        wall = time.perf_counter() - t0
        gc.callbacks.remove(on_gc)
        parts = ", ".join(f"gen{g}: {len(p)} × (total {1e3 * sum(p):.1f} ms, max {1e3 * max(p):.1f} ms)"
                          for g, p in sorted(pauses.items()))
        print(f"[gc] generate({len(prompts)} prompts) {wall:.2f} s; collections: {parts or 'none'}; "
              f"frozen objects {gc.get_freeze_count()}, tracked {len(gc.get_objects())}", flush=True)


mode = sys.argv.pop(1)
if mode == "python-thresholds":
    llm_module.fewer_young_collections = contextlib.nullcontext
elif mode != "engine":
    raise SystemExit(f"mode must be 'engine' or 'python-thresholds', got {mode!r}")
LLM.generate = generate
sys.argv = ["benchmarks/throughput.py", *sys.argv[1:]]
runpy.run_path("benchmarks/throughput.py", run_name="__main__")
