"""4-concurrent copy workload (python step_kinds.py 4 {auto|none} 10): per-step kinds (with a prefill chunk or not; how many sequences verified drafts), rows, times; off then on."""
import sys, time
from collections import Counter, defaultdict
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm import SamplingParams
from pagedllm.benchmarks.spec_decode import make_copy_prompts
conc = int(sys.argv[1]); quant = sys.argv[2]; nprompts = int(sys.argv[3]) if len(sys.argv) > 3 else 8
spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
for label, sc in (("off", None), ("on", spec)):
    e = LLMEngine(EngineArgs(device="cpu", quantization=None if quant == "auto" else quant, max_model_len=1024,
                             num_gpu_blocks_override=1024, speculative_config=sc))
    prompts = make_copy_prompts(e.tokenizer, nprompts, 0)
    e.add_request("w", prompts[0][:50], SamplingParams(temperature=0, max_tokens=4))
    while e.has_unfinished_requests(): e.step()
    todo = list(range(len(prompts))); active = set(); ntok = 0
    by = defaultdict(list); t0 = time.perf_counter()
    while todo or e.has_unfinished_requests():
        while todo and len(active) < conc:
            i = todo.pop(0); e.add_request(f"r{i}", prompts[i], SamplingParams(temperature=0, max_tokens=128)); active.add(f"r{i}")
        sd = getattr(e, "spec_decoder", None)
        nd = sd.stats.num_drafts if sd else 0; ntoks = sd.stats.num_draft_tokens if sd else 0
        t = time.perf_counter(); outs = e.step(); dt = time.perf_counter() - t
        run = sum(g.num_unfinished_seqs() for g in e.scheduler.running)
        drafts = (sd.stats.num_drafts - nd) if sd else 0
        dtoks = (sd.stats.num_draft_tokens - ntoks) if sd else 0
        kind = "prefill" if any(o.outputs and len(o.outputs[0].token_ids) <= 1 and not o.finished for o in outs) else "dec"
        by[(kind, drafts)].append((dt, dtoks))
        for o in outs:
            if o.finished: active.discard(o.request_id); ntok += len(o.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    print(f"{label}: {ntok} tokens in {wall:.2f} s = {ntok/wall:.1f} tok/s")
    for k in sorted(by):
        v = by[k]; print(f"   {k}: {len(v)} steps, {1e3*sum(d for d,_ in v)/len(v):.1f} ms/step, draft toks/step {sum(x for _,x in v)/len(v):.1f}, total {sum(d for d,_ in v):.2f} s")
    if sd: print("  ", {k: round(v, 3) for k, v in sd.stats.as_dict().items() if 'pos' not in k})
    del e
