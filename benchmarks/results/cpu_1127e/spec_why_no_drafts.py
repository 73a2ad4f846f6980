import sys, time
from collections import Counter
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm import SamplingParams
from pagedllm.benchmarks.spec_decode import make_copy_prompts
from pagedllm.spec_decode import spec_decoder as sdm
quant = sys.argv[1]; n = int(sys.argv[2])
spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
e = LLMEngine(EngineArgs(device="cpu", quantization=None if quant == "auto" else quant, max_model_len=1024,
                         num_gpu_blocks_override=1024, speculative_config=spec))
sd = e.spec_decoder
stats = Counter(); hist = Counter()
orig_plan = sd.plan
def plan(sched):
    dec = [it for it in sched.scheduled if it.num_new_tokens == 1 and it.completes]
    elig = [it for it in dec if sd._eligible(it)]
    cool = [it for it in dec if it.seq.output_token_ids and not sd._may_speculate(it.seq, it.group)]
    pend = [it for it in dec if it.seq.num_pending_tokens]
    prop = [it for it in elig if sd.ngram.propose(it.seq.token_ids, 4)]
    r = orig_plan(sched)
    stats["steps"] += 1; stats["decoding"] += len(dec); stats["eligible"] += len(elig); stats["cooldown"] += len(cool)
    stats["pending"] += len(pend); stats["proposed"] += len(prop); stats["chosen"] += len(r)
    hist[(len(dec), len(prop), len(r))] += 1
    return r
sd.plan = plan
prompts = make_copy_prompts(e.tokenizer, n, 0)
todo = list(range(n)); active = 0
t0 = time.perf_counter()
while todo or e.has_unfinished_requests():
    while todo and active < 4:
        i = todo.pop(0); e.add_request(f"r{i}", prompts[i], SamplingParams(temperature=0, max_tokens=128)); active += 1
    for o in e.step():
        if o.finished: active -= 1
print("wall", time.perf_counter() - t0)
print(dict(stats))
print(sorted(hist.items(), key=lambda kv: -kv[1])[:15])
print({k: round(v, 3) for k, v in sd.stats.as_dict().items() if 'pos' not in k})
print("cost model", {k: round(v*1e3, 1) for k, v in sorted(sd.step_cost.times.items())})
