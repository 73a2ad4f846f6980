import time, json, sys
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm import SamplingParams
from pagedllm.benchmarks.spec_decode import make_copy_prompts
quant = sys.argv[1]
spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
res = {}
for label, sc in (("off", None), ("on", spec)):
    e = LLMEngine(EngineArgs(device="cpu", quantization=None if quant == "auto" else quant, max_model_len=1024,
                             num_gpu_blocks_override=512, speculative_config=sc))
    prompts = make_copy_prompts(e.tokenizer, 6, 0)
    e.add_request("w", prompts[0][:50], SamplingParams(temperature=0, max_tokens=4))
    while e.has_unfinished_requests(): e.step()
    times = {"prefill": [], "decode": []}; ntok = 0
    for i, p in enumerate(prompts):
        e.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=128))
        first = True
        while e.has_unfinished_requests():
            ns = e.spec_decoder.stats.num_spec_steps if getattr(e, "spec_decoder", None) else 0
            t = time.perf_counter(); outs = e.step(); dt = time.perf_counter() - t
            times["prefill" if first else "decode"].append(dt); first = False
            if getattr(e, "spec_decoder", None) and e.spec_decoder.stats.num_spec_steps > ns: times.setdefault("verify", []).append(dt)
        ntok += len(outs[0].outputs[0].token_ids)
    dec = times["decode"]
    res[label] = (sum(times["prefill"]), sum(dec), len(dec), ntok)
    print(label, f"prefill {sum(times['prefill']):.2f} s, decode {sum(dec):.2f} s in {len(dec)} steps ({1e3*sum(dec)/len(dec):.1f} ms/step), {ntok} tokens; tok/s all {ntok/(sum(dec)+sum(times['prefill'])):.1f}, decode-only {ntok/sum(dec):.1f}", flush=True)
    if "verify" in times: v = times["verify"]; print(f"  verify steps {len(v)}: {1e3*sum(v)/len(v):.1f} ms/step; plain {(sum(dec)-sum(v))*1e3/(len(dec)-len(v)):.1f} ms/step")
    del e
