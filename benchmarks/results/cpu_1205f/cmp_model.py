"""cmp.py's comparison, engines named K/MIN/MODEL (k, prompt_lookup_min, step-cost estimate: `old` = the estimate
before §74.1, without the envelope; `new` = the tree's): python cmp_model.py CONCURRENCY ROUNDS off 4/3/old 4/3/new"""
import sys

from cmp import interleaved, report

from pagedllm import LLM
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
        below = [r for r in seen if r < rows]
        above = [r for r in seen if r > rows]
        if not below:
            return self.times[above[0]]
        if above:
            lo, hi = below[-1], above[0]
            return self.times[lo] + (self.times[hi] - self.times[lo]) * (rows - lo) / (hi - lo)
        lo, hi = seen[-2], seen[-1]
        return self.times[hi] + max(0.0, (self.times[hi] - self.times[lo]) / (hi - lo)) * (rows - hi)


conc, rounds = int(sys.argv[1]), int(sys.argv[2])
engines = {}
for c in sys.argv[3:]:
    if c == "off":
        engines[c] = LLM(max_model_len=2048, num_gpu_blocks_override=2048)
        continue
    k, lmin, model = c.split("/")
    cfg = {"method": "ngram", "num_speculative_tokens": int(k), "prompt_lookup_max": 4, "prompt_lookup_min": int(lmin)}
    engines[c] = LLM(max_model_len=2048, num_gpu_blocks_override=2048, speculative_config=cfg)
    if model == "old":
        engines[c].llm_engine.spec_decoder.step_cost = OldModel()


def model_times(c: str) -> str:
    if c == "off":
        return ""
    m = engines[c].llm_engine.spec_decoder.step_cost
    return " model " + str({r: round(s * 1e3, 1) for r, s in sorted(m.times.items())})


report(*interleaved(engines, conc, rounds), model_times)
