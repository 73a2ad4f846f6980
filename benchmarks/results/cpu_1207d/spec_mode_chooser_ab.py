import sys
from pagedllm.benchmarks.copy_prompts import make_copy_prompts
from pagedllm.benchmarks.spec_decode import run_closed_loop
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.model.loader import default_model_path
from pagedllm.sampling_params import SamplingParams
# argv: {chooser|nochooser} [f32]; f32: a float32 target (dequantized) with the Q4_1 file served quantized as draft
f32 = sys.argv[2:] == ["f32"]
target = dict(dtype="float32", quantization="none") if f32 else {}
draft = {"model": default_model_path(), "num_speculative_tokens": 4, **({"quantization": "gguf"} if f32 else {})}
off = LLMEngine(EngineArgs(device="cpu", max_model_len=2048, max_num_seqs=4, **target))
on = LLMEngine(EngineArgs(device="cpu", max_model_len=2048, max_num_seqs=4, speculative_config=draft, **target))
chooser = on.spec_decoder.mode
if sys.argv[1] == "nochooser":
    on.spec_decoder.mode = None
prompts = make_copy_prompts(off.tokenizer, 8)
params = [SamplingParams(temperature=0, max_tokens=128)] * 8
for e in (off, on): run_closed_loop(e, prompts[:2], [SamplingParams(temperature=0, max_tokens=8)] * 2, 1, "w")
ratios = []
for r in range(3):
    rates = {}
    for name, e in (("off", off), ("on", on)):
        s, outs = run_closed_loop(e, prompts, params, 1, f"{name}{r}")
        rates[name] = sum(map(len, outs)) / s
    ratios.append(rates["on"] / rates["off"])
    print(sys.argv[1], "round", r, {k: round(v, 1) for k, v in rates.items()}, "ratio", round(ratios[-1], 3), flush=True)
st = on.stats()
print(sys.argv[1], "ratios", [round(x, 3) for x in ratios], "drafted", st.get("spec_decode_num_draft_tokens"),
      "chooser rates", chooser.rates)
