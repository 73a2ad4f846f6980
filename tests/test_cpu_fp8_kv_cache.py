"""--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2 on the CPU: the native kernels store x / scale as torch's
saturating cast does (kernels/kv_quant.py's quantize, bit for bit) and attend over fp8 · scale with the bits of
the float32 kernel on the dequantized pool; the engine serves the bundled model with a quarter of the KV bytes."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import cpu_kernels, kv_quant, reference
from pagedllm.model.layers.attention import NativeCpuAttentionBackend

from test_cpu_kernels import _mixed_batch

KERNELS = cpu_kernels.load_cpu_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler: the CPU path runs torch")
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]


def _values(seed: int) -> torch.Tensor:
    """Magnitudes from 1e-8 to 1e5 (subnormal, normal and saturating for both formats), plus ties and specials."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.randn(3968, generator=g) * 10 ** torch.empty(3968).uniform_(-8, 5, generator=g)
    edges = torch.tensor([0.0, -0.0, 448.0, 449.0, 464.0, 500.0, 57344.0, 61440.0, 1e30, float("inf"), -float("inf"),
                          2**-6, 2**-7, 2**-9, 2**-10, 3 * 2**-11, 2**-14, 2**-16, 2**-17, 3 * 2**-18, 1.0625, 1.1875,
                          1.125 * 2**-6, -1.0625, 1.125, 1.375, 5 * 2**-17])
    return torch.cat([spread, edges, torch.zeros(64 - edges.numel() % 64)])


