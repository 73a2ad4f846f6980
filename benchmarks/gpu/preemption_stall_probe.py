"""Watch an offline run that preempts (issue 21's bf16 LLaMA-7B run with 1 000 ShareGPT-like requests stopped
making progress at 56 %): every --every seconds print the scheduler's queues, free blocks, preemptions and the
engine's generated tokens; when no token was generated for --stall seconds, dump every thread's stack.

    python benchmarks/gpu/preemption_stall_probe.py --model /tmp/l7b --load-format dummy --dtype bfloat16 \
        --dataset sharegpt-like --num-prompts 1000 --max-model-len 2048 --max-num-seqs 1024
"""
import argparse
import faulthandler
import sys
import threading
import time

from pagedllm import LLM
from pagedllm.benchmarks.throughput import (
    add_args,
    make_sharegpt_like,
    make_workload,
    run_pagedllm,
)
from pagedllm.engine.arg_utils import EngineArgs


def watch(llm, every: float, stall: float, stop: threading.Event) -> None:
    eng = llm.llm_engine
    sch, last, last_change = eng.scheduler, -1, time.monotonic()
    t0 = time.monotonic()
    while not stop.wait(every):
        gen = eng.num_generation_tokens_total
        now = time.monotonic()
        if gen != last:
            last, last_change = gen, now
        bm = sch.block_manager
        print(f"[{now - t0:7.1f}s] gen {gen} running {len(sch.running)} waiting {len(sch.waiting)} swapped "
              f"{len(sch.swapped)} free {bm.get_num_free_gpu_blocks()} preempt {sch.num_preemptions} "
              f"(recompute {sch.num_recompute_preemptions}, swap {sch.num_swap_preemptions})", flush=True)
        if now - last_change > stall:
            waiting = list(sch.waiting)[:3]
            for g in waiting:
                s = g.unfinished_seqs()
                print(f"  waiting head {g.request_id}: seqs {len(s)} tokens {[x.get_len() for x in s]} "
                      f"computed {[x.num_computed_tokens for x in s]}", flush=True)
            faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
            last_change = now


def main() -> None:
    p = argparse.ArgumentParser()
    add_args(p)
    p.add_argument("--every", type=float, default=5.0)
    p.add_argument("--stall", type=float, default=20.0)
    a = p.parse_args()
    llm = LLM(**vars(EngineArgs.from_cli_args(a)))
    vocab = int(llm.llm_engine.hf_config.vocab_size)
    wl = (make_workload(a.num_prompts, a.input_len_min, a.input_len_max, a.output_len, vocab, a.workload_seed)
          if a.dataset == "uniform" else make_sharegpt_like(a.num_prompts, vocab, a.workload_seed))
    stop = threading.Event()
    threading.Thread(target=watch, args=(llm, a.every, a.stall, stop), daemon=True).start()
    r = run_pagedllm(llm, wl)
    stop.set()
    print(r.row(), llm.stats(), flush=True)


if __name__ == "__main__":
    main()
