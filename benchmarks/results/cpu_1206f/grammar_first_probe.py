"""How often would an unmasked draw already satisfy the grammar? (issue 19 probe)"""
import json, sys
import torch
import pagedllm.model.layers.sampler as S
from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.sample_schemas import SCHEMAS, max_tokens_for

stats = {"rows": 0, "pA": 0.0, "greedy_ok": 0}
orig = S.apply_token_bitmask_
def patched(logits, mask, rows):
    before = logits[rows].float().clone()
    orig(logits, mask, rows)
    after = logits[rows].float()
    allowed = torch.isfinite(after) & (after > -1e30)
    p = torch.softmax(before, dim=1)
    stats["rows"] += len(rows)
    stats["pA"] += float((p * allowed).sum(1).sum())
    stats["greedy_ok"] += int(allowed.gather(1, before.argmax(1, keepdim=True)).sum())
S.apply_token_bitmask_ = patched
n = int(sys.argv[1]) if len(sys.argv) > 1 else 64
llm = LLM(seed=0)
prompts = [f"Reply with JSON matching {json.dumps(SCHEMAS[i % len(SCHEMAS)])[:60]}\n" for i in range(n)]
for temp in (1.0, 0.0):
    stats.update(rows=0, pA=0.0, greedy_ok=0)
    cons = [SamplingParams(temperature=temp, seed=i, max_tokens=max_tokens_for(SCHEMAS[i % len(SCHEMAS)]),
                           structured_outputs=StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)])) for i in range(n)]
    outs = llm.generate(prompts, cons, use_tqdm=False)
    r = stats["rows"]
    print(f"temp={temp}: masked rows {r}, mean p(allowed) {stats['pA']/r:.3f}, unmasked argmax allowed {stats['greedy_ok']/r:.3f}",
          "tokens", sum(len(o.outputs[0].token_ids) for o in outs))
