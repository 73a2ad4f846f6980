"""Tokens per verification step on plain greedy outputs: the n-gram rule vs choosing among several earlier
occurrences (what verifying more than one candidate per step could reach)."""
import json, os
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.spec_decode import make_copy_prompts
from pagedllm.spec_decode.ngram_proposer import NgramProposer

cache = "/tmp/sweep/plain_outs.json"
if os.path.exists(cache):
    prompts, outs = json.load(open(cache))
else:
    llm = LLM(max_model_len=2048, dtype="float32", num_gpu_blocks_override=2048)
    prompts = make_copy_prompts(llm.llm_engine.tokenizer, 30)
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    outs = [list(r.outputs[0].token_ids) for r in res]
    json.dump([prompts, outs], open(cache, "w"))

def accepted(drafts, future):
    a = 0
    for d, f in zip(drafts, future):
        if d != f:
            break
        a += 1
    return a

def occurrences(ctx, nmin, nmax):
    """(n, end) for every earlier occurrence of the suffix n-gram, longest n first; end = index after it."""
    res = []
    L = len(ctx)
    for n in range(nmax, nmin - 1, -1):
        if L < n + 1:
            continue
        suf = ctx[L - n:]
        ends = [e for e in range(n, L) if ctx[e - n:e] == suf]
        res.append((n, ends))
    return res

def run(k, nmin, nmax, policy):
    steps = tokens = 0
    prop = NgramProposer(k, nmin, nmax)
    for p, o in zip(prompts, outs):
        pos = 0
        while pos < len(o):
            ctx = p + o[:pos]
            fut = o[pos:]
            if policy == "rule":
                d = prop.propose(ctx, k)
                a = accepted(d, fut)
            else:
                best = 0
                occ = occurrences(ctx, nmin, nmax)
                cands = []
                for n, ends in occ:
                    if policy == "longest_all" and cands:
                        break
                    cands += [(n, e) for e in reversed(ends)]
                if policy.startswith("recent"):
                    m = int(policy[6:])
                    seen, pick = set(), []
                    for n, e in cands:  # longest n first, most recent first within it; distinct continuations
                        c = tuple(ctx[e:e + k])
                        if c and c not in seen:
                            seen.add(c); pick.append(c)
                        if len(pick) == m:
                            break
                    best = max((accepted(list(c), fut) for c in pick), default=0)
                else:
                    best = max((accepted(ctx[e:e + k], fut) for n, e in cands), default=0)
                a = best
            a = min(a, len(fut) - 1)
            pos += a + 1
            steps += 1
            tokens += a + 1
    return tokens / steps

for k in (8, 12):
    print(k, {pol: round(run(k, 1, 4, pol), 3) for pol in ("rule", "recent2", "recent3", "recent4", "longest_all", "any_n")})
