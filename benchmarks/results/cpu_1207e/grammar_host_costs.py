"""Issue 19 diagnostic: a constrained step's grammar work on the host, 64 matchers over the 20 sample schemas
(compact JSON, bundled tokenizer), driven by random allowed tokens. Per step: the accepts one call per row
against xgrammar's batch accept, the batch fill, and the fill on a thread while this thread runs ~0.3 ms of
Python (as the step thread's output building would)."""
from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import xgrammar as xgr

from pagedllm import LLM
from pagedllm.structured_output.sample_schemas import SCHEMAS

if len(sys.argv) > 1:  # a tokenizer directory (the device: .tok/), else the bundled model's
    from transformers import AutoTokenizer

    tokenizer, vocab, stops = AutoTokenizer.from_pretrained(sys.argv[1]), 49152, [2]
else:
    eng = LLM(num_gpu_blocks_override=64, max_model_len=256).llm_engine
    tokenizer, vocab, stops = eng.tokenizer, int(eng.hf_config.vocab_size), list(eng.eos_token_ids)
info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=stops)
compiler = xgr.GrammarCompiler(info, max_threads=8, cache_enabled=False)
grammars = [compiler.compile_grammar(xgr.Grammar.from_json_schema(json.dumps(s), any_whitespace=False, strict_mode=True))
            for s in SCHEMAS]
shifts = torch.arange(32, dtype=torch.int32)
batch = xgr.BatchGrammarMatcher(max_threads=1)
pool = ThreadPoolExecutor(1)


def python_work(n: int = 3000) -> int:
    s = 0
    for i in range(n):
        s += i * i
    return s


t0 = time.perf_counter()
for _ in range(20):
    python_work()
py_s = (time.perf_counter() - t0) / 20
print(f"python work alone: {1e3 * py_s:.3f} ms")

res = {"accept_each": 0.0, "accept_batch": 0.0, "fill": 0.0, "fill_then_py": 0.0, "fill_thread_py": 0.0}
rows = steps = 0
gen = torch.Generator().manual_seed(0)
matchers = [xgr.GrammarMatcher(grammars[i % 20]) for i in range(64)]
bitmask = xgr.allocate_token_bitmask(64, vocab)
for step in range(40):
    live = [m for m in matchers if not m.is_terminated()]
    if len(live) < 16:
        matchers = [xgr.GrammarMatcher(grammars[(i + step) % 20]) for i in range(64)]
        live = matchers
    n = len(live)
    t0 = time.perf_counter()
    batch.batch_fill_next_token_bitmask(live, bitmask[:n])
    res["fill"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    batch.batch_fill_next_token_bitmask(live, bitmask[:n])
    python_work()
    res["fill_then_py"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    fut = pool.submit(batch.batch_fill_next_token_bitmask, live, bitmask[:n])
    python_work()
    fut.result()
    res["fill_thread_py"] += time.perf_counter() - t0
    toks = []
    for i in range(n):
        allowed = ((bitmask[i].unsqueeze(1) >> shifts) & 1).reshape(-1)[:vocab].nonzero().flatten()
        toks.append(int(allowed[torch.randint(len(allowed), (1,), generator=gen)]))
    forks = [m.fork() for m in live]
    t0 = time.perf_counter()
    for m, t in zip(forks, toks):
        m.accept_token(t)
    res["accept_each"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    ok = batch.batch_accept_token(live, toks)
    res["accept_batch"] += time.perf_counter() - t0
    if not all(ok):
        raise SystemExit("a sampled allowed token was rejected")
    rows += n
    steps += 1
print(f"{steps} steps, {rows / steps:.1f} rows a step")
for k, v in res.items():
    print(f"{k:16s} {1e3 * v / steps:.3f} ms/step  {1e6 * v / rows:.2f} us/row")
