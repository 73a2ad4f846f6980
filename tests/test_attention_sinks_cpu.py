"""GPT-OSS's attention sinks in the native CPU attention kernel (kernels/cpu/cpu_ops.c).

Head h's softmax gains one logit, sinks[h], in its denominator only: o = Σ exp(s_j - m) v_j / (Σ exp(s_j - m) +
exp(sinks[h] - m)). The kernel (every ISA level this CPU runs) is checked against the torch references
(``reference.paged_attention_naive`` token by token, ``reference.paged_attention``) on decodes, token-path and
tile-path chunks, partitioned long contexts, GQA, sliding windows, float32 / bf16 / fp8 pools, with sinks from
very negative (no effect) to far above every score (outputs ~0); sinks=None keeps the kernel's bits; and the
native backend against the torch backend as a layer calls them.
"""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import cpu_isa, cpu_kernels, reference
from pagedllm.kernels.metadata import AttentionMetadata
from pagedllm.model.layers.attention import NativeCpuAttentionBackend, TorchAttentionBackend
from tests.test_cpu_kernels import _mixed_batch, _pool

KERNELS = cpu_kernels.load_cpu_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler: the CPU path runs torch")
DETECTED = cpu_isa.isa_from_flags(cpu_isa.cpu_flags()) if cpu_isa._is_x86_64() else "portable"
RUNNABLE = cpu_isa.ISA_LEVELS[: cpu_isa.ISA_LEVELS.index(DETECTED) + 1]
ISAS = [pytest.param(i, marks=pytest.mark.skipif(i not in RUNNABLE, reason=f"this CPU runs only {RUNNABLE}"))
        for i in cpu_isa.ISA_LEVELS]
ATOL, RTOL = 2e-6, 2e-5


def _sinks(seed: int, hq: int) -> torch.Tensor:
    """One logit per query head: a very negative one (no effect), -inf, one far above any score (the output goes
    to ~0; exp overflows in float32), one that dominates but stays finite, and ordinary ones around the scores."""
    g = torch.Generator().manual_seed(seed)
    special = torch.tensor([-1e4, 100.0, 6.0, float("-inf"), 0.0])
    values = torch.randn(hq, generator=g) * 2
    values[: min(hq, len(special))] = special[:hq]
    return values[torch.randperm(hq, generator=g)].contiguous()


