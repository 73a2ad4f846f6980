"""What Triton builds after the warm start (issue 16: no request pays for a compilation; BENCHMARKS §84.1).

One fresh process per model (Triton keeps built kernels in memory per process, so an earlier engine would hide a
gap): the engine starts with its defaults on CUDA, then a varied workload runs twice (prompts of 1 to 1 500 tokens,
1 to 200 output tokens; greedy, temperature, top-p / top-k, penalties, logprobs, n = 2; prompt chunks beside up to
~100 decodes, long contexts for the split decode). Prints every build the runner's CompileWatch heard, by run, and
the slowest steps of each run.

    python benchmarks/gpu/compile_watch_probe.py MODEL_DIR [MODEL_DIR ...]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def probe(model: str) -> dict:
    import random

    from pagedllm import LLM, SamplingParams

    t0 = time.perf_counter()
    cuda = os.environ.get("DEVICE", "cuda") == "cuda"  # DEVICE=cpu: a dry run of the script on a CPU machine
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16" if cuda else "float32",
              device="cuda" if cuda else "cpu", max_model_len=2048, max_num_seqs=128,
              **({"gpu_memory_utilization": 0.5} if cuda else {}))
    start_s = time.perf_counter() - t0
    runner = llm.llm_engine.executor.driver_worker.model_runner
    vocab = int(llm.llm_engine.hf_config.vocab_size)
    rng = random.Random(0)
    kinds = [dict(temperature=0.0), dict(temperature=0.8, seed=1), dict(temperature=0.7, top_p=0.9, seed=2),
             dict(temperature=1.0, top_k=20, seed=3), dict(temperature=0.0, repetition_penalty=1.2),
             dict(temperature=0.0, logprobs=3), dict(temperature=0.9, n=2, seed=4),
             dict(temperature=0.6, presence_penalty=0.5, frequency_penalty=0.3, seed=5)]
    prompts, params = [], []
    for i in range(int(os.environ.get("NUM", 160))):
        n = rng.choice([1, 3, 7, 16, 33, 100, 257, 600, 1500]) if i % 4 else rng.randint(1, 1500)
        prompts.append({"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]})
        params.append(SamplingParams(max_tokens=min(rng.choice([1, 5, 40, 200]), 2048 - n), ignore_eos=True,
                                     **kinds[i % len(kinds)]))
    stats = runner.enable_step_stats()
    runs = []
    for run in range(2):
        stats.clear()
        seen = len(runner.compile_watch.events)
        t1 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t1
        steps = sorted(((a.elapsed_time(b), kind, path, n) for kind, path, n, a, b in stats.records), reverse=True)
        runs.append({"wall_s": round(wall, 3), "builds": [(e.kernel, e.specialization[:300])
                                                         for e in runner.compile_watch.events[seen:]],
                     "slowest_steps_ms": [(round(ms, 2), k, p, n) for ms, k, p, n in steps[:5]],
                     "num_steps": len(steps)})
    return {"model": model, "engine_start_s": round(start_s, 2), "runs": runs}


def main() -> None:
    if sys.argv[1] == "--one":
        print("RESULT " + json.dumps(probe(sys.argv[2])))
        return
    for model in sys.argv[1:]:
        done = subprocess.run([sys.executable, __file__, "--one", model], capture_output=True, text=True)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        if done.returncode or not lines:
            print(f"== {model}: rc={done.returncode}\n{done.stderr[-3000:]}")
            continue
        r = json.loads(lines[-1][7:])
        print(f"== {model}: engine start {r['engine_start_s']} s")
        for i, run in enumerate(r["runs"]):
            print(f"  run {i}: {run['wall_s']} s, {run['num_steps']} steps, {len(run['builds'])} Triton builds; "
                  f"slowest steps (ms, kind, path, tokens): {run['slowest_steps_ms']}")
            for kernel, spec in run["builds"]:
                print(f"    built {kernel}: {spec}")


if __name__ == "__main__":
    main()