@needs_kernels
@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("scale", [1.0, 0.37, 3.0])
def test_fp8_write_is_kv_quant_quantize_bit_for_bit(dtype, scale):
    x = _values(int(scale * 100)).view(-1, 1, 64)
    kc = torch.zeros(-(-x.shape[0] // 16), 16, 1, 64, dtype=dtype)
    vc = torch.zeros_like(kc)
    KERNELS.reshape_and_cache(x, -x, kc, vc, torch.arange(x.shape[0]), scale, 2 * scale)
    rows = x.shape[0]
    assert torch.equal(kc.view(-1, 64)[:rows].view(torch.uint8), kv_quant.quantize(x.view(-1, 64), dtype, scale).view(torch.uint8))
    assert torch.equal(vc.view(-1, 64)[:rows].view(torch.uint8),
                       kv_quant.quantize(-x.view(-1, 64), dtype, 2 * scale).view(torch.uint8))
    nan = torch.full((1, 1, 64), float("nan"))
    KERNELS.reshape_and_cache(nan, nan, kc, vc, torch.tensor([0]), scale, scale)
    assert bool(kc[0, 0].float().isnan().all())


@needs_kernels
@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("block_size,hq,hk,d", [(16, 9, 3, 64), (8, 8, 2, 128), (1, 4, 4, 32), (32, 8, 1, 80)])
def test_fp8_attention_has_the_bits_of_float32_attention_on_the_dequantized_pool(dtype, block_size, hq, hk, d):
    """Decodes, short chunks (token path) and chunks of 32+ tokens (tile path), with and without context: the
    kernel over the fp8 pool equals the float32 kernel over fp8 · scale exactly, and eq. 4 within float32 error."""
    query, key, value, kc, vc, meta = _mixed_batch(block_size * 7 + hq, block_size, hq, hk, d)
    k_scale, v_scale = 0.05, 0.02
    k8, v8 = kv_quant.quantize(kc, dtype, k_scale), kv_quant.quantize(vc, dtype, v_scale)
    KERNELS.reshape_and_cache(key, value, k8, v8, meta.slot_mapping, k_scale, v_scale)
    out, same = torch.full_like(query, float("nan")), torch.full_like(query, float("nan"))
    KERNELS.paged_attention(out, query, k8, v8, meta.block_tables, meta.seq_lens, meta.query_start_loc, d**-0.5,
                            k_scale=k_scale, v_scale=v_scale)
    kf, vf = kv_quant.dequantize(k8, torch.float32, k_scale), kv_quant.dequantize(v8, torch.float32, v_scale)
    KERNELS.paged_attention(same, query, kf, vf, meta.block_tables, meta.seq_lens, meta.query_start_loc, d**-0.5)
    assert torch.equal(out, same)
    tables = [row[: -(-n // block_size)] for row, n in zip(meta.block_tables.tolist(), meta.seq_lens_cpu)]
    expected = reference.paged_attention_naive(query, kf, vf, tables, meta.seq_lens_cpu, meta.query_lens_cpu, d**-0.5)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)


@needs_kernels
def test_fp8_pool_reads_every_byte_as_torch_does():
    """All 256 codes of each format (NaN included) through the widening, by a one-token attention per code:
    with a single key the output is that value row (fp8 · scale), whatever the scores."""
    for dtype in FP8:
        codes = torch.arange(256, dtype=torch.uint8).view(dtype).view(16, 1, 1, 16)  # 16 blocks of one slot
        scale = 0.75
        q = torch.ones(16, 1, 16)
        out = torch.empty_like(q)
        tables = torch.arange(16, dtype=torch.int32).view(16, 1)
        KERNELS.paged_attention(out, q, torch.zeros_like(codes), codes, tables, torch.ones(16, dtype=torch.int32),
                                torch.arange(17, dtype=torch.int32), 1.0, v_scale=scale)
        want = codes.float().view(16, 1, 16) * scale
        assert torch.equal(out.isnan(), want.isnan())
        finite = ~want.isnan()
        assert torch.equal(out[finite], want[finite])


@needs_kernels
@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_native_backend_sends_every_chunk_of_an_fp8_pool_to_the_kernel(dtype):
    """The backend's per-layer scales reach the write and the read, and chunks longer than the torch-SDPA limit
    stay on the kernel (SDPA would read the pool unscaled)."""
    block_size, hq, hk, d = 16, 9, 3, 64
    query, key, value, kc, vc, meta = _mixed_batch(5, block_size, hq, hk, d)
    k8, v8 = kv_quant.quantize(kc, dtype, 0.1), kv_quant.quantize(vc, dtype, 0.2)
    k8b, v8b = k8.clone(), v8.clone()
    backend = NativeCpuAttentionBackend(KERNELS, layer_scales={k8.data_ptr(): (0.1, 0.2)}, fp8_pool=True)
    assert backend.max_native_query_len >= 1 << 30
    out = backend.forward(query, key, value, (k8, v8), meta, d**-0.5)
    KERNELS.reshape_and_cache(key, value, k8b, v8b, meta.slot_mapping, 0.1, 0.2)
    assert torch.equal(k8.view(torch.uint8), k8b.view(torch.uint8)) and torch.equal(v8.view(torch.uint8), v8b.view(torch.uint8))
    want = torch.empty_like(query)
    KERNELS.paged_attention(want, query, k8b, v8b, meta.block_tables, meta.seq_lens, meta.query_start_loc, d**-0.5,
                            k_scale=0.1, v_scale=0.2)
    assert torch.equal(out, want)


def test_fp8_pool_dtypes_on_the_cpu():
    assert kv_quant.resolve_cache_dtype("fp8", torch.float32, "cpu") == torch.float8_e4m3fn
    assert kv_quant.resolve_cache_dtype("fp8_e4m3", torch.bfloat16, "cpu") == torch.float8_e4m3fn
    assert kv_quant.resolve_cache_dtype("fp8_e5m2", torch.float32, "cpu") == torch.float8_e5m2


def test_fp8_without_the_native_kernels_is_a_clear_error(monkeypatch):
    from pagedllm import LLM

    monkeypatch.setenv(cpu_kernels.KERNELS_ENV, "torch")
    cpu_kernels.load_cpu_kernels.cache_clear()
    try:
        with pytest.raises(ValueError, match="kv_cache_dtype='fp8' on the CPU needs the native CPU kernels"):
            LLM(kv_cache_dtype="fp8", device="cpu", num_gpu_blocks_override=8)
    finally:
        monkeypatch.undo()
        cpu_kernels.load_cpu_kernels.cache_clear()


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time,",
           "The three primary colors are", "import numpy as np\n", "My favourite food is", "In 1969,"]


@needs_kernels
@pytest.mark.parametrize("kv_cache_dtype,floor", [("fp8", 0.9), ("fp8_e5m2", 0.85)])
def test_engine_serves_the_bundled_model_with_an_fp8_pool(kv_cache_dtype, floor):
    """Four times the blocks of a float32 pool in the same bytes; the direct forward and the module path give
    the same tokens; scoring the float32 pool's greedy continuations, the fp8 pool's argmax agrees at most
    positions (teacher-forced, as BENCHMARKS.md measures FP8 accuracy; e4m3 keeps 3 mantissa bits, e5m2 2)."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.fp8_accuracy import teacher_forced

    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    f32 = LLM(quantization="none", max_model_len=256, num_gpu_blocks_override=64)
    outs = f32.generate(PROMPTS, sp, use_tqdm=False)
    prompts = [list(o.prompt_token_ids) for o in outs]
    want = [list(o.outputs[0].token_ids) for o in outs]
    f32_block = f32.llm_engine.executor.driver_worker.cache_block_size_bytes()
    del f32
    llm = LLM(quantization="none", kv_cache_dtype=kv_cache_dtype, max_model_len=256, num_gpu_blocks_override=64)
    worker = llm.llm_engine.executor.driver_worker
    assert worker.cache_block_size_bytes() * 4 == f32_block
    assert worker.model_runner.direct_forward is not None
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    worker.model_runner.direct_forward, saved = None, worker.model_runner.direct_forward
    try:
        module_path = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    finally:
        worker.model_runner.direct_forward = saved
    assert module_path == got
    same, total = teacher_forced(llm, prompts, want)
    assert same / total >= floor, (same, total)


@needs_kernels
def test_fp8_pool_survives_swap_preemption_and_copy_on_write():
    """A pool too small for the batch preempts by swapping (fp8 blocks out to the CPU swap pool and back), and
    seeded parallel sampling (n=2) shares its prompt's blocks, then copies the last one on write: every output
    equals that of a pool large enough for all of it."""
    from pagedllm import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    sampled = SamplingParams(n=2, max_tokens=30, temperature=0.8, seed=11, ignore_eos=True)
    params = [greedy] * len(PROMPTS) + [sampled, sampled]
    prompts = PROMPTS + PROMPTS[:2]

    def run(**kw):
        # At most 8 rows a decode step: the float32 GEMM's native row limit on every build (portable: 8), whose rows
        # have the same bits in any batch, so preemption cannot change a token through the batch it runs in.
        llm = LLM(quantization="none", kv_cache_dtype="fp8", max_model_len=256, max_num_seqs=8, **kw)
        outs = [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
        return outs, llm.llm_engine.stats()

    want, _ = run(num_gpu_blocks_override=128)
    got, stats = run(num_gpu_blocks_override=14, preemption_mode="swap", swap_space=0.05)
    assert got == want
    assert stats["num_swap_preemptions"] > 0 and stats["num_swapped_out_blocks"] > 0, stats
    assert stats["num_cow_copies"] > 0, stats
    assert all(len(o) == 2 for o in want[-2:])


@needs_kernels
def test_a_bfloat16_model_on_an_fp8_pool():
    """A bfloat16 model's q/k/v are widened for the kernels, which also take its long prompt chunks on an fp8 pool
    (torch's SDPA would read the pool unscaled): its greedy continuations stay those of the bf16 pool at most
    positions (teacher-forced)."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.fp8_accuracy import teacher_forced

    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = PROMPTS[:4] + [" ".join(["The quick brown fox jumps over the lazy dog."] * 12)]  # a long chunk
    bf16 = LLM(dtype="bfloat16", max_model_len=512, num_gpu_blocks_override=64)
    outs = bf16.generate(prompts, sp, use_tqdm=False)
    ids = [list(o.prompt_token_ids) for o in outs]
    want = [list(o.outputs[0].token_ids) for o in outs]
    assert len(ids[-1]) >= cpu_kernels.TILE_MIN_QUERY_LEN  # on a bf16 pool this chunk would take torch's SDPA
    del bf16
    llm = LLM(dtype="bfloat16", kv_cache_dtype="fp8", max_model_len=512, num_gpu_blocks_override=64)
    backend = llm.llm_engine.executor.driver_worker.model_runner.attn_backend
    assert backend.fp8_pool and backend.max_native_query_len >= 1 << 30
    same, total = teacher_forced(llm, ids, want)
    assert same / total >= 0.85, (same, total)


@needs_kernels
def test_speculation_on_an_fp8_pool_keeps_greedy_outputs():
    """Verification rows take the kernel's token path over the fp8 pool like decodes do, and rejected drafts'
    slots are rewritten: n-gram speculation on and off give the same greedy tokens, and no block leaks."""
    from pagedllm import LLM, SamplingParams

    prompts = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "one two three four one two three four one two",
               "The cat sat on the mat. The cat sat on the", "x = [1, 2, 3]\nx = [1, 2, 3]\nx = ["]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = {}
    for on in (False, True):
        spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
        llm = LLM(quantization="none", kv_cache_dtype="fp8", max_model_len=256, num_gpu_blocks_override=64,
                  speculative_config=spec if on else None)
        outs[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        bm = llm.llm_engine.scheduler.block_manager
        assert bm.get_num_free_gpu_blocks() == bm.num_gpu_blocks
        if on:
            assert llm.llm_engine.stats()["spec_decode_num_accepted_tokens"] > 0
    assert outs[True] == outs[False]
