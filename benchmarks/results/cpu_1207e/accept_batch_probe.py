import json, time
import torch, xgrammar as xgr
from xgrammar.matcher import _core
from pagedllm import LLM
from pagedllm.structured_output.sample_schemas import SCHEMAS
llm = LLM(num_gpu_blocks_override=64, max_model_len=256)
eng = llm.llm_engine
vocab = int(eng.hf_config.vocab_size)
info = xgr.TokenizerInfo.from_huggingface(eng.tokenizer, vocab_size=vocab, stop_token_ids=list(eng.eos_token_ids))
compiler = xgr.GrammarCompiler(info, max_threads=8, cache_enabled=False)
grammars = [compiler.compile_grammar(xgr.Grammar.from_json_schema(json.dumps(s), any_whitespace=False, strict_mode=True)) for s in SCHEMAS]
ms = [xgr.GrammarMatcher(grammars[i % 20]) for i in range(32)]
bm = xgr.allocate_token_bitmask(32, vocab)
xgr.BatchGrammarMatcher(1).batch_fill_next_token_bitmask(ms, bm)
shifts = torch.arange(32, dtype=torch.int32)
toks = [int(((bm[i].unsqueeze(1) >> shifts) & 1).reshape(-1)[:vocab].nonzero().flatten()[0]) for i in range(32)]
N = 300
def bench(label, make, fn):
    tot = 0.0
    for _ in range(N):
        f = [m.fork() for m in ms]
        t0 = time.perf_counter(); fn(f); tot += time.perf_counter() - t0
    print(f"{label:40s} {1e6*tot/N:7.1f} us per 32 rows")
bench("per-row accept_token", None, lambda f: [m.accept_token(t) for m, t in zip(f, toks)])
bench("batch_accept_token (full wrapper)", None, lambda f: xgr.BatchGrammarMatcher.batch_accept_token(f, toks))
bench("handles only", None, lambda f: [m._handle for m in f])
bench("native batch only", None, lambda f: _core.BatchGrammarMatcher.batch_accept_token([m._handle for m in f], toks, False))
def conv(f):
    r = _core.BatchGrammarMatcher.batch_accept_token([m._handle for m in f], toks, False)
    return list(r)
bench("native + list()", None, conv)
print(type(_core.BatchGrammarMatcher.batch_accept_token([m._handle for m in ms[:1]], toks[:1], False)))
