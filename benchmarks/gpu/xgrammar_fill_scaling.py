"""Diagnostic (issue 19): does xgrammar's batch bitmask fill scale with threads on this host? 64 live
matchers over the 20 sample schemas (compact JSON, as the engine builds them) driven by random allowed
tokens; µs per row for BatchGrammarMatcher(max_threads=1, 2, 4, 8) and for per-row fills spread over Python
threads, and llguidance's parallel fill on the same walk length for scale."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import xgrammar as xgr

from pagedllm import LLM
from pagedllm.structured_output.sample_schemas import SCHEMAS

llm = LLM(num_gpu_blocks_override=64, max_model_len=256)
eng = llm.llm_engine
vocab = int(eng.hf_config.vocab_size)
info = xgr.TokenizerInfo.from_huggingface(eng.tokenizer, vocab_size=vocab, stop_token_ids=list(eng.eos_token_ids))
compiler = xgr.GrammarCompiler(info, max_threads=8, cache_enabled=False)
grammars = [compiler.compile_grammar(xgr.Grammar.from_json_schema(json.dumps(s), any_whitespace=False, strict_mode=True))
            for s in SCHEMAS]
shifts = torch.arange(32, dtype=torch.int32)


def walk(fill, steps: int = 20) -> float:
    matchers = [xgr.GrammarMatcher(grammars[i % 20]) for i in range(64)]
    bitmask = xgr.allocate_token_bitmask(64, vocab)
    gen = torch.Generator().manual_seed(0)
    total, rows = 0.0, 0
    for _ in range(steps):
        live = [m for m in matchers if not m.is_terminated()]
        if not live:
            break
        t0 = time.perf_counter()
        fill(live, bitmask)
        total += time.perf_counter() - t0
        rows += len(live)
        for i, m in enumerate(live):
            allowed = ((bitmask[i].unsqueeze(1) >> shifts) & 1).reshape(-1)[:vocab].nonzero().flatten()
            m.accept_token(int(allowed[torch.randint(len(allowed), (1,), generator=gen)]))
    return 1e6 * total / rows


for threads in (1, 2, 4, 8):
    batch = xgr.BatchGrammarMatcher(max_threads=threads)
    us = walk(lambda live, bm: batch.batch_fill_next_token_bitmask(live, bm[: len(live)]))
    print(f"xgrammar BatchGrammarMatcher max_threads={threads}: {us:.1f} us/row", flush=True)
for threads in (1, 4, 8):
    pool = ThreadPoolExecutor(threads)

    def fill(live, bm, pool=pool, threads=threads):
        def part(k):
            for i in range(k, len(live), threads):
                live[i].fill_next_token_bitmask(bm, i)
        list(pool.map(part, range(threads)))

    print(f"xgrammar per-row fills on {threads} Python threads: {walk(fill):.1f} us/row", flush=True)
