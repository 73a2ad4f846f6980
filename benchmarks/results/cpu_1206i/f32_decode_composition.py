"""The issue 18 workload (64 requests, 16-256 in, 128 out, --quantization none) with the direct forward's kernels
timed: forward time per row count and each kernel group's total (GEMMs per linear, attention, norms, ...)."""
import time, gc, collections
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.throughput import make_workload
from pagedllm.model.cpu_direct_forward import LlamaDirectForward
llm = LLM(quantization="none", max_model_len=8192)
wl = make_workload(64, 16, 256, 128, 49152, 0)
ps = [{"prompt_token_ids": p} for p in wl.prompts]
sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
llm.generate(ps[:2], sp, use_tqdm=False)
fwd = llm.llm_engine.executor.driver_worker.model_runner.direct_forward
T = collections.Counter(); N = collections.Counter(); CUR = [0]
def wrap(obj, name, label):
    inner = getattr(obj, name)
    def f(*a, **k):
        t = time.perf_counter(); r = inner(*a, **k); key = (label, CUR[0] if CUR[0] in (64,) else ("prefill" if CUR[0] > 64 else "small")); T[key] += time.perf_counter() - t; N[key] += 1; return r
    setattr(obj, name, f)
for attr in ("_attention", "_rms", "_rope", "_cache", "_silu"):
    wrap(fwd, attr, attr)
for layer in fwd.layers:
    for nm in ("qkv", "o", "up", "down"):
        lin = getattr(layer, nm)
        if lin.dense is not None:
            wrap(lin.dense, "forward", "gemm_" + nm)
# time per forward by row count
orig_call = LlamaDirectForward.__call__
steps = collections.defaultdict(list)
def call(self, input_ids, *a, **k):
    CUR[0] = input_ids.shape[0]; t = time.perf_counter(); r = orig_call(self, input_ids, *a, **k); steps[input_ids.shape[0]].append(time.perf_counter() - t); return r
LlamaDirectForward.__call__ = call
eng = llm.llm_engine
orig_step = eng.step
stept = []
def step():
    t = time.perf_counter(); r = orig_step(); stept.append(time.perf_counter() - t); return r
eng.step = step
t = time.perf_counter(); llm.generate(ps, sp, use_tqdm=False); wall = time.perf_counter() - t
d64 = steps.get(64, [])
print(f"run {wall:.2f} s, {len(stept)} engine steps, sum {sum(stept):.2f} s")
print(f"forward t=64: {len(d64)} calls, median {sorted(d64)[len(d64)//2]*1e3:.1f} ms, total {sum(d64):.2f} s")
print("other forwards:", {k: (len(v), round(sum(v), 2)) for k, v in steps.items() if k != 64})
for k in sorted(T, key=lambda k: -T[k]): print(f"  {k}: {T[k]:.2f} s over {N[k]} calls")
