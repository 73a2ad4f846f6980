"""Sliding-window attention and attention-logit soft-capping in the Triton kernels (decode, prefill, unified),
against a float32 reference computed here with Hugging Face transformers' semantics: a token at position p sees keys
p - W < j <= p, and each score s = q·k·scale becomes c·tanh(s / c) before the softmax.

Compiled on CUDA (bf16, long contexts, the window sizes of Mistral, Phi-3 and Gemma), under Triton's interpreter on
CPU at small sizes in float32 / float16 (tests/triton_setup.py). Keys no query may see are poisoned with NaN after
the reference is taken: a kernel that read one, in a skipped block or a partly covered tile, would return NaN.
"""
from __future__ import annotations

import inspect
import random

import pytest
import torch

from triton_setup import (DEVICE, ON_CUDA, interpreter_numpy_shim,  # sets TRITON_INTERPRET without CUDA
                          row_invariant_interpreter_dot)

triton = pytest.importorskip("triton")
interpreter_numpy_shim()
# The interpreter also computes the rows a kernel never stores (padding rows past a chunk, which with a window
# may see no key: 0 / 0), and a capped score's exp(2x) may overflow to inf (as meant: tanh is then 1); numpy warns.
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")]

from pagedllm.kernels import kv_quant, reference, triton_attention  # noqa: E402
from pagedllm.kernels.triton_unified_attention import unified_attention  # noqa: E402
from test_triton_kernels import _TOL, _make_batch, _padded_layout, _rel_err  # noqa: E402

_DTYPES = [torch.float32, torch.bfloat16] if ON_CUDA else [torch.float32, torch.float16]


def _reference(query, key_cache, value_cache, meta, scale, window=None, cap=None, k_scale=1.0, v_scale=1.0,
               sinks=None):
    """Float32 attention of every query row of `meta`'s sequences over their cached keys, read through the block
    tables (an FP8 cache as fp8 · k_scale / v_scale), with `window`, soft cap `cap` and each head's sink logit in its
    softmax (`sinks` [Hq]; None: off)."""
    q = query.float()
    kc, vc = key_cache.float() * k_scale, value_cache.float() * v_scale
    bs, hk = kc.shape[1], kc.shape[2]
    hq = q.shape[1]
    group = hq // hk
    out = torch.zeros_like(q)
    for i in range(meta.num_seqs):
        start, end = int(meta.query_start_loc[i]), int(meta.query_start_loc[i + 1])
        n = meta.seq_lens_cpu[i]
        pos = torch.arange(n, device=q.device)
        blocks = meta.block_tables[i].long()[pos // bs]
        k = kc[blocks, pos % bs].repeat_interleave(group, 1)  # [n, Hq, D]
        v = vc[blocks, pos % bs].repeat_interleave(group, 1)
        s = torch.einsum("thd,nhd->htn", q[start:end], k) * scale
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        q_pos = n - (end - start) + torch.arange(end - start, device=q.device)
        visible = pos[None, :] <= q_pos[:, None]
        if window is not None:
            visible &= pos[None, :] > q_pos[:, None] - window
        s = s.masked_fill(~visible, float("-inf"))
        if sinks is None:
            p = torch.softmax(s, dim=-1)
        else:  # the sink's column joins the softmax, then is dropped: it weighs no value
            sink = sinks.float().view(hq, 1, 1).expand(hq, end - start, 1)
            p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :n]
        out[start:end] = torch.einsum("htn,nhd->thd", p, v)
    return out


