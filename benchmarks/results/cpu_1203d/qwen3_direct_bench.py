"""Qwen3-0.6B's shape (random weights, Q8_0 projections in a GGUF) on this CPU: decode steps through the direct
forward and through the module path, same engine, same prompts; ms per step (batch 1 and 4)."""
import sys, time, tempfile, pathlib, json
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "tests"))
import torch, transformers
from test_gguf_qwen import write_qwen_gguf
from pagedllm import LLM, SamplingParams

d = pathlib.Path(sys.argv[1]); d.mkdir(exist_ok=True)
src = d / "qwen3-0.6b-shape-q8.gguf"
if not src.exists():
    cfg = transformers.Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                   num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                   max_position_embeddings=4096, tie_word_embeddings=True, initializer_range=0.02)
    torch.manual_seed(0)
    m = transformers.Qwen3ForCausalLM(cfg).eval()
    t = time.time(); write_qwen_gguf(m, "qwen3", src, q8_linears=True); print("wrote", src, round(time.time()-t, 1), "s")
    del m
llm = LLM(model=str(src), skip_tokenizer_init=True, quantization="gguf", num_gpu_blocks_override=512, max_model_len=1024,
          device="cpu", swap_space=0.01)
runner = llm.llm_engine.executor.driver_worker.model_runner
direct = runner.direct_forward
print("direct forward:", type(direct).__name__)
res = {}
for batch in (1, 4):
    prompts = [{"prompt_token_ids": list(range(100 + i, 164 + i))} for i in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for rnd in range(2):
        for name in ("direct", "module"):
            runner.direct_forward = direct if name == "direct" else None
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
            t = time.perf_counter(); outs = llm.generate(prompts, sp, use_tqdm=False); el = time.perf_counter() - t
            toks = [o.outputs[0].token_ids for o in outs]
            res.setdefault((batch, name), []).append(el / 64 * 1000)
            res.setdefault(("tokens", batch, name), toks)
runner.direct_forward = direct
for batch in (1, 4):
    dm, mm = min(res[(batch, "direct")]), min(res[(batch, "module")])
    same = res[("tokens", batch, "direct")] == res[("tokens", batch, "module")]
    print(f"batch {batch}: direct {dm:.1f} ms/step, module {mm:.1f} ms/step (per generated step incl. prefill), "
          f"module/direct {mm/dm:.3f}x, identical tokens {same}")