def _tables(meta: AttentionMetadata, block_size: int) -> list[list[int]]:
    return [row[: -(-n // block_size)] for row, n in zip(meta.block_tables.tolist(), meta.seq_lens_cpu)]


def _cached_mixed_batch(kernels, seed: int, block_size: int, hq: int, hk: int, d: int, pool_dtype: torch.dtype):
    """_mixed_batch (20 decodes, token-path and tile-path chunks) with its K/V written to a pool of `pool_dtype`,
    and this step's K/V as that pool holds them (float32)."""
    query, key, value, kc, vc, meta = _mixed_batch(seed, block_size, hq, hk, d)
    kc, vc = kc.to(pool_dtype), vc.to(pool_dtype)
    kernels.reshape_and_cache(key, value, kc, vc, meta.slot_mapping)
    fresh_k, fresh_v = (c.flatten(0, 1)[meta.slot_mapping].float() for c in (kc, vc))
    return query, fresh_k, fresh_v, kc, vc, meta


def _attend(kernels, query, kc, vc, block_tables, seq_lens, query_start_loc, scale, **kw) -> torch.Tensor:
    out = torch.full_like(query, float("nan"))
    kernels.paged_attention(out, query, kc, vc, block_tables, seq_lens, query_start_loc, scale, **kw)
    return out


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["f32-pool", "bf16-pool"])
@pytest.mark.parametrize("block_size,hq,hk,d", [(16, 9, 3, 64), (8, 8, 2, 128), (1, 4, 4, 32), (32, 8, 1, 80)])
def test_kernel_with_sinks_matches_the_references_on_mixed_batches(isa, pool_dtype, block_size, hq, hk, d,
                                                                  kernels_by_isa):
    """Decodes, short chunks (the token path) and 33- / 40-token chunks (the tile path), MHA and GQA, without and
    with windows, and once with a soft cap too, against eq. 4 with sinks and the torch reference."""
    kernels = kernels_by_isa[isa]
    query, key, value, kc, vc, meta = _cached_mixed_batch(kernels, block_size * 7 + hq, block_size, hq, hk, d,
                                                          pool_dtype)
    sinks = _sinks(block_size + hq, hq)
    tables = _tables(meta, block_size)
    kcf, vcf = kc.float(), vc.float()
    for window, cap in ((None, None), (5, None), (2 * block_size + 5, None), (None, 3.0), (7, 2.0)):
        kw = dict(sliding_window=window, logits_soft_cap=cap)
        out = _attend(kernels, query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, d**-0.5,
                      sinks=sinks, **kw)
        naive = reference.paged_attention_naive(query, kcf, vcf, tables, meta.seq_lens_cpu, meta.query_lens_cpu,
                                                d**-0.5, sinks=sinks, **kw)
        torch.testing.assert_close(out, naive, atol=ATOL, rtol=RTOL, msg=lambda m: f"W={window} c={cap}: {m}")
        meta.decode_buckets = None
        ref = reference.paged_attention(query, key, value, kcf, vcf, meta, d**-0.5, sinks=sinks, **kw)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"W={window} c={cap}: {m}")
        plain = _attend(kernels, query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, d**-0.5, **kw)
        # the sinks only shrink each row (a larger denominator): heads with a sink far above the scores go to ~0
        big = (sinks > 50).nonzero().flatten()
        assert out[:, big].abs().max() < 1e-30
        assert not torch.equal(out, plain)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("window", [None, 100, 300], ids=["no-window", "W100", "W300"])
def test_partitioned_long_contexts_with_sinks(isa, pool_dtype, window, kernels_by_isa):
    """Contexts beyond a partition (256 keys): a decode and 5-token verifications (the token path's partitions,
    merged at the end: the sink joins that merge once) alone (partitions spread over the threads) and among 40
    decodes (each tile's partitions in one item) get the same bits, each token its lone decode's, near eq. 4; a
    40-token chunk after 700 keys takes the tile path."""
    kernels = kernels_by_isa[isa]
    hq, hk, d, block_size = 8, 2, 64, 16
    g = torch.Generator().manual_seed(7 + (window or 0))
    query_lens = [1, 5, 5, 40] + [1] * 40
    seq_lens = [1000, 514, 200, 740] + [260 + 13 * s for s in range(40)]
    per = -(-max(seq_lens) // block_size)
    kc, vc = (p.to(pool_dtype) for p in _pool(g, len(query_lens) * per, block_size, hk, d))
    tables = torch.randperm(len(query_lens) * per, generator=g).view(len(query_lens), per).to(torch.int32)
    query = torch.randn(sum(query_lens), hq, d, generator=g)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    sinks = _sinks(11, hq)
    fp8 = pool_dtype == torch.float8_e4m3fn
    k_scale, v_scale = (0.5, 2.0) if fp8 else (1.0, 1.0)
    kw = dict(k_scale=k_scale, v_scale=v_scale, sliding_window=window, sinks=sinks)
    full = _attend(kernels, query, kc, vc, tables, lens, qsl, d**-0.5, **kw)
    assert not torch.isnan(full).any()
    for s in range(4):
        rows = slice(int(qsl[s]), int(qsl[s + 1]))
        alone = _attend(kernels, query[rows], kc, vc, tables[s : s + 1].contiguous(), lens[s : s + 1],
                        torch.tensor([0, query_lens[s]], dtype=torch.int32), d**-0.5, **kw)
        assert torch.equal(alone, full[rows])
    # each token of the (token-path) verifications as a lone decode whose context ends at its own position
    owner = [s for s in range(3) for _ in range(query_lens[s])]
    own_lens = [seq_lens[s] - query_lens[s] + i - int(qsl[s]) + 1 for i, s in enumerate(owner)]
    t = len(owner)
    decodes = _attend(kernels, query[:t], kc, vc, tables[owner].contiguous(), torch.tensor(own_lens, dtype=torch.int32),
                      torch.arange(t + 1, dtype=torch.int32), d**-0.5, **kw)
    assert torch.equal(decodes, full[:t])
    n = int(qsl[6])  # the four long sequences and two of the decodes
    naive = reference.paged_attention_naive(query[:n], kc.float() * k_scale, vc.float() * v_scale,
                                            tables[:6].tolist(), seq_lens[:6], query_lens[:6], d**-0.5,
                                            sliding_window=window, sinks=sinks)
    torch.testing.assert_close(full[:n], naive, atol=ATOL, rtol=RTOL)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
def test_no_sinks_keeps_the_kernels_bits(isa, kernels_by_isa):
    """sinks=None and no sinks argument give the bits of the sink-less C entry point (model/cpu_direct_forward.py
    calls it), and so do sinks of -inf (exp gives exact zeros), on every path: decodes, token-path and tile-path
    chunks, partitioned contexts, with a window and a cap."""
    kernels = kernels_by_isa[isa]
    block_size, hq, hk, d = 16, 9, 3, 64
    g = torch.Generator().manual_seed(3)
    query_lens = [1, 1, 4, 7, 40, 36]
    seq_lens = [30, 600, 300, 19, 40, 500]
    per = -(-max(seq_lens) // block_size)
    kc, vc = _pool(g, len(query_lens) * per, block_size, hk, d)
    tables = torch.randperm(len(query_lens) * per, generator=g).view(len(query_lens), per).to(torch.int32)
    query = torch.randn(sum(query_lens), hq, d, generator=g)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    attention = kernels.c_functions()[3]
    for window, cap in ((None, None), (50, 4.0)):
        w, c = (window or 0), (cap or 0.0)
        raw = torch.full_like(query, float("nan"))
        rc = attention(raw.data_ptr(), raw.stride(0), query.data_ptr(), query.stride(0), kc.data_ptr(), vc.data_ptr(),
                       tables.data_ptr(), tables.stride(0), lens.data_ptr(), qsl.data_ptr(), len(query_lens), hq, hk,
                       d, block_size, d**-0.5, 0, cpu_kernels.TILE_MIN_QUERY_LEN, 1.0, 1.0, w, c)
        assert rc == 0 and not torch.isnan(raw).any()
        args = (query, kc, vc, tables, lens, qsl, d**-0.5)
        kw = dict(sliding_window=window, logits_soft_cap=cap)
        assert torch.equal(_attend(kernels, *args, **kw), raw)
        assert torch.equal(_attend(kernels, *args, sinks=None, **kw), raw)
        assert torch.equal(_attend(kernels, *args, sinks=torch.full((hq,), float("-inf")), **kw), raw)


@needs_kernels
def test_kernel_refuses_bad_sinks():
    query, key, value, kc, vc, meta = _mixed_batch(1, 4, 4, 2, 16)
    args = (torch.empty_like(query), query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.25)
    for bad, match in ((torch.zeros(4, dtype=torch.float64), "sinks must be a float32"),
                       (torch.zeros(4, dtype=torch.bfloat16), "sinks must be a float32"),
                       (torch.zeros(5), r"sinks must be a contiguous \[num_q_heads = 4\]"),
                       (torch.zeros(1, 4), r"sinks must be a contiguous \[num_q_heads = 4\]"),
                       (torch.zeros(8)[::2], r"sinks must be a contiguous \[num_q_heads = 4\]")):
        with pytest.raises(ValueError, match=match):
            KERNELS.paged_attention(*args, sinks=bad)


@needs_kernels
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16], ids=["f32-model", "bf16-model"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["f32-pool", "bf16-pool"])
@pytest.mark.parametrize("window", [None, 6])
def test_native_backend_with_sinks_equals_torch_backend(window, pool_dtype, model_dtype, monkeypatch):
    """Both CPU backends as a layer calls them (the native one has the kernel take the sinks, no torch fallback)."""
    from pagedllm.model.layers import attention

    if model_dtype == torch.bfloat16 and pool_dtype == torch.float32:
        pytest.skip("a bf16 model keeps a bf16 pool")

    def no_fallback(*args, **kwargs):
        raise AssertionError("attention with sinks went to the torch reference")

    block_size, hq, hk, d = 8, 8, 2, 64
    query, key, value, kc, vc, meta = _mixed_batch(block_size + hq + 1, block_size, hq, hk, d)
    query, key, value = query.to(model_dtype), key.to(model_dtype), value.to(model_dtype)
    kc, vc = kc.to(pool_dtype), vc.to(pool_dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    kq, vq = (key, value) if pool_dtype == model_dtype else (key.bfloat16().to(model_dtype),
                                                             value.bfloat16().to(model_dtype))
    sinks = _sinks(5, hq)
    expected = TorchAttentionBackend().forward(query, kq, vq, (kc, vc), meta, d**-0.5, sliding_window=window,
                                               sinks=sinks)
    meta.decode_buckets = None
    monkeypatch.setattr(attention.reference, "paged_attention", no_fallback)
    monkeypatch.setattr(attention.reference, "prefill_attention", no_fallback)
    out = NativeCpuAttentionBackend(KERNELS).forward(query, key, value, (kc2, vc2), meta, d**-0.5,
                                                     sliding_window=window, sinks=sinks)
    assert out.dtype == model_dtype
    tol = dict(atol=ATOL, rtol=RTOL) if model_dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out, expected, **tol)
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)
