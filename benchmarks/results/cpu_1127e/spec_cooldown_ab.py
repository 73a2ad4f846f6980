"""off vs several speculative configs, interleaved slices, copy workload at one concurrency."""
import json, sys, logging
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm import SamplingParams
from pagedllm.benchmarks.spec_decode import make_copy_prompts, run_closed_loop, _measure
quant, conc, n, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
configs = json.loads(sys.argv[5])  # label -> spec config dict or null
engines = {}
for label, spec in configs.items():
    engines[label] = LLMEngine(EngineArgs(device="cpu", quantization=None if quant == "auto" else quant, max_model_len=1024,
                               max_num_seqs=4, num_gpu_blocks_override=1024,
                               speculative_config=json.dumps(spec) if spec else None))
prompts = make_copy_prompts(engines["off"].tokenizer, n, 0)
for label, eng in engines.items():
    run_closed_loop(eng, prompts[:2], [SamplingParams(temperature=0, max_tokens=8)] * 2, 2, f"warm{label}")
res, outs = {}, {}
_measure(engines, "copy", prompts, [SamplingParams(temperature=0, max_tokens=128)] * n, conc, rounds, res, outs)
for label, e in res.items():
    same = sum(a == b for a, b in zip(outs["off"], outs[label]))
    print(f"{label:10s} {e['output_tok_s']:7.1f} tok/s  x{e['output_tok_s'] / res['off']['output_tok_s']:.2f}  "
          f"acc {e['acceptance_rate']:.2f} len {e['mean_acceptance_length']:.2f} identical {same}/{n}")
