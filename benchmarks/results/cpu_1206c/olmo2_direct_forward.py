"""An OLMo 2 model of the bundled model's shape (30 layers, hidden 576, 9/3 heads, vocab 49 152; post-norms,
whole-projection q/k norms), random float32 weights: N requests (argv[2], default 64) of 16-256 prompt tokens, 128
output tokens, greedy, on the module path or the CPU direct forward (PAGEDLLM_CPU_DIRECT_FORWARD, set by the caller).
Prints output tok/s of 2 runs."""
import sys
import tempfile
import time

import transformers

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.throughput import make_workload

d = tempfile.mkdtemp()
transformers.Olmo2Config(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         tie_word_embeddings=True).save_pretrained(d)
llm = LLM(model=d, load_format="dummy", skip_tokenizer_init=True, dtype="float32", max_model_len=1024)
runner = llm.llm_engine.executor.driver_worker.model_runner
n = int(sys.argv[2]) if len(sys.argv) > 2 else 64
wl = make_workload(n, 16, 256, 128, 49152, 0)
ps = [{"prompt_token_ids": p} for p in wl.prompts]
sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
llm.generate(ps[:2], sp, use_tqdm=False)
for r in range(2):
    t = time.perf_counter()
    llm.generate(ps, sp, use_tqdm=False)
    print(f"{sys.argv[1]:8s} {n:3d} requests, direct forward {'on ' if runner.direct_forward is not None else 'off'}: "
          f"{n * 128 / (time.perf_counter() - t):6.1f} out tok/s", flush=True)
