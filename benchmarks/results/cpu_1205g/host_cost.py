"""Host time of a decode step by phase (schedule, chunks, prepare_inputs), hybrid KV cache against one table, on a
tiny Gemma-3-shaped model (26 layers, 4 global, window 512) so that host work shows beside the forward pass:

    python host_cost.py hybrid|one SEQS CONTEXT [STEPS]
"""
import os
import random
import sys
import tempfile
import time

from transformers import Gemma3TextConfig

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import RequestOutputKind

layout, seqs, ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 40
d = tempfile.mkdtemp()
cfg = Gemma3TextConfig(hidden_size=64, num_hidden_layers=26, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                       intermediate_size=128, vocab_size=2048, sliding_window=512, max_position_embeddings=32768)
cfg.architectures = ["Gemma3ForCausalLM"]
cfg.save_pretrained(d)
llm = LLM(model=d, load_format="dummy", skip_tokenizer_init=True, device="cpu", dtype="float32",
          max_model_len=ctx + steps + 32, max_num_seqs=seqs, max_num_batched_tokens=16384,
          kv_cache_memory_bytes=int(os.environ.get("KV_BYTES", 2_000_000_000)), disable_hybrid_kv_cache_manager=layout != "hybrid",
          disable_log_stats=True)
eng = llm.llm_engine
rng = random.Random(0)
params = SamplingParams(temperature=0.0, max_tokens=steps + 20, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)  # as LLM.generate asks
for i in range(seqs):
    eng.add_request(f"r{i}", {"prompt_token_ids": [rng.randrange(10, 2000) for _ in range(ctx)]}, params)
while eng.scheduler.waiting or any(s.num_computed_tokens < ctx for g in eng.scheduler.running for s in g.get_seqs()):
    eng.step()
for _ in range(3):
    eng.step()

timers = {}
def wrap(obj, name, label):
    orig = getattr(obj, name)
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            timers[label] = timers.get(label, 0.0) + time.perf_counter() - t
    setattr(obj, name, timed)

runner = eng.executor.driver_worker.model_runner
wrap(eng.scheduler, "schedule", "schedule")
wrap(eng, "_chunk", "chunks")
wrap(runner, "prepare_inputs", "prepare_inputs")
wrap(runner, "execute_model", "execute_model")
t0 = time.perf_counter()
for _ in range(steps):
    eng.step()
wall = time.perf_counter() - t0
print(f"{layout}: {eng.scheduler.block_manager.num_groups} groups, {seqs} seqs at ~{ctx} tokens, {steps} steps: "
      f"wall {1e3 * wall / steps:.2f} ms/step; " + ", ".join(f"{k} {1e3 * v / steps:.2f}" for k, v in timers.items())
      + " ms/step (execute_model includes prepare_inputs and the forward)")
