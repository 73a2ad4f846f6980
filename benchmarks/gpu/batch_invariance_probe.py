"""VLLM_BATCH_INVARIANT on CUDA, on and off, in one process each (run twice with the variable set): a 600-token
prompt's greedy tokens and logprobs alone, after a prefix-cache hit, batched with fifteen 300-token prompts, and
with n-gram speculation; prints which equal the lone run. Model: a tiny random Llama (tests/tiny_models.py) or
--model DIR (e.g. the bundled GGUF, bf16 on CUDA).

    VLLM_BATCH_INVARIANT=0 python benchmarks/gpu/batch_invariance_probe.py
    VLLM_BATCH_INVARIANT=1 python benchmarks/gpu/batch_invariance_probe.py
"""
import argparse, os, sys, tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from pagedllm import LLM, SamplingParams  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--model", default="tiny", help="tiny (a random 3-layer Llama), bundled (SmolLM2-135M) or a DIR")
p.add_argument("--kv-cache-dtype", default="auto")
p.add_argument("--max-tokens", type=int, default=32)
p.add_argument("--prompt-len", type=int, default=600, help="long enough that the split-KV decode splits it by batch")
p.add_argument("--others", type=int, default=15, help="300-token prompts batched with it")
a = p.parse_args()
vocab = 1024 if a.model == "tiny" else 30000
if a.model == "tiny":
    from tiny_models import save_tiny_llama
    a.model = save_tiny_llama(tempfile.mkdtemp())
elif a.model == "bundled":
    a.model = None
kw = dict(model=a.model, skip_tokenizer_init=True, device="cuda", dtype="bfloat16", kv_cache_dtype=a.kv_cache_dtype,
          max_model_len=a.prompt_len + a.max_tokens + 64)
g = torch.Generator().manual_seed(1)
target = [int(t) for t in torch.randint(1, vocab, (a.prompt_len,), generator=g)]
longs = [[int(t) for t in torch.randint(1, vocab, (300,), generator=g)] for _ in range(a.others)]
sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True, logprobs=1)


def run(llm, prompts, i):
    o = llm.generate([{"prompt_token_ids": q} for q in prompts], sp, use_tqdm=False)[i].outputs[0]
    return list(o.token_ids), [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]


llm = LLM(enable_prefix_caching=True, num_gpu_blocks_override=2048, **kw)
alone = run(llm, [target], 0)
run(llm, [target[:-7] + [5, 6, 7]], 0)
res = {"prefix-cache hit": run(llm, [target], 0), f"batched with {a.others} x 300 tokens": run(llm, [*longs, target], a.others)}
del llm
repeat = (target[:20] * (a.prompt_len // 20 + 1))[:a.prompt_len]
plain = LLM(num_gpu_blocks_override=512, **kw)
want = run(plain, [repeat], 0)
del plain
spec = LLM(num_gpu_blocks_override=512, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
           "prompt_lookup_min": 1, "prompt_lookup_max": 3, "draft_length_policy": "fixed"}, **kw)
got = run(spec, [repeat], 0)
print(f"VLLM_BATCH_INVARIANT={os.environ.get('VLLM_BATCH_INVARIANT', '0')} kv={a.kv_cache_dtype} model={Path(a.model).name if a.model else 'bundled'}")
for name, r in res.items():
    print(f"  {name}: tokens {'same' if r[0] == alone[0] else 'DIFFER'}, logprobs {'same' if r[1] == alone[1] else 'differ'}")
print(f"  n-gram speculation vs plain: tokens {'same' if got[0] == want[0] else 'DIFFER'}, "
      f"logprobs {'same' if got[1] == want[1] else 'differ'}; drafts {spec.llm_engine.stats().get('spec_decode_num_draft_tokens')}")
