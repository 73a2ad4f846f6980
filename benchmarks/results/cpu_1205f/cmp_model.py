"""off vs spec engines, where a config name ending in '/old' uses the former step-cost estimate (no envelope)."""
import sys, json
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.spec_decode import make_copy_prompts, run_closed_loop
from pagedllm.spec_decode.draft_length import StepCostModel

class OldModel(StepCostModel):
    def estimate(self, rows):
        if not self.times:
            return None
        if rows in self.times:
            return self.times[rows]
        seen = sorted(self.times)
        if len(seen) == 1:
            return self.times[seen[0]]
        below = [r for r in seen if r < rows]; above = [r for r in seen if r > rows]
        if not below:
            return self.times[above[0]]
        if above:
            lo, hi = below[-1], above[0]
            return self.times[lo] + (self.times[hi] - self.times[lo]) * (rows - lo) / (hi - lo)
        lo, hi = seen[-2], seen[-1]
        return self.times[hi] + max(0.0, (self.times[hi] - self.times[lo]) / (hi - lo)) * (rows - hi)

conc = int(sys.argv[1]); rounds = int(sys.argv[2]); cfgs = sys.argv[3:]
engines = {}
for c in cfgs:
    if c == "off":
        engines[c] = LLM(max_model_len=2048, num_gpu_blocks_override=2048); continue
    k, lmin, model = c.split("/")
    cfg = {"method": "ngram", "num_speculative_tokens": int(k), "prompt_lookup_max": 4, "prompt_lookup_min": int(lmin)}
    engines[c] = LLM(max_model_len=2048, num_gpu_blocks_override=2048, speculative_config=cfg)
    if model == "old":
        engines[c].llm_engine.spec_decoder.step_cost = OldModel()
prompts = make_copy_prompts(next(iter(engines.values())).get_tokenizer(), 100)
cuts = [100 * r // rounds for r in range(rounds + 1)]
tot = {c: [0, 0.0] for c in cfgs}; outs = {c: [] for c in cfgs}
for r in range(rounds):
    ps = prompts[cuts[r]:cuts[r + 1]]
    order = cfgs if r % 2 == 0 else cfgs[::-1]
    for c in order:
        params = [SamplingParams(temperature=0.0, max_tokens=512) for _ in ps]
        t, o = run_closed_loop(engines[c].llm_engine, ps, params, conc, "p")
        tot[c][0] += sum(len(x) for x in o); tot[c][1] += t; outs[c] += o
        print(f"round {r} {c}: {sum(len(x) for x in o) / t:.1f} tok/s", flush=True)
base = tot[cfgs[0]][0] / tot[cfgs[0]][1]
for c in cfgs:
    rate = tot[c][0] / tot[c][1]
    same = sum(a == b for a, b in zip(outs[c], outs[cfgs[0]]))
    extra = ""
    if c != "off":
        m = engines[c].llm_engine.spec_decoder.step_cost
        extra = " model " + str({r: round(s * 1e3, 1) for r, s in sorted(m.times.items())})
    print(f"{c}: {rate:.1f} tok/s, x{rate / base:.3f} of {cfgs[0]}, identical {same}/100{extra}")
