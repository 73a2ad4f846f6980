"""Sliding-window attention and logit soft caps in the Triton kernels: what a window saves, what a cap costs.

Decode (split-KV): batch 64, context 8192, 32 query / 8 KV heads, head_dim 128, bf16, blocks of 16, head-major pool;
a prompt step: 4 chunks of 2048 tokens after 6144 of context, through the prefill kernel and the unified kernel. Each
(window, cap) is timed with CUDA events over repeated eager launches (no graph); prints ms and the ratio to the
same kernel without window or cap (a window's ideal decode ratio is window / context).
``python benchmarks/gpu/sliding_window_bench.py``
"""
import torch

from pagedllm.kernels import kv_layout
from pagedllm.kernels.triton_attention import DecodeWorkspace, paged_decode_attention, paged_prefill_attention
from pagedllm.kernels.triton_unified_attention import unified_attention

HQ, HK, D, BS, CTX = 32, 8, 128, 16, 8192
VARIANTS = [(None, None), (4096, None), (1024, None), (None, 50.0), (4096, 50.0)]


def timed(fn, iters: int = 50) -> float:
    """Mean ms of one launch over `iters` back-to-back eager launches, after a warm-up that also compiles. They are
    queued behind a GPU sleep, so the events time the kernels rather than Python's launch overhead."""
    for _ in range(3):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # ~50 ms: the launches below are all queued before the GPU reaches them
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / iters


def pool(num_seqs: int, ctx: int, g: torch.Generator):
    """Random K/V (head-major, as the engine allocates them) and shuffled block tables of `num_seqs` × `ctx` tokens."""
    blocks = num_seqs * ctx // BS
    shape = (blocks, BS, HK, D)
    kc = kv_layout.to_layout(torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16), kv_layout.HEAD_MAJOR)
    vc = kv_layout.to_layout(torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16), kv_layout.HEAD_MAJOR)
    tables = torch.randperm(blocks, generator=g, device="cuda").view(num_seqs, -1).to(torch.int32)
    return kc, vc, tables, torch.full((num_seqs,), ctx, dtype=torch.int32, device="cuda")


def report(name: str, runs: dict) -> None:
    base = runs[(None, None)]
    for (window, cap), ms in runs.items():
        print(f"{name:8s} window={window!s:5s} cap={cap!s:5s} {ms:8.3f} ms  {ms / base:5.2f}x of full")


def main() -> None:
    print(f"device: {torch.cuda.get_device_name()}")
    g = torch.Generator(device="cuda").manual_seed(0)
    scale = D**-0.5
    batch = 64
    kc, vc, tables, lens = pool(batch, CTX, g)
    q = torch.randn(batch, HQ, D, generator=g, device="cuda", dtype=torch.bfloat16)
    out, ws = torch.empty_like(q), DecodeWorkspace.allocate("cuda")
    report("decode", {(w, c): timed(lambda w=w, c=c: paged_decode_attention(
        q, kc, vc, tables, lens, scale, CTX, out=out, workspace=ws, sliding_window=w, logits_soft_cap=c))
        for w, c in VARIANTS})
    del kc, vc
    chunks, chunk = 4, 2048
    kc, vc, tables, lens = pool(chunks, CTX, g)
    q = torch.randn(chunks * chunk, HQ, D, generator=g, device="cuda", dtype=torch.bfloat16)
    starts = torch.arange(0, chunks * chunk + 1, chunk, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    report("prefill", {(w, c): timed(lambda w=w, c=c: paged_prefill_attention(
        q, kc, vc, tables, lens, starts, scale, 0, chunks, chunk, out, sliding_window=w, logits_soft_cap=c), 10)
        for w, c in VARIANTS})
    report("unified", {(w, c): timed(lambda w=w, c=c: unified_attention(
        q, kc, vc, tables, lens, starts, scale, out, sliding_window=w, logits_soft_cap=c), 10)
        for w, c in VARIANTS})


if __name__ == "__main__":
    main()
