"""One float32 row through the packed layer: F.linear on the dense weight (the tree's rule) against oneDNN's
packed GEMM (the previous code), for a single sequence's decode step (direct forward + LM head, 300 tokens of
context), alternating in one process, 12 rounds of 20 steps."""
import statistics, time
from pagedllm import LLM
from pagedllm.kernels import cpu_linear
from pagedllm.worker.model_input import SequenceChunk
llm = LLM(quantization="none", max_model_len=1024, num_gpu_blocks_override=2048)
w = llm.llm_engine.executor.driver_worker
runner, kv = w.model_runner, w.cache_engine.gpu_cache
rule = cpu_linear.cpu_linear_forward
packed_only = lambda x, weight, packed, bias: cpu_linear.packed_linear(x, packed, bias)  # noqa: E731
c = [SequenceChunk(0, [100], 300, list(range(0, 22)), sample=True)]
ids, pos, meta, li = runner.prepare_inputs(c)
res = {"oneDNN packed": [], "F.linear (tree)": []}
for _ in range(12):
    for name, fn in (("oneDNN packed", packed_only), ("F.linear (tree)", rule)):
        cpu_linear.cpu_linear_forward = fn
        t = time.perf_counter()
        for _ in range(20):
            h = runner.direct_forward(ids, pos, kv, meta)
            runner.model.compute_logits(h[li])
        res[name].append((time.perf_counter() - t) / 20)
cpu_linear.cpu_linear_forward = rule
for k, v in res.items():
    print(f"{k}: best {1e3 * min(v):.2f} ms, median {1e3 * statistics.median(v):.2f} ms per step")
ratios = [a / b for a, b in zip(res["oneDNN packed"], res["F.linear (tree)"])]
print(f"median of per-round ratios {statistics.median(ratios):.3f}x (range {min(ratios):.2f}-{max(ratios):.2f})")
