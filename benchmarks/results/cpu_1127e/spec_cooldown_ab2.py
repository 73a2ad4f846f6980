"""off vs speculation with the acceptance cooldown (the previous rule) vs without it on this synchronous engine
(the new rule), interleaved slices: python spec_cooldown_ab2.py {auto|none} CONC N ROUNDS"""
import json, sys, types
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm import SamplingParams
from pagedllm.benchmarks.spec_decode import make_copy_prompts, run_closed_loop, _measure
quant, conc, n, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
def with_cooldown(self, seq, group):  # the rule before this session: the cooldown holds everywhere
    if not seq.output_token_ids or "beam" in group.extra or "structured_output" in group.extra:
        return False
    return len(seq.output_token_ids) >= seq.extra.get("spec_resume_at", 0)
engines = {}
for label, sc in (("off", None), ("cooldown", spec), ("no-cooldown", spec)):
    engines[label] = LLMEngine(EngineArgs(device="cpu", quantization=None if quant == "auto" else quant,
                               max_model_len=1024, max_num_seqs=64, num_gpu_blocks_override=1024, speculative_config=sc))
engines["cooldown"].spec_decoder._may_speculate = types.MethodType(with_cooldown, engines["cooldown"].spec_decoder)
prompts = make_copy_prompts(engines["off"].tokenizer, n, 0)
for label, eng in engines.items():
    run_closed_loop(eng, prompts[:2], [SamplingParams(temperature=0, max_tokens=8)] * 2, 2, f"warm{label}")
res, outs = {}, {}
_measure(engines, "copy", prompts, [SamplingParams(temperature=0, max_tokens=128)] * n, conc, rounds, res, outs)
for label, e in res.items():
    same = sum(a == b for a, b in zip(outs["off"], outs[label]))
    print(f"{quant} c={conc} {label:12s} {e['output_tok_s']:7.1f} tok/s  x{e['output_tok_s'] / res['off']['output_tok_s']:.2f}  "
          f"acc {e['acceptance_rate']:.2f} len {e['mean_acceptance_length']:.2f} identical {same}/{n}", flush=True)
