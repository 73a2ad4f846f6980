"""Host cost of the scheduler per step, hybrid vs one table (CPU, Gemma-3-270M shape, random weights)."""
import sys, time, random
from pagedllm import LLM, SamplingParams
hybrid = sys.argv[1] == "hybrid"
llm = LLM(model="/tmp/g270", skip_tokenizer_init=True, dtype="float32", device="cpu", load_format="dummy",
          kv_cache_memory_bytes=2_000_000_000, max_model_len=2048, max_num_seqs=128,
          disable_hybrid_kv_cache_manager=not hybrid, disable_log_stats=True)
eng = llm.llm_engine
sch = eng.scheduler
times = []
orig = sch.schedule
def timed(*a, **k):
    t = time.perf_counter(); r = orig(*a, **k); times.append(time.perf_counter() - t); return r
sch.schedule = timed
fr = []
bm = sch.block_manager
for name in ("free_behind_window", "append_slots", "can_append_slots"):
    pass
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(600)]} for _ in range(128)]
t0 = time.perf_counter()
llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
wall = time.perf_counter() - t0
print(f"{'hybrid' if hybrid else 'one table'}: groups {bm.num_groups}, steps {len(times)}, schedule total {sum(times):.3f} s, "
      f"mean {1e3*sum(times)/len(times):.2f} ms, max {1e3*max(times):.1f} ms; wall {wall:.1f} s")
