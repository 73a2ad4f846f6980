"""Diagnostic (issue 19): how much parallel CPU does this host really give, and does xgrammar's bitmask fill
scale across processes where it did not across threads (BENCHMARKS §25)? Prints nproc and the cgroup CPU quota,
a pure-Python busy loop in 1..16 processes, then 64 rows of JSON-schema fills split over 1, 2, 4, 8 processes
(each process owns its matchers, as a process-pool fill would).

    python benchmarks/gpu/fill_process_scaling.py TOKENIZER_DIR
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time


def busy(n: int) -> float:
    t = time.perf_counter()
    x = 0
    for i in range(n):
        x += i * i
    return time.perf_counter() - t


def fill_worker(args: tuple[str, int, int, int]) -> float:
    """Build matchers for `rows` rows (schemas from `first`), walk `steps` random allowed tokens; returns the
    seconds spent in fills only."""
    tok_dir, first, rows, steps = args
    import torch
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from pagedllm.structured_output.sample_schemas import SCHEMAS

    tok = AutoTokenizer.from_pretrained(tok_dir)
    vocab = len(tok)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    grammars = [compiler.compile_grammar(xgr.Grammar.from_json_schema(json.dumps(s), any_whitespace=False,
                                                                     strict_mode=True)) for s in SCHEMAS]
    matchers = [xgr.GrammarMatcher(grammars[(first + i) % len(grammars)]) for i in range(rows)]
    bitmask = xgr.allocate_token_bitmask(rows, vocab)
    shifts = torch.arange(32, dtype=torch.int32)
    gen = torch.Generator().manual_seed(first)
    spent = 0.0
    for _ in range(steps):
        t = time.perf_counter()
        for i, m in enumerate(matchers):
            if not m.is_terminated():
                m.fill_next_token_bitmask(bitmask, i)
        spent += time.perf_counter() - t
        for i, m in enumerate(matchers):
            if m.is_terminated():
                continue
            bits = ((bitmask[i].unsqueeze(1) >> shifts) & 1).reshape(-1)[:vocab].nonzero().flatten()
            m.accept_token(int(bits[torch.randint(len(bits), (1,), generator=gen)].item()))
    return spent


if __name__ == "__main__":
    tok_dir = sys.argv[1]
    quota = open("/sys/fs/cgroup/cpu.max").read().strip() if os.path.exists("/sys/fs/cgroup/cpu.max") else "n/a"
    print(f"nproc {os.cpu_count()}, sched_getaffinity {len(os.sched_getaffinity(0))}, cgroup cpu.max {quota}")
    ctx = mp.get_context("spawn")
    n = 3_000_000
    for procs in (1, 2, 4, 8, 16):
        with ctx.Pool(procs) as pool:
            t = time.perf_counter()
            pool.map(busy, [n] * procs)
            wall = time.perf_counter() - t
        print(f"busy loop: {procs:2d} processes x {n} iterations in {wall:.2f} s (1 process alone ~ same if parallel)")
    rows, steps = 64, 20
    for procs in (1, 2, 4, 8):
        per = rows // procs
        with ctx.Pool(procs) as pool:
            spent = pool.map(fill_worker, [(tok_dir, p * per, per, steps) for p in range(procs)])
        slowest = max(spent)
        print(f"fill: 64 rows over {procs} processes: {1e6 * slowest / steps / rows:.1f} µs per row per step "
              f"(slowest process {1e3 * slowest / steps:.2f} ms per step)")
