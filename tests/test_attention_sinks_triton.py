"""Attention sinks (GPT-OSS) in the Triton kernels (decode with its split-KV merges, prefill, unified), against a
float32 reference computed here: head h's softmax has one more logit, sinks[h], in its denominator, weighing no value
(o = Σ exp(s_j - m) v_j / (Σ exp(s_j - m) + exp(sinks[h] - m)), m = max(max_j s_j, sinks[h])).

Compiled on CUDA (bf16, long contexts, GPT-OSS's 128-token window), under Triton's interpreter on CPU at small sizes
in float32 / float16 (tests/triton_setup.py). The sink must enter each head's denominator exactly once: the decode's
split counts (one, several, more than the context has tiles) and both reduce modes are each compared with the
reference, as are sinks far above every score (outputs near 0) and far below (the plain softmax).
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from triton_setup import DEVICE, ON_CUDA, interpreter_numpy_shim  # sets TRITON_INTERPRET without CUDA

triton = pytest.importorskip("triton")
interpreter_numpy_shim()
# The interpreter also computes the rows a kernel never stores (padding rows: 0 / 0, a sink's exp2 past the float
# range); numpy warns.
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")]

from pagedllm.kernels import kv_quant, reference, triton_attention  # noqa: E402
from pagedllm.kernels.triton_unified_attention import unified_attention  # noqa: E402
from test_sliding_window_triton import _batch, _poison_invisible_keys  # noqa: E402
from test_sliding_window_triton import _reference as _window_reference  # noqa: E402
from test_triton_kernels import _TOL, _make_batch, _padded_layout, _rel_err  # noqa: E402

_DTYPES = [torch.float32, torch.bfloat16] if ON_CUDA else [torch.float32, torch.float16]
_SCALE = 0.125


def _reference(query, key_cache, value_cache, meta, scale, sinks=None, window=None, cap=None, k_scale=1.0,
               v_scale=1.0):
    """test_sliding_window_triton's float32 reference, with each head's sink logit in its softmax (`sinks` [Hq])."""
    return _window_reference(query, key_cache, value_cache, meta, scale, window, cap, k_scale, v_scale, sinks=sinks)


def _sinks(num_heads: int, seed: int, spread: float = 2.0) -> torch.Tensor:
    """Sink logits of the size of the scores (GPT-OSS's learned sinks lie within a few units of them)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_heads, generator=g) * spread).to(DEVICE)


def test_reference_agrees_with_the_repos_references():
    """The test's reference with sinks is kernels/reference.py's (paged_attention: gathered SDPA-style batches and
    direct prompt chunks; paged_attention_naive: token by token), with and without a window."""
    query, kc, vc, meta = _batch(1, torch.float32, [5, 40, 23 + 30, 19], [1, 1, 23, 19])
    sinks = _sinks(8, 1)
    # the chunk without cached context (the last) reads this step's fresh K/V: the cache's rows for it
    last = meta.block_tables[3].long()
    key = torch.zeros(query.shape[0], *kc.shape[2:], device=DEVICE)
    value = torch.zeros_like(key)
    pos = torch.arange(19, device=DEVICE)
    start = int(meta.query_start_loc[3])
    key[start:] = kc[last[pos // 16], pos % 16]
    value[start:] = vc[last[pos // 16], pos % 16]
    for window in (None, 7):
        ours = _reference(query, kc, vc, meta, _SCALE, sinks, window)
        assert _rel_err(ours, reference.paged_attention(query, key, value, kc, vc, meta, _SCALE,
                                                        sliding_window=window, sinks=sinks)) < 1e-5
        naive = reference.paged_attention_naive(query, kc, vc, meta.block_tables.tolist(), meta.seq_lens_cpu,
                                                meta.query_lens_cpu, _SCALE, sliding_window=window, sinks=sinks)
        assert _rel_err(ours, naive) < 1e-5
    assert _rel_err(_reference(query, kc, vc, meta, _SCALE, sinks), _reference(query, kc, vc, meta, _SCALE)) > 0.05


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_decode_sinks_enter_once_whatever_the_split_count(num_splits):
    """Split-KV decode over 16-key tiles, GQA (four query heads per KV head): one split (the sink in the kernel's
    normalisation), several (in the merge: fused and separate), more splits than a short context has tiles (empty
    splits: their partials hold no keys, and the sink still counts once)."""
    seq_lens = [3, 16, 17, 77, 50] if not ON_CUDA else [3, 16, 17, 77, 500, 1300]
    query, kc, vc, meta = _batch(10 + num_splits, torch.float32, seq_lens, [1] * len(seq_lens))
    sinks = _sinks(8, num_splits)
    ref = _reference(query, kc, vc, meta, _SCALE, sinks)
    ws = triton_attention.DecodeWorkspace.allocate(DEVICE)
    for reduce in ("fused", "separate"):
        out = torch.full_like(query, float("nan"))
        triton_attention.paged_decode_attention(query, kc, vc, meta.block_tables, meta.seq_lens, _SCALE,
                                                max(seq_lens), out=out, num_splits=num_splits, tile=16,
                                                reduce=reduce, workspace=ws, sinks=sinks)
        assert not out.isnan().any(), reduce
        assert _rel_err(out, ref) < _TOL[torch.float32], reduce
    assert not ws.counters.any()


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("preload_table", [True, False])
def test_decode_sinks_with_default_launch(dtype, preload_table):
    """The default tile and split count, with and without the block-table row loaded up front, in 16-bit too."""
    seq_lens = [90, 33, 64] if not ON_CUDA else [900, 33, 4100]
    query, kc, vc, meta = _batch(3, dtype, seq_lens, [1] * len(seq_lens))
    sinks = _sinks(8, 3)
    out = triton_attention.paged_decode_attention(query, kc, vc, meta.block_tables, meta.seq_lens, _SCALE,
                                                  max(seq_lens), preload_table=preload_table, sinks=sinks)
    assert _rel_err(out, _reference(query, kc, vc, meta, _SCALE, sinks)) < _TOL[dtype]


def _prefill_step(block_size: int = 16) -> tuple[list[int], list[int]]:
    """(seq_lens, query_lens): a fresh prompt, chunks after some and after many blocks of context."""
    chunks, ctx = ([45, 20, 70], [0, 30, 3 * block_size + 5]) if not ON_CUDA else ([300, 1100, 77], [0, 700, 3000])
    return [q + c for q, c in zip(chunks, ctx)], chunks


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_prefill_chunks_with_sinks(dtype):
    """Prefill chunks with and without cached context (several query tiles each), GQA, through the prefill kernel
    alone (first_seq 0)."""
    seq_lens, query_lens = _prefill_step()
    query, kc, vc, meta = _batch(30, dtype, seq_lens, query_lens)
    sinks = _sinks(8, 30)
    out = torch.full_like(query, float("nan"))
    triton_attention.paged_prefill_attention(query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                             _SCALE, 0, meta.num_seqs, max(query_lens), out, sinks=sinks)
    assert not out.isnan().any()
    assert _rel_err(out, _reference(query, kc, vc, meta, _SCALE, sinks)) < _TOL[dtype]


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 5, 37])
def test_mixed_batch_with_sinks_and_window(dtype, window):
    """Decodes (split) then chunks with and without context through ``paged_attention``, alone and with sliding
    windows (GPT-OSS's sliding layers have sinks too); keys outside every window are poisoned with NaN."""
    seq_lens = [60, 9, 33 + 25, 12, 40 + 30] if not ON_CUDA else [2000, 9, 1033 + 250, 120, 40 + 700]
    query_lens = [1, 1, 25, 12, 30] if not ON_CUDA else [1, 1, 250, 120, 700]
    query, kc, vc, meta = _batch(40 + (window or 0), dtype, seq_lens, query_lens)
    sinks = _sinks(8, 40)
    ref = _reference(query, kc, vc, meta, _SCALE, sinks, window)
    if window is not None:
        _poison_invisible_keys(kc, vc, meta, window)
    out = torch.full_like(query, float("nan"))
    triton_attention.paged_attention(query, kc, vc, meta, _SCALE, out=out, sliding_window=window, sinks=sinks)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < _TOL[dtype]


@pytest.mark.parametrize("block_size,head_dim,group", [(16, 64, 4), (8, 64, 3), (32, 128, 1)])
@pytest.mark.parametrize("window,cap", [(None, None), (5, None), (29, 2.0)])
def test_unified_mixed_step_with_sinks(block_size, head_dim, group, window, cap):
    """Decodes and chunks in one launch with padding rows and sequences (as a whole-step graph replays it); a group
    of three leaves a padding row per token in each tile (its head past the layer's: no sink loaded for it)."""
    rng = random.Random(block_size + head_dim + group)
    long = 90 if not ON_CUDA else 3000
    seq_lens = [rng.randint(1, 40), rng.randint(41, long), 1, rng.randint(2, long)]
    chunks, ctx = [rng.randint(2, 40), rng.randint(17, 40)], [0, rng.randint(block_size, 70)]
    seq_lens += [q + c for q, c in zip(chunks, ctx)]
    query_lens = [1, 1, 1, 1] + chunks
    query, kc, vc, meta = _make_batch(rng, torch.float32, block_size, head_dim, 2, group, seq_lens, query_lens)
    query = query * 4.0 if cap else query
    sinks = _sinks(2 * group, block_size + group)
    ref = _reference(query, kc, vc, meta, head_dim**-0.5, sinks, window, cap)
    if window is not None:
        _poison_invisible_keys(kc, vc, meta, window)
    t = query.shape[0]
    padded_q = torch.cat([query, torch.randn(13, *query.shape[1:], device=DEVICE)])
    bt, lens, qsl = _padded_layout(meta, t + 13, max_seqs=12)
    out = torch.full_like(padded_q, float("nan"))
    unified_attention(padded_q, kc, vc, bt, lens, qsl, head_dim**-0.5, out, sliding_window=window,
                      logits_soft_cap=cap, sinks=sinks)
    assert not out[:t].isnan().any()
    assert out[t:].isnan().all()  # padding rows: never written
    assert _rel_err(out[:t], ref) < _TOL[torch.float32]


# Per head (two KV heads of four): -inf (the plain softmax), far below every score, near the scores, far above them
# (outputs ~e^-30 of the values), past float32's exp range relative to the scores (outputs 0).
_EXTREME_SINKS = [float("-inf"), -1.0e4, -30.0, 0.0, 1.5, 8.0, 30.0, 200.0]


@pytest.mark.parametrize("kernel", ["decode-1", "decode-fused", "decode-separate", "prefill", "unified"])
def test_extreme_sink_values(kernel):
    """Sinks far above the scores shrink each output towards 0 (exactly 0 past float32's range, never NaN); far
    below them (down to -inf) the softmax is the plain one (the kernel's own without sinks)."""
    decode = kernel.startswith("decode")
    seq_lens, query_lens = ([40, 7, 70], [1, 1, 1]) if decode else ([25, 30 + 20], [25, 20])
    query, kc, vc, meta = _batch(50, torch.float32, seq_lens, query_lens)
    sinks = torch.tensor(_EXTREME_SINKS, device=DEVICE)

    def run(s):
        out = torch.full_like(query, float("nan"))
        if decode:
            splits, reduce = (1, "fused") if kernel == "decode-1" else (3, kernel.split("-")[1])
            triton_attention.paged_decode_attention(query, kc, vc, meta.block_tables, meta.seq_lens, _SCALE,
                                                    max(seq_lens), out=out, num_splits=splits, tile=16,
                                                    reduce=reduce, sinks=s)
        elif kernel == "prefill":
            triton_attention.paged_attention(query, kc, vc, meta, _SCALE, out=out, sinks=s)
        else:
            unified_attention(query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, _SCALE, out,
                              sinks=s)
        return out

    out, plain = run(sinks), run(None)
    ref = _reference(query, kc, vc, meta, _SCALE, sinks)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-6)
    assert torch.equal(out[:, 7], torch.zeros_like(out[:, 7]))  # sink 200: e^-200 of the values is below float32
    assert 0 < out[:, 6].abs().max() < 1e-9  # sink 30: small, not flushed
    assert _rel_err(out[:, :2], plain[:, :2]) < 1e-6  # -inf and -1e4: the plain softmax
    assert _rel_err(out[:, 2:6], plain[:, 2:6]) > 1e-3  # the sinks near the scores change the result


@pytest.mark.parametrize("kernel", ["paged", "unified"])
def test_fp8_pool_with_sinks(kernel):
    """An e4m3 pool with its scales: the sink is a logit of the natural scale, not multiplied by k_scale (which the
    kernels fold into the scores' scale)."""
    qdtype = torch.bfloat16 if ON_CUDA else torch.float32
    seq_lens, query_lens = [60, 9, 33 + 25, 12], [1, 1, 25, 12]
    query, kc, vc, meta = _batch(60, qdtype, seq_lens, query_lens)
    k_scale, v_scale = 0.02, 0.03
    kq, vq = kv_quant.quantize(kc, torch.float8_e4m3fn, k_scale), kv_quant.quantize(vc, torch.float8_e4m3fn, v_scale)
    sinks = _sinks(8, 60)
    ref = _reference(query, kq, vq, meta, _SCALE, sinks, k_scale=k_scale, v_scale=v_scale)
    out = torch.full_like(query, float("nan"))
    if kernel == "paged":
        triton_attention.paged_attention(query, kq, vq, meta, _SCALE, out=out, k_scale=k_scale, v_scale=v_scale,
                                         sinks=sinks)
    else:
        unified_attention(query, kq, vq, meta.block_tables, meta.seq_lens, meta.query_start_loc, _SCALE, out,
                          k_scale, v_scale, sinks=sinks)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < (1.5e-2 if qdtype == torch.bfloat16 else 1e-4)


def test_backend_hands_sinks_to_both_paths():
    """TritonAttentionBackend.forward (what Attention layers with sinks call) through the decode / prefill kernels
    and, for steps marked unified, the unified kernel: the same attention."""
    from pagedllm.model.layers.attention import TritonAttentionBackend

    query, kc, vc, meta = _batch(70, torch.float32, [70, 20 + 30], [1, 20])
    sinks = _sinks(8, 70)
    ref = _reference(query, kc, vc, meta, _SCALE, sinks, 24)
    no_tokens = torch.empty(0, 2, 64, device=DEVICE)  # nothing to cache: K/V are already in kc / vc
    backend = TritonAttentionBackend()
    for unified in (False, True):
        meta.unified = unified
        out = backend.forward(query, no_tokens, no_tokens, (kc, vc), meta, _SCALE, sliding_window=24, sinks=sinks)
        assert _rel_err(out, ref) < _TOL[torch.float32], unified


def test_bad_sinks_are_value_errors():
    """Sinks must be float32 [Hq]; MLA layers (latent_dim) take none."""
    query, kc, vc, meta = _batch(80, torch.float32, [10], [1])
    decode = dict(query=query, key_cache=kc, value_cache=vc, block_tables=meta.block_tables, seq_lens=meta.seq_lens,
                  scale=_SCALE, max_seq_len=10)
    with pytest.raises(ValueError, match="sinks"):
        triton_attention.paged_decode_attention(**decode, sinks=torch.zeros(4, device=DEVICE))
    with pytest.raises(ValueError, match="sinks"):
        triton_attention.paged_decode_attention(**decode, sinks=torch.zeros(8, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="sinks"):
        triton_attention.paged_decode_attention(**decode, sinks=torch.zeros(8, 2, device=DEVICE)[:, 0])
    with pytest.raises(ValueError, match="sinks"):
        unified_attention(query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, _SCALE,
                          torch.empty_like(query), sinks=torch.zeros(1, 8, device=DEVICE))
    pool = torch.zeros(4, 16, 1, 40, device=DEVICE)
    with pytest.raises(ValueError, match="latent_dim"):
        triton_attention.paged_attention(torch.zeros(1, 4, 40, device=DEVICE), pool, pool, meta, 0.1, latent_dim=32,
                                         sinks=torch.zeros(4, device=DEVICE))


def test_warm_up_runs_the_sinks_variants_with_a_sinks_tensor(monkeypatch):
    """GPT-OSS's layers (every one with sinks, every other one sliding) are variants of their own, after the plain
    ones of a model's other layers; the warm start hands a float32 [Hq] sinks tensor to every decode and prefill
    launch of those variants and none to the others."""
    from torch import nn

    from pagedllm.kernels.triton_warmup import WARMUP_NUM_DECODES, WARMUP_SPLITS, attention_variants, warm_up_attention
    from pagedllm.model.layers.attention import Attention, TritonAttentionBackend

    gpt_oss = nn.ModuleList([Attention(4, 32, 2, sliding_window=128 if i % 2 == 0 else None, sinks=True)
                             for i in range(4)])
    assert attention_variants(gpt_oss) == [(128, None, None, True), (None, None, None, True)]
    mixed = nn.ModuleList([Attention(4, 32, 2), Attention(4, 32, 2, sinks=True)])
    assert attention_variants(mixed) == [(None, None), (None, None, None, True)]

    seen = []
    for name in ("paged_decode_attention", "paged_prefill_attention"):
        real = getattr(triton_attention, name)

        def spy(*args, _real=real, _name=name, **kw):
            sinks = kw.get("sinks")
            seen.append((_name, None if sinks is None else (sinks.dtype, tuple(sinks.shape))))
            return _real(*args, **kw)

        monkeypatch.setattr(triton_attention, name, spy)

    rows, kv_heads, head_dim = 16, 2, 32
    q = torch.zeros(rows, 2 * kv_heads, head_dim, device=DEVICE)
    k = torch.zeros(rows, kv_heads, head_dim, device=DEVICE)
    cache = (torch.zeros(4, 8, kv_heads, head_dim, device=DEVICE), torch.zeros(4, 8, kv_heads, head_dim, device=DEVICE))
    done = warm_up_attention(TritonAttentionBackend(), cache, q, k, k.clone(), torch.zeros_like(q), 2, 0.125,
                             variants=attention_variants(mixed))
    per_variant = len(WARMUP_SPLITS) + len(WARMUP_NUM_DECODES)
    assert len(done) == 2 * per_variant
    assert sum(d.endswith(" sinks") for d in done) == per_variant
    with_sinks = [s for _, s in seen if s is not None]
    assert with_sinks and all(s == (torch.float32, (4,)) for s in with_sinks)
    # the sinks variant: every decode split count, and each mixed step's decodes (when it has any) and chunk
    decodes = len(WARMUP_SPLITS) + sum(1 for nd in WARMUP_NUM_DECODES if nd)
    assert len(with_sinks) == decodes + len(WARMUP_NUM_DECODES)
    assert len(seen) == 2 * len(with_sinks)  # and the plain variant, as many launches without


def test_piecewise_capture_records_sinks_and_replays_them(monkeypatch):
    """A piecewise-graph capture records each attention call's sinks (the layer's parameter itself) with its site,
    and a replay hands them to the real backend between the pieces; sites without sinks pass none."""
    from torch import nn

    from pagedllm.worker import piecewise_graph
    from pagedllm.worker.piecewise_graph import PiecewiseGraphRunner, _SplitRecorder

    monkeypatch.setattr(piecewise_graph, "non_owning_view", lambda t: t)  # a CUDA array view; CPU tensors here

    cache = (torch.zeros(4, 8, 2, 32), torch.zeros(4, 8, 2, 32))
    runner = SimpleNamespace(kv_caches=[cache], static_out=torch.zeros(3, 4, 32))
    recorder = _SplitRecorder(runner, 3, capturing=False)
    q = torch.zeros(3, 4, 32)
    sinks = nn.Parameter(torch.randn(4), requires_grad=False)
    meta = SimpleNamespace(kv_cache_group=0)
    recorder.forward(q, q[:, :2], q[:, :2], cache, meta, 0.1, sliding_window=128, sinks=sinks)
    recorder.forward(q, q[:, :2], q[:, :2], cache, meta, 0.1)
    assert recorder.sites[0].sinks is sinks and recorder.sites[1].sinks is None
    assert recorder.sites[0].sliding_window == 128

    calls = []

    class Backend:
        def forward(self, query, key, value, kv_cache, meta, scale, out=None, **kw):
            calls.append(kw)
            return out

    pw = PiecewiseGraphRunner(nn.Linear(1, 1), [cache], Backend(), 4, 2, 32, max_num_batched_tokens=8)
    b = pw.buckets[0]
    pw.graphs[b] = [SimpleNamespace(replay=lambda: None) for _ in range(3)]
    pw.sites[b] = recorder.sites
    pw.outputs[b] = torch.zeros(b, 1)
    pw.run(torch.zeros(3, dtype=torch.long), torch.arange(3), SimpleNamespace(kv_cache_group=0))
    assert len(calls) == 2
    assert calls[0]["sinks"] is sinks and calls[0]["sliding_window"] == 128
    assert "sinks" not in calls[1]


# Long contexts at GPT-OSS's shapes: compiled kernels only.
@pytest.mark.cuda
@pytest.mark.parametrize("window", [None, 128])
def test_long_contexts_with_sinks_on_cuda(window):
    """bf16, head_dim 64, eight query heads per KV head, blocks of 16 (GPT-OSS's attention): decodes of up to 8 200
    tokens through the default split-KV launch (fused and separate merges), chunks of 1 100 tokens after 3 000 of
    context, and the same step through the unified kernel, with GPT-OSS's 128-token window and without."""
    dtype, scale = torch.bfloat16, 64**-0.5
    seq_lens = [8200, 4097, 4095, 1500, 300, 5000 + 3000, 1100 + 3000, 700]
    query_lens = [1, 1, 1, 1, 1, 5000, 1100, 700]
    query, kc, vc, meta = _batch(90, dtype, seq_lens, query_lens, head_dim=64, group=8, q_gain=3.0)
    sinks = _sinks(16, 90, spread=3.0)
    ref = _reference(query, kc, vc, meta, scale, sinks, window)
    if window is not None:
        _poison_invisible_keys(kc, vc, meta, window)
    out = torch.full_like(query, float("nan"))
    triton_attention.paged_attention(query, kc, vc, meta, scale, out=out, sliding_window=window, sinks=sinks)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < _TOL[dtype]
    nd = meta.num_decodes
    dec = torch.full_like(query[:nd], float("nan"))
    triton_attention.paged_decode_attention(query[:nd], kc, vc, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                                            8200, out=dec, reduce="separate", sliding_window=window, sinks=sinks)
    assert _rel_err(dec, ref[:nd]) < _TOL[dtype]
    out = torch.full_like(query, float("nan"))
    unified_attention(query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, out,
                      sliding_window=window, sinks=sinks)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < _TOL[dtype]


@pytest.mark.cuda
def test_decode_with_sinks_replays_in_a_cuda_graph():
    """A captured decode with sinks replays the same attention for new sequence lengths and new sink values (the
    sinks tensor is read at replay, as a layer's parameter is)."""
    dtype, scale = torch.bfloat16, 64**-0.5
    seq_lens = [3000, 700, 2100, 64]
    query, kc, vc, meta = _batch(95, dtype, seq_lens, [1] * 4, head_dim=64, group=8)
    sinks = _sinks(16, 95)
    out = torch.empty_like(query)
    ws = triton_attention.DecodeWorkspace.allocate(DEVICE)

    def run() -> None:
        triton_attention.paged_decode_attention(query, kc, vc, meta.block_tables, meta.seq_lens, scale, 4096,
                                                out=out, workspace=ws, sinks=sinks)

    run()  # sizes the workspace before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for lens, seed in (([3000, 700, 2100, 64], 95), ([3010, 1500, 1025, 2], 96)):
        meta.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        meta.seq_lens_cpu = lens
        sinks.copy_(_sinks(16, seed))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(out, _reference(query, kc, vc, meta, scale, sinks)) < _TOL[dtype]
