"""Decode breakdown with / without the KV pool touched before the run (argv: rows touch[0/1])."""
import sys, time, runpy
touch = sys.argv[2] == "1"
import pagedllm.entrypoints.llm as llm_mod
from pagedllm import LLM
orig_init = LLM.__init__
def init(self, *a, **k):
    orig_init(self, *a, **k)
    if touch:
        w = self.llm_engine.executor.driver_worker
        t0 = time.perf_counter()
        for kc, vc in w.cache_engine.gpu_cache:
            kc.zero_(); vc.zero_()
        print(f"touched the pool in {time.perf_counter()-t0:.2f} s", flush=True)
LLM.__init__ = init
sys.argv = [sys.argv[0], sys.argv[1]]
runpy.run_path("benchmarks/results/cpu_1127h/decode_breakdown.py", run_name="__main__")
