"""Where a CPU step's time goes, speculation off or on: python step_breakdown.py off|on [FIRST N [CONCURRENCY]]
(prompts FIRST..FIRST+N of the spec-decode benchmark's 100 copy prompts, default 40..51, at 4 concurrent). Times every engine step, and inside the
direct forward the GGUF linears and the attention kernel (their C calls wrapped), then the logits and sampler."""
import collections
import sys
import time

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.spec_decode import make_copy_prompts, run_closed_loop
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.model.cpu_direct_forward import LlamaDirectForward
from pagedllm.model.models.llama import LlamaForCausalLM

acc = collections.defaultdict(float)


def timed(name, fn):
    def w(*a, **k):
        t0 = time.perf_counter()
        r = fn(*a, **k)
        acc[name] += time.perf_counter() - t0
        return r
    return w


orig_init = LlamaDirectForward.__init__


def init(self, *a, **k):
    orig_init(self, *a, **k)
    self._linear = timed("linear", self._linear)
    self._attention = timed("attention", self._attention)
    for n in ("_rms", "_rope", "_silu", "_cache"):
        setattr(self, n, timed("norm/rope/silu/cache", getattr(self, n)))


LlamaDirectForward.__init__ = init
orig_call = LlamaDirectForward.__call__
rows_now = [0]


def call(self, input_ids, *a, **k):
    rows_now[0] = int(input_ids.shape[0])
    t0 = time.perf_counter()
    r = orig_call(self, input_ids, *a, **k)
    acc["forward"] += time.perf_counter() - t0
    return r


LlamaDirectForward.__call__ = call
LlamaForCausalLM.compute_logits = timed("logits", LlamaForCausalLM.compute_logits)
by_rows = collections.defaultdict(lambda: collections.defaultdict(float))
orig_step = LLMEngine.step


def step(self):
    before = dict(acc)
    rows_now[0] = 0
    t0 = time.perf_counter()
    r = orig_step(self)
    dt = time.perf_counter() - t0
    d = by_rows[rows_now[0]]
    d["steps"] += 1
    d["step"] += dt
    for n in acc:
        d[n] += acc[n] - before.get(n, 0.0)
    return r


LLMEngine.step = step
spec = sys.argv[1] == "on"
first, num = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (40, 12)
concurrency = int(sys.argv[4]) if len(sys.argv) > 4 else 4
kw = dict(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}) if spec else {}
llm = LLM(max_model_len=2048, num_gpu_blocks_override=2048, **kw)
prompts = make_copy_prompts(llm.get_tokenizer(), 100)[first:first + num]
params = [SamplingParams(temperature=0.0, max_tokens=512) for _ in prompts]
t, outs = run_closed_loop(llm.llm_engine, prompts, params, concurrency, "p")
n = sum(len(o) for o in outs)
print(f"{sys.argv[1]}: {n} tokens in {t:.1f} s = {n / t:.1f} tok/s")
print("rows  steps   ms/step  forward  linear  attention  norm..  logits (ms per step; rest = step - forward - logits)")
for rows in sorted(by_rows):
    d = by_rows[rows]
    s = d["steps"]
    if s < 5 and rows > 24:
        continue
    f = lambda k: 1e3 * d.get(k, 0.0) / s
    print(f"{rows:4d} {int(s):6d} {f('step'):9.2f} {f('forward'):8.2f} {f('linear'):7.2f} {f('attention'):10.2f}"
          f" {f('norm/rope/silu/cache'):7.2f} {f('logits'):7.2f}  rest {f('step') - f('forward') - f('logits'):6.2f}")
tot = collections.defaultdict(float)
for d in by_rows.values():
    for k, v in d.items():
        tot[k] += v
print(f"total: step {tot['step']:.1f} s, forward {tot['forward']:.1f}, linear {tot['linear']:.1f}, attention "
      f"{tot['attention']:.1f}, logits {tot['logits']:.1f}, rest {tot['step'] - tot['forward'] - tot['logits']:.1f}")
