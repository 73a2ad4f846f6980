"""Phi-4-mini-shaped (partial rotary 0.75: RoPE on 96 of each head's 128 dims) random float32 model, decode forward:
the CPU direct forward against the module path, alternating in one process (same engine, same inputs; ROUNDS rounds,
each timing every variant in turn; best and median round printed); checks the hidden states are bit-identical.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/results/cpu_1205/phi4mini_direct_vs_module.py [small|real4]

small: hidden 1024, 8 layers, 24 / 8 heads of 128, intermediate 2816, vocab 32064. real4: Phi-4-mini's layer shape
(hidden 3072, 24 / 8 heads of 128, intermediate 8192) with 4 of its 32 layers and a 32064-token vocab (the forward
does not depend on the vocab: the LM head is not timed). Default RoPE (Phi-4-mini's LongRoPE changes the tables'
values, not the work).

"forward" is model.forward (the part the direct forward replaces). "module" is the module path as it is now (the
C RoPE kernel, partial rotary included); "module, torch RoPE" is the module path with RotaryEmbedding.forward_native,
i.e. the module path Phi-4-mini ran before the C kernel took the rotary dim (its direct forward opted out then)."""
import os
import statistics
import sys
import tempfile
import time

import torch
import transformers

from pagedllm import LLM
from pagedllm.model.layers.rotary import RotaryEmbedding
from pagedllm.worker.model_input import SequenceChunk

SHAPES = {
    "small": dict(hidden_size=1024, num_hidden_layers=8, intermediate_size=2816),
    "real4": dict(hidden_size=3072, num_hidden_layers=4, intermediate_size=8192),
}
shape = sys.argv[1] if len(sys.argv) > 1 else "small"
if shape not in SHAPES:
    sys.exit(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
config = transformers.Phi3Config(**SHAPES[shape], num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                                 partial_rotary_factor=0.75, vocab_size=32064, max_position_embeddings=4096,
                                 tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
torch.manual_seed(0)
tmp = tempfile.TemporaryDirectory()
transformers.Phi3ForCausalLM(config).to(torch.float32).save_pretrained(tmp.name, safe_serialization=True)

llm = LLM(model=tmp.name, dtype="float32", skip_tokenizer_init=True, max_model_len=2048, block_size=16,
          num_gpu_blocks_override=512)
w = llm.llm_engine.executor.driver_worker
runner, kv = w.model_runner, w.cache_engine.gpu_cache
direct = runner.direct_forward
rope = runner.model.model.layers[0].self_attn.rotary_emb
if direct is None:
    sys.exit("no direct forward for this model: nothing to compare")
print(f"{shape}: {SHAPES[shape]}, heads 24 / 8 of 128, rotary_dim {rope.rotary_dim} of head_dim {rope.head_dim}; "
      f"direct forward: {type(direct).__name__} ({direct.gemm_method}), {len(direct.layers)} layers, rotary dims "
      f"{sorted({lyr.rotary_dim for lyr in direct.layers})}; torch threads {torch.get_num_threads()}", flush=True)


def chunks(n, ctx, q):
    nb = (ctx + q + 16) // 16 + 1
    return [SequenceChunk(s, [100 + s] * q, ctx, list(range(s * nb, s * nb + nb)), sample=True) for s in range(n)]


native_forward = RotaryEmbedding.forward


def module_torch_rope(ids, pos, meta):
    """The module path with forward_native RoPE (the partial-rotary module path before the C kernel took it)."""
    RotaryEmbedding.forward = RotaryEmbedding.forward_native
    try:
        return runner.model(ids, pos, kv, meta)
    finally:
        RotaryEmbedding.forward = native_forward


ROUNDS = 9
cases = [("1 x 300 decode", chunks(1, 300, 1), 20), ("4 x 300 decode", chunks(4, 300, 1), 10),
         ("16 x 300 decode", chunks(16, 300, 1), 6)]
if shape == "real4":
    cases = [(name, c, max(2, n // 4)) for name, c, n in cases]
with torch.inference_mode():
    for name, c, n in cases:
        ids, pos, meta, _ = runner.prepare_inputs(c)
        ref = runner.model(ids, pos, kv, meta).clone()
        same = torch.equal(direct(ids, pos, kv, meta), ref)
        same_torch_rope = torch.equal(module_torch_rope(ids, pos, meta), ref)
        fns = {"module": lambda: runner.model(ids, pos, kv, meta),
               "module, torch RoPE": lambda: module_torch_rope(ids, pos, meta),
               "direct": lambda: direct(ids, pos, kv, meta)}
        times = {k: [] for k in fns}
        for _ in range(ROUNDS):
            for k, f in fns.items():
                t = time.perf_counter()
                for _ in range(n):
                    f()
                times[k].append((time.perf_counter() - t) / n * 1e3)
        best = {k: min(v) for k, v in times.items()}
        med = {k: statistics.median(v) for k, v in times.items()}
        m, mt, d = best["module"], best["module, torch RoPE"], best["direct"]
        print(f"{name}: forward module {m:.2f} ms, module with torch RoPE {mt:.2f} ms, direct {d:.2f} ms; direct vs "
              f"module {m / d:.3f}x, vs module with torch RoPE {mt / d:.3f}x, module vs module with torch RoPE "
              f"{mt / m:.3f}x (medians {med['module']:.2f} / {med['module, torch RoPE']:.2f} / {med['direct']:.2f}); "
              f"same bits: direct {same}, torch RoPE {same_torch_rope}; load average {os.getloadavg()[0]:.2f}",
              flush=True)
