import sys, time, random, collections
from pagedllm import LLM, SamplingParams
hybrid = sys.argv[1] == "hybrid"
llm = LLM(model="/tmp/g270", skip_tokenizer_init=True, dtype="float32", device="cpu", load_format="dummy",
          kv_cache_memory_bytes=2_000_000_000, max_model_len=2048, max_num_seqs=128,
          disable_hybrid_kv_cache_manager=not hybrid, disable_log_stats=True)
runner = llm.llm_engine.executor.driver_worker.model_runner
st = runner.enable_step_stats()
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(600)]} for _ in range(int(sys.argv[2]))]
t0 = time.perf_counter()
llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
wall = time.perf_counter() - t0
agg = collections.defaultdict(lambda: [0, 0.0, 0])
for rec in st.records:
    kind, path, n, *rest = rec
    a = agg[(kind, path)]; a[0] += 1; a[2] += n
    a[1] += rest[0] if rest and isinstance(rest[0], float) else 0
print(sys.argv[1], f"wall {wall:.1f}", st.records[0], {k: (v[0], round(v[1], 3), v[2]) for k, v in agg.items()})
