"""float32, copy workload: off/on with oneDNN only vs the native small-row GEMM (auto), interleaved."""
import json, os, sys
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm import SamplingParams
from pagedllm.benchmarks.spec_decode import make_copy_prompts, run_closed_loop, _measure
conc, n, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
cool = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, **cool})
engines = {}
for gemm in ("onednn", "auto"):
    os.environ["PAGEDLLM_CPU_GEMM"] = gemm
    for label, sc in (("off", None), ("on", spec)):
        engines[f"{label}-{gemm}"] = LLMEngine(EngineArgs(device="cpu", quantization="none", max_model_len=1024,
                                  max_num_seqs=4, num_gpu_blocks_override=1024, speculative_config=sc))
first = next(iter(engines.values()))
prompts = make_copy_prompts(first.tokenizer, n, 0)
for label, eng in engines.items():
    run_closed_loop(eng, prompts[:2], [SamplingParams(temperature=0, max_tokens=8)] * 2, 2, f"warm{label}")
res, outs = {}, {}
_measure(engines, "copy", prompts, [SamplingParams(temperature=0, max_tokens=128)] * n, conc, rounds, res, outs)
for label, e in res.items():
    same = sum(a == b for a, b in zip(outs["off-onednn"], outs[label]))
    off = res["off-" + label.split("-")[1]]["output_tok_s"]
    print(f"{label:12s} {e['output_tok_s']:7.1f} tok/s  on/off x{e['output_tok_s'] / off:.2f}  "
          f"vs off-onednn x{e['output_tok_s'] / res['off-onednn']['output_tok_s']:.2f}  "
          f"acc {e['acceptance_rate']:.2f} len {e['mean_acceptance_length']:.2f} identical to off-onednn {same}/{n}")
