import time, sys
from pagedllm import LLM, SamplingParams
from pagedllm.tokenizer import get_tokenizer
from pagedllm.benchmarks.copy_prompts import make_copy_prompts
from pagedllm.spec_decode import draft_checkpoint as dc
tok = get_tokenizer(None)
C = int(sys.argv[1]); K = int(sys.argv[2]); pol = sys.argv[3]
prompts = [{"prompt_token_ids": p} for p in make_copy_prompts(tok, C * 2)]
sp = SamplingParams(temperature=0, max_tokens=128)
llm = LLM(max_model_len=2048, quantization="none", num_gpu_blocks_override=1024, max_num_seqs=C,
          speculative_config={"model": "SmolLM2-135M-Instruct", "quantization": "gguf", "num_speculative_tokens": K, "draft_length_policy": pol})
llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
prop = llm.llm_engine.spec_decoder.draft
acc = {"t": 0.0, "n": 0, "rows": 0}
orig = prop.worker.execute_model
def timed(req):
    t0 = time.perf_counter(); r = orig(req); acc["t"] += time.perf_counter() - t0; acc["n"] += 1; acc["rows"] += sum(len(c.token_ids) for c in req.chunks); return r
prop.target.draft_worker.execute_model = timed
t0 = time.perf_counter()
outs = llm.generate(prompts, sp, use_tqdm=False)
dt = time.perf_counter() - t0
st = llm.llm_engine.stats()
n = sum(len(o.outputs[0].token_ids) for o in outs)
print(f"C={C} K={K} {pol}: {n/dt:.1f} tok/s, total {dt:.1f}s, draft forward {acc['t']:.1f}s in {acc['n']} calls ({acc['rows']} rows), drafts {st['spec_decode_num_draft_tokens']} acc {st['spec_decode_num_accepted_tokens']} steps {st['spec_decode_num_spec_steps']}")
