"""Per-component times of float32 decode steps (64 sequences, 136-token prompts, 128 outputs) by wrapping the direct forward's C calls.

    PYTHONPATH=. python benchmarks/results/cpu_1127h/decode_breakdown.py 64
"""
import time, collections, sys
from pagedllm import LLM, SamplingParams
from pagedllm.model.cpu_direct_forward import LlamaDirectForward
from pagedllm.kernels.cpu_f32_gemm import F32Gemm

acc = collections.defaultdict(float); cnt = collections.Counter(); durs = collections.defaultdict(list)
def timed(name, fn):
    def w(*a, **k):
        t0 = time.perf_counter(); r = fn(*a, **k); d = time.perf_counter() - t0; acc[name] += d; cnt[name] += 1; durs[name].append(d); return r
    return w
orig_call = LlamaDirectForward.__call__
rows_of_step = []
per_kind = collections.defaultdict(lambda: collections.defaultdict(float))
def call(self, input_ids, *a, **k):
    before = dict(acc); t0 = time.perf_counter(); r = orig_call(self, input_ids, *a, **k); dt = time.perf_counter() - t0
    kind = "decode" if input_ids.shape[0] == rows else "other"
    for n in acc: per_kind[kind][n] += acc[n] - before.get(n, 0.0)
    per_kind[kind]["forward"] += dt
    rows_of_step.append((input_ids.shape[0], dt)); return r
LlamaDirectForward.__call__ = call
F32Gemm.linear = timed("gemm", F32Gemm.linear)
from pagedllm.model.cpu_direct_forward import DirectForward
orig_build = DirectForward.build.__func__
def build(cls, *a, **k):
    o = orig_build(cls, *a, **k)
    for n in ("_attention", "_rms", "_rope", "_silu", "_cache"):
        setattr(o, n, timed(n, getattr(o, n)))
    return o
DirectForward.build = classmethod(build)
rows = int(sys.argv[1]) if len(sys.argv) > 1 else 64
llm = LLM(quantization="none", num_gpu_blocks_override=4096, max_num_seqs=rows)
prompts = [{"prompt_token_ids": [1 + (i * 7 + j) % 4000 for j in range(136)]} for i in range(rows)]
sp = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0)
t0 = time.perf_counter(); llm.generate(prompts, sp, use_tqdm=False); wall = time.perf_counter() - t0
dec = [dt for r, dt in rows_of_step if r == rows]
print(f"wall {wall:.2f} s; forward calls {len(rows_of_step)}; decode forwards ({rows} rows) {len(dec)}: "
      f"mean {1e3*sum(dec)/len(dec):.1f} ms, min {1e3*min(dec):.1f}")
tot_fw = sum(dt for _, dt in rows_of_step)
print(f"all forwards {tot_fw:.2f} s; outside forward {wall - tot_fw:.2f} s")
for k, v in sorted(acc.items(), key=lambda x: -x[1]): print(f"  {k:12s} {v:7.2f} s  calls {cnt[k]}")
for kind, d in per_kind.items():
    n = sum(1 for r, _ in rows_of_step if (r == rows) == (kind == "decode"))
    print(kind, n, "steps; per step ms:", {k: round(1e3 * v / n, 1) for k, v in sorted(d.items(), key=lambda x: -x[1])})
for n, v in durs.items():
    v = sorted(v); print(n, "calls", len(v), "median us", round(1e6*v[len(v)//2],1), "p10", round(1e6*v[len(v)//10],1), "p90", round(1e6*v[9*len(v)//10],1), "max", round(1e6*v[-1],1))