def _poison_invisible_keys(key_cache, value_cache, meta, window) -> None:
    """NaN into every cached key and value that no query row of its sequence sees (before the window of the
    sequence's first query row), whether its block is wholly before the window or partly inside it."""
    bs = key_cache.shape[1]
    fp8 = key_cache.element_size() == 1
    for i in range(meta.num_seqs):
        n, q_len = meta.seq_lens_cpu[i], meta.query_lens_cpu[i]
        for j in range(max(0, n - q_len - window + 1)):
            blk = int(meta.block_tables[i, j // bs])
            for cache in (key_cache, value_cache):
                if fp8:  # 0x7F is NaN in e4m3fn and e5m2; CPU tensors of fp8 take no index_put
                    cache.view(torch.uint8)[blk, j % bs] = 0x7F
                else:
                    cache[blk, j % bs] = float("nan")


def _batch(seed, dtype, seq_lens, query_lens, block_size=16, head_dim=64, group=4, q_gain=1.0):
    query, kc, vc, meta = _make_batch(random.Random(seed), dtype, block_size, head_dim, 2, group, seq_lens, query_lens)
    return (query.float() * q_gain).to(dtype), kc, vc, meta


def test_reference_without_window_or_cap_is_the_repos_reference():
    """The test's own reference agrees with kernels/reference.py where both apply (no window, no cap) and, once the
    reference takes `sliding_window` / `logits_soft_cap`, with it there too."""
    query, kc, vc, meta = _batch(1, torch.float32, [5, 40, 23 + 30], [1, 1, 23])
    scale = 0.125

    def repo(**kw):
        fresh = torch.zeros(query.shape[0], *kc.shape[2:], device=DEVICE)  # only chunks without context read it
        return reference.paged_attention(query, fresh, fresh, kc, vc, meta, scale, **kw)

    assert _rel_err(_reference(query, kc, vc, meta, scale), repo()) < 1e-6
    if "sliding_window" in inspect.signature(reference.paged_attention).parameters:
        for window, cap in ((7, None), (None, 2.0), (20, 2.0)):
            ours = _reference(query, kc, vc, meta, scale, window, cap)
            assert _rel_err(ours, repo(sliding_window=window, logits_soft_cap=cap)) < 1e-5


# Windows: one key, less than a block, one block, not a multiple of the block, longer than any context.
_WINDOWS = [1, 5, 16, 37, 4000]


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("window", _WINDOWS)
def test_decode_window_matches_reference_and_never_reads_before_it(window, num_splits):
    """Split-KV decode over 16-key tiles: the splits share out the window's span only (several splits, some empty)."""
    seq_lens = [3, 16, 17, 77, 50] if not ON_CUDA else [3, 16, 17, 77, 500, 1300]
    query, kc, vc, meta = _batch(10 + window, torch.float32, seq_lens, [1] * len(seq_lens))
    ref = _reference(query, kc, vc, meta, 0.125, window)
    _poison_invisible_keys(kc, vc, meta, window)
    ws = triton_attention.DecodeWorkspace.allocate(DEVICE)
    for reduce in ("fused", "separate"):
        out = torch.full_like(query, float("nan"))
        triton_attention.paged_decode_attention(query, kc, vc, meta.block_tables, meta.seq_lens, 0.125,
                                                max(seq_lens), out=out, num_splits=num_splits, tile=16,
                                                reduce=reduce, workspace=ws, sliding_window=window)
        assert not out.isnan().any(), reduce
        assert _rel_err(out, ref) < _TOL[torch.float32], reduce
    assert not ws.counters.any()


@pytest.mark.parametrize("preload_table", [True, False])
def test_decode_window_with_default_launch(preload_table):
    """The default tile and split count (bounded by the window's span, not the context), with and without the
    block-table row loaded up front."""
    seq_lens = [90, 33, 64] if not ON_CUDA else [900, 33, 4100]
    query, kc, vc, meta = _batch(3, torch.float32, seq_lens, [1] * len(seq_lens))
    ref = _reference(query, kc, vc, meta, 0.125, 21)
    _poison_invisible_keys(kc, vc, meta, 21)
    out = triton_attention.paged_decode_attention(query, kc, vc, meta.block_tables, meta.seq_lens, 0.125,
                                                  max(seq_lens), preload_table=preload_table, sliding_window=21)
    assert _rel_err(out, ref) < _TOL[torch.float32]


def test_window_bounds_the_split_count():
    """A window shorter than the context: as many splits as its span needs, however long the sequences may be."""
    dev = torch.device(DEVICE)
    full = triton_attention.choose_num_splits(1, 2, 1 << 15, 64, dev)
    windowed = triton_attention.choose_num_splits(1, 2, 100 + 16 - 1, 64, dev)
    assert windowed == 2 < full  # what paged_decode_attention asks for at window 100, blocks of 16


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("window,cap", [(None, 2.0), (9, None), (9, 2.0), (37, 30.0)])
def test_decode_soft_cap_and_window(dtype, window, cap):
    """Scores of spread ~4 against caps of 2 (most of them capped) and 30 (few), with GQA, two splits."""
    seq_lens = [3, 77, 50, 20] if not ON_CUDA else [3, 77, 700, 2100]
    query, kc, vc, meta = _batch(20, dtype, seq_lens, [1] * len(seq_lens), q_gain=4.0)
    ref = _reference(query, kc, vc, meta, 0.125, window, cap)
    if cap == 2.0:  # the cap changes the result: the test sees it
        assert _rel_err(ref, _reference(query, kc, vc, meta, 0.125, window)) > 0.05
    if window is not None:
        _poison_invisible_keys(kc, vc, meta, window)
    out = triton_attention.paged_decode_attention(query, kc, vc, meta.block_tables, meta.seq_lens, 0.125,
                                                  max(seq_lens), num_splits=2, sliding_window=window,
                                                  logits_soft_cap=cap)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < _TOL[dtype]


def test_soft_cap_saturates_huge_scores_without_nan():
    """Scores thousands of times the cap (exp(2x) overflows to inf, or underflows to 0) become ±cap exactly."""
    query, kc, vc, meta = _batch(25, torch.float32, [40, 9 + 12], [1, 12], q_gain=1000.0)
    ref = _reference(query, kc, vc, meta, 0.125, None, 1.0)
    out = triton_attention.paged_attention(query, kc, vc, meta, 0.125, logits_soft_cap=1.0)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < _TOL[torch.float32]


def _prefill_step(block_size: int) -> tuple[list[int], list[int]]:
    """(seq_lens, query_lens): a fresh prompt, chunks after some and after many blocks of context."""
    chunks, ctx = ([45, 20, 70], [0, 30, 3 * block_size + 5]) if not ON_CUDA else ([300, 1100, 77], [0, 700, 3000])
    return [q + c for q, c in zip(chunks, ctx)], chunks


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("window,cap", [(3, None), (16, None), (37, None), (None, 2.0), (20, 2.0)])
def test_prefill_chunks_with_window_and_cap(dtype, window, cap):
    """Chunks with and without cached context: a window shorter than a tile of rows leaves the later rows of a
    tile nothing to see in its first key tiles; GQA (four query heads per KV head)."""
    seq_lens, query_lens = _prefill_step(16)
    query, kc, vc, meta = _batch(30, dtype, seq_lens, query_lens, q_gain=4.0 if cap else 1.0)
    ref = _reference(query, kc, vc, meta, 0.125, window, cap)
    if window is not None:
        _poison_invisible_keys(kc, vc, meta, window)
    out = torch.full_like(query, float("nan"))
    triton_attention.paged_attention(query, kc, vc, meta, 0.125, out=out, sliding_window=window,
                                     logits_soft_cap=cap)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < _TOL[dtype]


@pytest.mark.parametrize("block_size,head_dim,group", [(16, 64, 4), (8, 64, 3), (32, 128, 1)])
@pytest.mark.parametrize("window,cap", [(5, None), (29, 2.0), (None, 2.0)])
def test_unified_mixed_step_with_window_and_cap(block_size, head_dim, group, window, cap):
    """Decodes and chunks in one launch with padding rows and sequences (as a whole-step graph replays it)."""
    rng = random.Random(block_size + head_dim + group)
    long = 90 if not ON_CUDA else 3000
    seq_lens = [rng.randint(1, 40), rng.randint(41, long), 1, rng.randint(2, long)]
    chunks, ctx = [rng.randint(2, 40), rng.randint(17, 40)], [0, rng.randint(block_size, 70)]
    seq_lens += [q + c for q, c in zip(chunks, ctx)]
    query_lens = [1, 1, 1, 1] + chunks
    dtype = torch.float32
    query, kc, vc, meta = _make_batch(rng, dtype, block_size, head_dim, 2, group, seq_lens, query_lens)
    query = query * 4.0 if cap else query
    ref = _reference(query, kc, vc, meta, head_dim**-0.5, window, cap)
    if window is not None:
        _poison_invisible_keys(kc, vc, meta, window)
    t = query.shape[0]
    padded_q = torch.cat([query, torch.randn(13, *query.shape[1:], device=DEVICE).to(dtype)])
    bt, lens, qsl = _padded_layout(meta, t + 13, max_seqs=12)
    out = torch.full_like(padded_q, float("nan"))
    unified_attention(padded_q, kc, vc, bt, lens, qsl, head_dim**-0.5, out, sliding_window=window,
                      logits_soft_cap=cap)
    assert not out[:t].isnan().any()
    assert out[t:].isnan().all()  # padding rows: never written
    assert _rel_err(out[:t], ref) < _TOL[dtype]


def test_unified_window_gives_each_token_of_a_chunk_its_lone_bits(monkeypatch):
    """Batch invariance (the unified kernel serves VLLM_BATCH_INVARIANT=1): with a window and a cap, every token of
    a 40-token chunk after 22 cached tokens gets the bits it gets alone (as a decode over the same keys), though
    its query tile, and so where that tile's key loop starts, differs."""
    row_invariant_interpreter_dot(monkeypatch)
    ctx, chunk, window, cap = 22, 40, 20, 3.0  # some query tiles start in another key block than their rows
    query, kc, vc, meta = _batch(90, torch.float32, [ctx + chunk], [chunk], q_gain=4.0)
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    out = unified_attention(query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125,
                            torch.empty_like(query), **kw)
    one = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    for i in range(chunk):
        alone = unified_attention(query[i:i + 1], kc, vc, meta.block_tables, meta.seq_lens * 0 + ctx + i + 1, one,
                                  0.125, torch.empty_like(query[:1]), **kw)
        assert torch.equal(alone, out[i:i + 1]), i


@pytest.mark.parametrize("kernel", ["paged", "unified"])
@pytest.mark.parametrize("window", [7, 40])
def test_fp8_pool_with_window(kernel, window):
    """An e4m3 pool with its scales: decodes (split) and chunks see their window of fp8 · scale."""
    qdtype = torch.bfloat16 if ON_CUDA else torch.float32
    seq_lens, query_lens = [60, 9, 33 + 25, 12], [1, 1, 25, 12]
    query, kc, vc, meta = _batch(40 + window, qdtype, seq_lens, query_lens)
    k_scale, v_scale = 0.02, 0.03
    kq, vq = kv_quant.quantize(kc, torch.float8_e4m3fn, k_scale), kv_quant.quantize(vc, torch.float8_e4m3fn, v_scale)
    ref = _reference(query, kq, vq, meta, 0.125, window, k_scale=k_scale, v_scale=v_scale)
    _poison_invisible_keys(kq, vq, meta, window)  # NaN in e4m3
    out = torch.full_like(query, float("nan"))
    if kernel == "paged":
        triton_attention.paged_attention(query, kq, vq, meta, 0.125, out=out, k_scale=k_scale, v_scale=v_scale,
                                         sliding_window=window)
    else:
        unified_attention(query, kq, vq, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125, out,
                          k_scale, v_scale, sliding_window=window)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < (1.5e-2 if qdtype == torch.bfloat16 else 1e-4)


def test_backend_hands_window_and_cap_to_both_paths():
    """TritonAttentionBackend.forward (what Attention layers call) through the decode / prefill kernels and, for
    steps marked unified, the unified kernel: the same attention."""
    from pagedllm.model.layers.attention import TritonAttentionBackend

    query, kc, vc, meta = _batch(50, torch.float32, [70, 20 + 30], [1, 20], q_gain=4.0)
    ref = _reference(query, kc, vc, meta, 0.125, 24, 3.0)
    no_tokens = torch.empty(0, 2, 64, device=DEVICE)  # nothing to cache: K/V are already in kc / vc
    backend = TritonAttentionBackend()
    for unified in (False, True):
        meta.unified = unified
        out = backend.forward(query, no_tokens, no_tokens, (kc, vc), meta, 0.125, sliding_window=24,
                              logits_soft_cap=3.0)
        assert _rel_err(out, ref) < _TOL[torch.float32], unified


def test_bad_window_or_cap_is_a_value_error():
    query, kc, vc, meta = _batch(60, torch.float32, [10], [1])
    decode = dict(query=query, key_cache=kc, value_cache=vc, block_tables=meta.block_tables, seq_lens=meta.seq_lens,
                  scale=0.125, max_seq_len=10)
    with pytest.raises(ValueError, match="sliding_window"):
        triton_attention.paged_decode_attention(**decode, sliding_window=0)
    with pytest.raises(ValueError, match="sliding_window"):
        triton_attention.paged_decode_attention(**decode, sliding_window=4.5)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        triton_attention.paged_attention(query, kc, vc, meta, 0.125, logits_soft_cap=-1.0)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        unified_attention(query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125,
                          torch.empty_like(query), logits_soft_cap=0.0)


def test_warm_up_runs_every_window_and_cap_variant_of_the_model():
    """The warm start runs each (window, cap) combination of the model's layers through every decode split count
    and the mixed steps; a model without windows or caps runs the plain variants only, as before."""
    from torch import nn

    from pagedllm.kernels.triton_warmup import WARMUP_NUM_DECODES, WARMUP_SPLITS, attention_variants, warm_up_attention
    from pagedllm.model.layers.attention import Attention, TritonAttentionBackend

    gemma2 = nn.ModuleList([Attention(4, 32, 2, sliding_window=4096 if i % 2 == 0 else None, logits_soft_cap=50.0)
                            for i in range(4)])
    gemma3 = nn.ModuleList([Attention(4, 32, 2, sliding_window=None if i % 6 == 5 else 512) for i in range(12)])
    assert attention_variants(gemma2) == [(4096, 50.0), (None, 50.0)]
    assert attention_variants(gemma3) == [(512, None), (None, None)]
    assert attention_variants(nn.ModuleList([Attention(4, 32, 2)])) == [(None, None)]

    rows, kv_heads, head_dim = 16, 2, 32
    q = torch.zeros(rows, 2 * kv_heads, head_dim, device=DEVICE)
    k = torch.zeros(rows, kv_heads, head_dim, device=DEVICE)
    cache = (torch.zeros(4, 8, kv_heads, head_dim, device=DEVICE), torch.zeros(4, 8, kv_heads, head_dim, device=DEVICE))
    plain = warm_up_attention(TritonAttentionBackend(), cache, q, k, k.clone(), torch.zeros_like(q), 2, 0.125)
    done = warm_up_attention(TritonAttentionBackend(), cache, q, k, k.clone(), torch.zeros_like(q), 2, 0.125,
                             variants=attention_variants(gemma2))
    per_variant = len(WARMUP_SPLITS) + len(WARMUP_NUM_DECODES)
    assert len(plain) == per_variant and len(done) == 2 * per_variant
    assert sum("window" in d and "cap" in d for d in done) == per_variant
    assert sum("window" not in d and "cap" in d for d in done) == per_variant


# Long contexts at the window sizes of real models: compiled kernels only.
_MODEL_WINDOWS = [(4096, None), (2047, None), (1024, None), (4096, 50.0), (None, 50.0), (512, 50.0)]


@pytest.mark.cuda
@pytest.mark.parametrize("window,cap", _MODEL_WINDOWS)
def test_long_contexts_at_model_windows_on_cuda(window, cap):
    """bf16, head_dim 128, four query heads per KV head, blocks of 16: decodes of up to 8 200 tokens through the
    default split-KV launch, chunks of 1 100 tokens after 3 000 of context, and the same step through the unified
    kernel, with Mistral's (4096), Phi-3's (2047), Gemma 3's (1024, 512) windows and Gemma 2's cap (50)."""
    dtype, scale = torch.bfloat16, 128**-0.5
    seq_lens = [8200, 4097, 4095, 1500, 300, 5000 + 3000, 1100 + 3000, 700]
    query_lens = [1, 1, 1, 1, 1, 5000, 1100, 700]
    query, kc, vc, meta = _batch(70, dtype, seq_lens, query_lens, head_dim=128, q_gain=3.0)
    ref = _reference(query, kc, vc, meta, scale, window, cap)
    if window is not None:
        _poison_invisible_keys(kc, vc, meta, window)
    out = torch.full_like(query, float("nan"))
    triton_attention.paged_attention(query, kc, vc, meta, scale, out=out, sliding_window=window, logits_soft_cap=cap)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < _TOL[dtype]
    out = torch.full_like(query, float("nan"))
    unified_attention(query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, out,
                      sliding_window=window, logits_soft_cap=cap)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < _TOL[dtype]


@pytest.mark.cuda
def test_windowed_decode_replays_in_a_cuda_graph():
    """A captured windowed, capped decode replays the same attention for new sequence lengths (no host sync)."""
    dtype, scale, window, cap = torch.bfloat16, 128**-0.5, 1024, 50.0
    seq_lens = [3000, 700, 2100, 64]
    query, kc, vc, meta = _batch(80, dtype, seq_lens, [1] * 4, head_dim=128)
    out = torch.empty_like(query)
    ws = triton_attention.DecodeWorkspace.allocate(DEVICE)

    def run() -> None:
        triton_attention.paged_decode_attention(query, kc, vc, meta.block_tables, meta.seq_lens, scale, 4096,
                                                out=out, workspace=ws, sliding_window=window, logits_soft_cap=cap)

    run()  # sizes the workspace before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for lens in ([3000, 700, 2100, 64], [3010, 1500, 1025, 2]):
        meta.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        meta.seq_lens_cpu = lens
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(out, _reference(query, kc, vc, meta, scale, window, cap)) < _TOL[dtype]
