"""Sliding-window attention and attention-logit soft-capping on every CPU attention path.

Semantics (transformers'): with a window W the query at position p attends to keys p - W < j <= p; with a soft
cap c each scaled score s becomes c·tanh(s / c) before the softmax. The torch reference (kernels/reference.py) is
checked against eq. 4 token by token (``paged_attention_naive``) and a dense float32 computation; the native
kernel (kernels/cpu/cpu_ops.c, every ISA level this CPU runs) against both, on its token path, its tile path,
partitioned long contexts and bf16 / fp8 pools, keeping its invariant that a token's bits do not depend on its
batch or tile, and reading no block wholly before a tile's window. Last, tiny Mistral checkpoints with windows
of 8 and 5 generate transformers' greedy tokens through the engine (native kernels with the direct forward, and
the torch path).
"""
from __future__ import annotations

import random

import pytest
import torch
from test_models_hf import hf_greedy_reference

from pagedllm.kernels import cpu_isa, cpu_kernels, reference
from pagedllm.kernels.metadata import AttentionMetadata, window_and_cap
from pagedllm.model.layers.attention import NativeCpuAttentionBackend, TorchAttentionBackend
from tests.test_cpu_kernels import _mixed_batch, _pool

KERNELS = cpu_kernels.load_cpu_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler: the CPU path runs torch")
DETECTED = cpu_isa.isa_from_flags(cpu_isa.cpu_flags()) if cpu_isa._is_x86_64() else "portable"
RUNNABLE = cpu_isa.ISA_LEVELS[: cpu_isa.ISA_LEVELS.index(DETECTED) + 1]
ISAS = [pytest.param(i, marks=pytest.mark.skipif(i not in RUNNABLE, reason=f"this CPU runs only {RUNNABLE}"))
        for i in cpu_isa.ISA_LEVELS]
ATOL, RTOL = 2e-6, 2e-5




def _windows(block_size: int) -> list[int | None]:
    """1, 3, a block, two blocks and 5 (not a multiple of the block size), more than any context here, and none."""
    return [1, 3, block_size, 2 * block_size + 5, 10_000, None]


def dense_attention(query, kc, vc, tables, seq_lens, query_lens, scale, window=None, soft_cap=None) -> torch.Tensor:
    """A direct float32 computation: each sequence's keys gathered in order, one [Hq, qlen, seq_len] score matrix,
    capped, masked (causal, then the window), softmax, · V."""
    block_size, hk = kc.shape[1], kc.shape[2]
    hq = query.shape[1]
    out, start = [], 0
    for table, n, qlen in zip(tables, seq_lens, query_lens):
        pos = torch.arange(n)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        k = kc.flatten(0, 1)[slots].float().repeat_interleave(hq // hk, dim=1)  # [n, Hq, D]
        v = vc.flatten(0, 1)[slots].float().repeat_interleave(hq // hk, dim=1)
        q = query[start : start + qlen].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        p = (torch.arange(qlen) + n - qlen).unsqueeze(1)
        allowed = pos.unsqueeze(0) <= p
        if window is not None:
            allowed &= pos.unsqueeze(0) > p - window
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, v))
        start += qlen
    return torch.cat(out).to(query.dtype)


def _tables(meta: AttentionMetadata, block_size: int) -> list[list[int]]:
    return [row[: -(-n // block_size)] for row, n in zip(meta.block_tables.tolist(), meta.seq_lens_cpu)]


def _batch(seed: int, block_size: int, hq: int, hk: int, d: int, query_lens: list[int], ctx_lens: list[int],
           pool_dtype: torch.dtype = torch.float32):
    """K/V of every sequence already in a shuffled pool, the query rows, and the step's metadata (decodes first)."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-(q + c) // block_size) for q, c in zip(query_lens, ctx_lens)]
    kc, vc = (p.to(pool_dtype) for p in _pool(g, sum(blocks) + 3, block_size, hk, d))
    free = torch.randperm(sum(blocks) + 3, generator=g).tolist()
    tables = [[free.pop() for _ in range(nb)] for nb in blocks]
    seq_lens = [q + c for q, c in zip(query_lens, ctx_lens)]
    t = sum(query_lens)
    query = torch.randn(t, hq, d, generator=g)
    slots = [tb[p // block_size] * block_size + p % block_size for tb, q, c in zip(tables, query_lens, ctx_lens)
             for p in range(c, c + q)]
    width = max(blocks)
    num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([tb + [0] * (width - len(tb)) for tb in tables], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens_cpu=seq_lens, query_lens_cpu=list(query_lens), num_decodes=num_decodes, max_seq_len=max(seq_lens),
        max_query_len=max(query_lens),
    )
    return query, kc, vc, meta


def _fresh_kv(kc, vc, meta):
    """This step's K/V rows as the pool holds them (the torch path reads a fresh chunk's from them)."""
    slots = meta.slot_mapping
    return kc.flatten(0, 1)[slots], vc.flatten(0, 1)[slots]


# ------------------------------------------------------------------------------------------ the torch reference


@pytest.mark.parametrize("soft_cap", [None, 2.5], ids=["no-cap", "cap"])
@pytest.mark.parametrize("block_size,hq,hk", [(1, 4, 4), (8, 8, 2), (16, 9, 3)])
def test_reference_matches_eq4_and_a_dense_float32_computation(block_size, hq, hk, soft_cap):
    """Decodes of ragged length (40 of them: two length buckets, each with its padding mask), a fresh prompt longer
    than most windows, and chunks with cached context, with every window against eq. 4 and the dense computation."""
    rng = random.Random(block_size + hq)
    query_lens = [1] * 40 + [37, 7, 13]
    ctx_lens = [rng.randint(0, 70) for _ in range(40)] + [0, 9, 30]
    query, kc, vc, meta = _batch(block_size * 31 + hq, block_size, hq, hk, 16, query_lens, ctx_lens)
    key, value = _fresh_kv(kc, vc, meta)
    tables = _tables(meta, block_size)
    for window in _windows(block_size):
        meta.decode_buckets = None
        out = reference.paged_attention(query, key, value, kc, vc, meta, 0.25, sliding_window=window,
                                        logits_soft_cap=soft_cap)
        naive = reference.paged_attention_naive(query, kc, vc, tables, meta.seq_lens_cpu, query_lens, 0.25,
                                                sliding_window=window, logits_soft_cap=soft_cap)
        dense = dense_attention(query, kc, vc, tables, meta.seq_lens_cpu, query_lens, 0.25, window, soft_cap)
        assert len(meta.decode_buckets) == 2
        torch.testing.assert_close(naive, dense, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(out, dense, atol=ATOL, rtol=RTOL, msg=lambda m: f"window {window}: {m}")


def test_reference_window_of_one_returns_each_tokens_own_value():
    """W = 1: every query sees only itself, so its output is its own V row (GQA: its KV head's)."""
    query, kc, vc, meta = _batch(5, 4, 6, 2, 8, [1, 1, 9, 6], [7, 20, 0, 11])
    key, value = _fresh_kv(kc, vc, meta)
    out = reference.paged_attention(query, key, value, kc, vc, meta, 1.0, sliding_window=1, logits_soft_cap=3.0)
    torch.testing.assert_close(out, value.repeat_interleave(3, dim=1), atol=1e-6, rtol=0)


def test_reference_without_window_or_cap_keeps_the_sdpa_path():
    """A window wider than every context changes nothing, bit for bit (no mask is built); a huge cap nearly nothing."""
    query, kc, vc, meta = _batch(6, 8, 8, 2, 32, [1] * 5 + [12, 40], [30, 3, 50, 9, 17, 0, 21])
    key, value = _fresh_kv(kc, vc, meta)
    plain = reference.paged_attention(query, key, value, kc, vc, meta, 0.2)
    wide = reference.paged_attention(query, key, value, kc, vc, meta, 0.2, sliding_window=meta.max_seq_len)
    assert torch.equal(plain, wide)
    capped = reference.paged_attention(query, key, value, kc, vc, meta, 0.2, logits_soft_cap=1e6)
    torch.testing.assert_close(capped, plain, atol=1e-5, rtol=1e-5)


def test_reference_prefill_from_a_given_sequence_on():
    """prefill_attention(first_seq=...) (the native backend's tail of long chunks) with a window and a cap."""
    query, kc, vc, meta = _batch(8, 16, 4, 2, 16, [1, 1, 5, 40], [100, 3, 60, 30])
    key, value = _fresh_kv(kc, vc, meta)
    out = torch.full_like(query, float("nan"))
    reference.prefill_attention(query, key, value, kc, vc, meta, 0.3, out, first_seq=2, sliding_window=21,
                                logits_soft_cap=4.0)
    dense = dense_attention(query, kc, vc, _tables(meta, 16), meta.seq_lens_cpu, meta.query_lens_cpu, 0.3, 21, 4.0)
    assert torch.isnan(out[:2]).all()
    torch.testing.assert_close(out[2:], dense[2:], atol=ATOL, rtol=RTOL)


def test_reference_bfloat16_queries_with_a_cap():
    """The explicit soft-cap path computes in float32 and returns the query's dtype."""
    query, kc, vc, meta = _batch(9, 8, 4, 2, 16, [1, 1, 12], [30, 5, 20])
    key, value = _fresh_kv(kc, vc, meta)
    out = reference.paged_attention(query.bfloat16(), key.bfloat16(), value.bfloat16(), kc.bfloat16(), vc.bfloat16(),
                                    meta, 0.25, sliding_window=6, logits_soft_cap=2.0)
    dense = dense_attention(query.bfloat16().float(), kc.bfloat16().float(), vc.bfloat16().float(), _tables(meta, 8),
                            meta.seq_lens_cpu, meta.query_lens_cpu, 0.25, 6, 2.0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), dense, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("fn", ["paged_attention", "naive"])
def test_reference_refuses_bad_windows_and_caps(fn):
    query, kc, vc, meta = _batch(3, 4, 2, 2, 8, [1], [5])
    key, value = _fresh_kv(kc, vc, meta)
    for kwargs, match in (({"sliding_window": 0}, "sliding_window must be a positive"),
                          ({"sliding_window": -4}, "sliding_window must be a positive"),
                          ({"logits_soft_cap": 0.0}, "logits_soft_cap must be a positive"),
                          ({"logits_soft_cap": -1.0}, "logits_soft_cap must be a positive")):
        with pytest.raises(ValueError, match=match):
            if fn == "naive":
                reference.paged_attention_naive(query, kc, vc, _tables(meta, 4), [6], [1], 1.0, **kwargs)
            else:
                reference.paged_attention(query, key, value, kc, vc, meta, 1.0, **kwargs)


# ------------------------------------------------------------------------------------------ the native kernel


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("block_size,hq,hk,d", [(16, 9, 3, 64), (8, 8, 2, 128), (1, 4, 4, 32), (32, 8, 1, 80)])
def test_kernel_matches_the_references_on_mixed_batches(isa, block_size, hq, hk, d, kernels_by_isa):
    """Decodes, short chunks (the token path) and 33- / 40-token chunks (the tile path), with and without cached
    context, for every window, with and without a cap, on each ISA level (head_dim 80: scalar tails on AVX-512)."""
    kernels = kernels_by_isa[isa]
    query, key, value, kc, vc, meta = _mixed_batch(block_size * 7 + hq, block_size, hq, hk, d)
    kernels.reshape_and_cache(key, value, kc, vc, meta.slot_mapping)
    tables = _tables(meta, block_size)
    for window in _windows(block_size):
        for cap in (None, 3.0):
            out = torch.full_like(query, float("nan"))
            kernels.paged_attention(out, query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                    d**-0.5, sliding_window=window, logits_soft_cap=cap)
            naive = reference.paged_attention_naive(query, kc, vc, tables, meta.seq_lens_cpu, meta.query_lens_cpu,
                                                    d**-0.5, sliding_window=window, logits_soft_cap=cap)
            torch.testing.assert_close(out, naive, atol=ATOL, rtol=RTOL, msg=lambda m: f"W={window} c={cap}: {m}")
            meta.decode_buckets = None
            ref = reference.paged_attention(query, key, value, kc, vc, meta, d**-0.5, sliding_window=window,
                                            logits_soft_cap=cap)
            torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("scale", [1e-3, 0.1, 1.0, 8.0])
def test_kernel_soft_cap_over_the_whole_tanh_range(isa, scale, kernels_by_isa):
    """Scores from ~0 to ~±200 against a cap of 5 (both branches of the kernel's tanh, and saturation): the capped
    attention within float32 rounding of eq. 4 with torch's tanh."""
    kernels = kernels_by_isa[isa]
    query, kc, vc, meta = _batch(int(scale * 1000), 16, 8, 2, 64, [1] * 6 + [9, 35], [5, 17, 40, 64, 100, 300, 20, 8])
    out = torch.full_like(query, float("nan"))
    kernels.paged_attention(out, query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
                            logits_soft_cap=5.0)
    naive = reference.paged_attention_naive(query, kc, vc, _tables(meta, 16), meta.seq_lens_cpu, meta.query_lens_cpu,
                                            scale, logits_soft_cap=5.0)
    torch.testing.assert_close(out, naive, atol=ATOL, rtol=RTOL)


def _lone_decodes(kernels, query, kc, vc, tables, seq_lens, query_lens, scale, **kw) -> torch.Tensor:
    """Each query token of the batch alone, as a decode whose context ends at its own position."""
    owner = [s for s, q in enumerate(query_lens) for _ in range(q)]
    starts = [sum(query_lens[:s]) for s in range(len(query_lens))]
    lens = [seq_lens[s] - query_lens[s] + (i - starts[s]) + 1 for i, s in enumerate(owner)]
    t = len(owner)
    alone = torch.full_like(query, float("nan"))
    kernels.paged_attention(alone, query, kc, vc, tables[owner].contiguous(), torch.tensor(lens, dtype=torch.int32),
                            torch.arange(t + 1, dtype=torch.int32), scale, **kw)
    return alone


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("ctx", [45, 250, 300], ids=["short", "across-a-partition", "partitioned"])
@pytest.mark.parametrize("window,cap", [(1, None), (7, None), (16, 2.0), (37, None), (250, 4.0), (290, None)])
def test_each_token_of_a_chunk_gets_its_lone_bits_with_a_window(isa, ctx, window, cap, kernels_by_isa):
    """The token path's invariant under a window and a cap: the tokens of 1–20-token chunks (their tiles start
    reading at their first token's window, their rows of several tokens share V loads) get bit for bit what each
    gets alone as a decode; past 256 keys both are partitioned, and a window may start in any partition (or, for
    a chunk's later tokens, after a partition that its first token still reads)."""
    kernels = kernels_by_isa[isa]
    block_size, hq, hk, d = 16, 9, 3, 64
    g = torch.Generator().manual_seed(ctx + window)
    query_lens = [1, 2, 5, 8, 9, 20]
    seq_lens = [ctx + q for q in query_lens]
    per = -(-max(seq_lens) // block_size)
    kc, vc = _pool(g, len(query_lens) * per, block_size, hk, d)
    tables = torch.randperm(len(query_lens) * per, generator=g).view(len(query_lens), per).to(torch.int32)
    query = torch.randn(sum(query_lens), hq, d, generator=g)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    out = torch.full_like(query, float("nan"))
    kernels.paged_attention(out, query, kc, vc, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl, d**-0.5, **kw)
    alone = _lone_decodes(kernels, query, kc, vc, tables, seq_lens, query_lens, d**-0.5, **kw)
    assert not torch.isnan(out).any()
    assert torch.equal(out, alone)
    naive = reference.paged_attention_naive(query, kc, vc, tables.tolist(), seq_lens, query_lens, d**-0.5, **kw)
    torch.testing.assert_close(out, naive, atol=ATOL, rtol=RTOL)


@needs_kernels
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=str)
@pytest.mark.parametrize("window", [2, 5, 100, 256, 300, 700, 2000])
def test_partitioned_contexts_with_a_window_alone_and_in_a_full_batch(pool_dtype, window):
    """Contexts beyond a partition (256 keys) with windows inside one partition, across a boundary (W = 2: the
    verification's last token starts past the partition its first token reads), over several, and wider than
    the context: a decode and a 5-token verification get the same bits alone (their partitions
    spread over the threads) as among 60 other decodes (each tile's partitions in one item), near eq. 4's."""
    hq, hk, d, block_size = 9, 3, 64, 16
    g = torch.Generator().manual_seed(window)
    query_lens = [1, 5, 5] + [1] * 60
    seq_lens = [1000, 514, 200] + [300 + 11 * s for s in range(60)]
    per = -(-max(seq_lens) // block_size)
    kc, vc = (p.to(pool_dtype) for p in _pool(g, len(query_lens) * per, block_size, hk, d))
    tables = torch.randperm(len(query_lens) * per, generator=g).view(len(query_lens), per).to(torch.int32)
    query = torch.randn(sum(query_lens), hq, d, generator=g)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    kw = dict(k_scale=0.5, v_scale=2.0, sliding_window=window, logits_soft_cap=6.0)
    full = torch.full_like(query, float("nan"))
    KERNELS.paged_attention(full, query, kc, vc, tables, lens, qsl, d**-0.5, **kw)
    assert not torch.isnan(full).any()
    for s in range(3):
        rows = slice(int(qsl[s]), int(qsl[s + 1]))
        alone = torch.full_like(query[rows], float("nan"))
        KERNELS.paged_attention(alone, query[rows], kc, vc, tables[s : s + 1].contiguous(), lens[s : s + 1],
                                torch.tensor([0, query_lens[s]], dtype=torch.int32), d**-0.5, **kw)
        assert torch.equal(alone, full[rows])
    fp8 = pool_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    k_scale, v_scale = (0.5, 2.0) if fp8 else (1.0, 1.0)
    naive = reference.paged_attention_naive(query[:11], kc.float() * k_scale, vc.float() * v_scale,
                                            tables[:3].tolist(), seq_lens[:3], query_lens[:3], d**-0.5,
                                            sliding_window=window, logits_soft_cap=6.0)
    torch.testing.assert_close(full[:11], naive, atol=ATOL, rtol=RTOL)


@needs_kernels
@pytest.mark.parametrize("window", [3, 20, 45])
@pytest.mark.parametrize("block_size,hq,hk,d", [(16, 9, 3, 64), (4, 8, 2, 128)])
def test_a_long_chunks_tokens_get_the_same_bits_in_any_long_chunk_with_a_window(window, block_size, hq, hk, d):
    """The tile path under a window (its runs of blocks start at the tile's first window): the last 33 tokens of
    a 70-token prompt get the same bits as their own chunk as inside one chunk of 70."""
    g = torch.Generator().manual_seed(window + block_size)
    total, tail = 70, 33
    per = -(-total // block_size)
    kc, vc = _pool(g, per + 2, block_size, hk, d)
    table = torch.randperm(per + 2, generator=g)[:per].to(torch.int32)
    query = torch.randn(total, hq, d, generator=g)
    kw = dict(sliding_window=window, logits_soft_cap=3.0)
    whole = torch.full_like(query, float("nan"))
    KERNELS.paged_attention(whole, query, kc, vc, table.view(1, -1), torch.tensor([total], dtype=torch.int32),
                            torch.tensor([0, total], dtype=torch.int32), d**-0.5, **kw)
    split = torch.full_like(query[:tail], float("nan"))
    KERNELS.paged_attention(split, query[total - tail :], kc, vc, table.view(1, -1),
                            torch.tensor([total], dtype=torch.int32), torch.tensor([0, tail], dtype=torch.int32),
                            d**-0.5, **kw)
    assert torch.equal(split, whole[total - tail :])
    naive = reference.paged_attention_naive(query, kc, vc, [table.tolist()], [total], [total], d**-0.5, **kw)
    torch.testing.assert_close(whole, naive, atol=ATOL, rtol=RTOL)


@needs_kernels
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("query_lens,ctx", [([1], 1500), ([6], 1500), ([40], 700), ([1, 1, 3], 900)],
                         ids=["decode-partitioned", "chunk-partitioned", "tile-path", "batch"])
def test_blocks_before_a_window_are_never_read(pool_dtype, query_lens, ctx):
    """The point of a window: a tile reads no block that ends before its first token's window. Those blocks hold
    NaN here (one read would poison the output); the result equals the one over the real values."""
    block_size, hq, hk, d, window = 16, 8, 2, 64, 100
    query, kc, vc, meta = _batch(len(query_lens) + ctx, block_size, hq, hk, d, query_lens, [ctx] * len(query_lens),
                                 pool_dtype)
    args = (meta.block_tables, meta.seq_lens, meta.query_start_loc, d**-0.5)
    want = torch.full_like(query, float("nan"))
    KERNELS.paged_attention(want, query, kc, vc, *args, sliding_window=window)
    poisoned_k, poisoned_v = kc.clone(), vc.clone()
    for s, qlen in enumerate(query_lens):
        first_key = meta.seq_lens_cpu[s] - qlen + 1 - window  # the window start of the sequence's first token
        dead = meta.block_tables[s, : first_key // block_size].long()
        poisoned_k[dead] = float("nan")
        poisoned_v[dead] = float("nan")
    got = torch.full_like(query, float("nan"))
    KERNELS.paged_attention(got, query, poisoned_k, poisoned_v, *args, sliding_window=window)
    assert torch.equal(got, want)
    dense = dense_attention(query, kc.float(), vc.float(), _tables(meta, block_size), meta.seq_lens_cpu, query_lens,
                            d**-0.5, window)
    torch.testing.assert_close(got, dense, atol=ATOL, rtol=RTOL)


@needs_kernels
def test_kernel_refuses_bad_windows_and_caps():
    query, kc, vc, meta = _batch(3, 4, 2, 2, 8, [1], [5])
    out = torch.empty_like(query)
    args = (out, query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, 1.0)
    for kwargs, match in (({"sliding_window": 0}, "sliding_window must be a positive int"),
                          ({"sliding_window": -3}, "sliding_window must be a positive int"),
                          ({"sliding_window": 2.5}, "sliding_window must be a positive int"),
                          ({"logits_soft_cap": 0.0}, "logits_soft_cap must be a positive finite"),
                          ({"logits_soft_cap": float("nan")}, "logits_soft_cap must be a positive finite"),
                          ({"logits_soft_cap": float("inf")}, "logits_soft_cap must be a positive finite")):
        with pytest.raises(ValueError, match=match):
            KERNELS.paged_attention(*args, **kwargs)
    assert window_and_cap(None, None) == (0, 0.0)
    assert window_and_cap(4096, 50) == (4096, 50.0)
    assert window_and_cap(2**40, None) == (2**31 - 1, 0.0)  # wider than any int32 context: no window
    for bad in (True, 4.5, "8"):
        with pytest.raises(ValueError, match="sliding_window"):
            window_and_cap(bad, None)


@needs_kernels
@pytest.mark.parametrize("max_native_query_len", [512, 4], ids=["all-native", "long-chunks-native-too"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["f32-pool", "bf16-pool"])
@pytest.mark.parametrize("window,cap", [(5, None), (16, 30.0), (None, 2.0)])
def test_native_backend_equals_torch_backend(window, cap, pool_dtype, max_native_query_len, monkeypatch):
    """Both CPU backends, as a layer calls them. With a window or a cap the native one keeps even chunks longer than
    its `max_native_query_len` (torch's fallback masks whole contexts or builds float32 scores: several times slower)."""
    from pagedllm.model.layers import attention

    def no_fallback(*args, **kwargs):
        raise AssertionError("a windowed / capped chunk went to torch's SDPA fallback")

    block_size, hq, hk, d = 8, 8, 2, 64
    query, key, value, kc, vc, meta = _mixed_batch(block_size + hq, block_size, hq, hk, d)
    kc, vc = kc.to(pool_dtype), vc.to(pool_dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    kq, vq = (key, value) if pool_dtype == torch.float32 else (key.bfloat16().float(), value.bfloat16().float())
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    expected = TorchAttentionBackend().forward(query, kq, vq, (kc, vc), meta, d**-0.5, **kw)
    meta.decode_buckets = None
    backend = NativeCpuAttentionBackend(KERNELS)
    backend.max_native_query_len = max_native_query_len
    monkeypatch.setattr(attention.reference, "prefill_attention", no_fallback)
    out = backend.forward(query, key, value, (kc2, vc2), meta, d**-0.5, **kw)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    dense = dense_attention(query, kc.float(), vc.float(), _tables(meta, block_size), meta.seq_lens_cpu,
                            meta.query_lens_cpu, d**-0.5, window, cap)
    torch.testing.assert_close(out, dense, atol=ATOL, rtol=RTOL)


# ------------------------------------------------------------------------------------------ end to end


MISTRAL = dict(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)
PROMPT_LENS = (20, 24, 27, 30, 36)  # the 36-token prompt takes the kernel's tile path
MAX_TOKENS = 40




@pytest.fixture(scope="module")
def windowed_mistral(tmp_path_factory):
    """window → (checkpoint dir, prompts, transformers' eager greedy continuations), built once per window."""
    import transformers

    cache: dict[int, tuple] = {}

    def get(window: int):
        if window not in cache:
            torch.manual_seed(window)
            config = transformers.MistralConfig(sliding_window=window, **MISTRAL)
            model = transformers.MistralForCausalLM(config).eval()
            path = tmp_path_factory.mktemp(f"mistral_w{window}")
            model.save_pretrained(path, safe_serialization=True)
            model = transformers.MistralForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                                    dtype=torch.float32).eval()
            model.generation_config.eos_token_id = None
            gen = torch.Generator().manual_seed(window + 1)
            prompts = [torch.randint(0, MISTRAL["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENS]
            cache[window] = (str(path), prompts, hf_greedy_reference(model, prompts, MAX_TOKENS)[0])
        return cache[window]

    return get


@pytest.mark.parametrize("window", [8, 5])
@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_windowed_mistral_generates_transformers_tokens(window, kernels, windowed_mistral, one_thread, monkeypatch):
    """40 greedy tokens after 20–36-token prompts cross a window of 8 (two blocks of 4) or 5 (not a multiple of the
    block size) many times: pagedllm's tokens equal transformers' eager ones, on the native kernels (every step on
    the direct forward) and on the torch path."""
    from pagedllm import LLM, SamplingParams

    path, prompts, refs = windowed_mistral(window)
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", kernels)
    cpu_kernels.load_cpu_kernels.cache_clear()
    try:
        llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", device="cpu", block_size=4,
                  num_gpu_blocks_override=160, swap_space=0.01)
        runner = llm.llm_engine.executor.driver_worker.model_runner
        attn = runner.model.model.layers[0].self_attn.attn
        assert attn.sliding_window == window
        stats = runner.enable_step_stats()
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        paths = {path for _, path, *_ in stats.records}
        runner.step_stats = None
    finally:
        cpu_kernels.load_cpu_kernels.cache_clear()
    if kernels == "native":
        assert runner.direct_forward is not None and runner.direct_forward.layers[0].window == window
        assert paths == {"direct"}
    else:
        assert runner.direct_forward is None and isinstance(runner.attn_backend, TorchAttentionBackend)
    for prompt, ref, out in zip(prompts, refs, outs):
        assert list(out.outputs[0].token_ids) == ref, f"prompt of {len(prompt)} tokens diverged"


def test_direct_forward_carries_each_layers_window_and_cap(windowed_mistral, one_thread, monkeypatch, caplog):
    """The direct forward hands every layer's window and soft cap to the kernel (its tokens equal the module
    path's with a cap set on one layer only), and steps aside for a model class that opts out."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.model.cpu_direct_forward import LlamaDirectForward

    path, prompts, _ = windowed_mistral(8)
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", device="cpu", block_size=4,
              num_gpu_blocks_override=160, swap_space=0.01)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    model, backend = runner.model, runner.attn_backend
    monkeypatch.setattr(model.model.layers[1].self_attn.attn, "logits_soft_cap", 0.5)
    direct = LlamaDirectForward.build(model, backend)
    assert [(layer.window, layer.soft_cap) for layer in direct.layers] == [(8, 0.0), (8, 0.5)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    requests = [{"prompt_token_ids": p} for p in prompts]
    monkeypatch.setattr(runner, "direct_forward", direct)
    got = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(requests, params, use_tqdm=False)]
    monkeypatch.setattr(runner, "direct_forward", None)
    ref = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(requests, params, use_tqdm=False)]
    assert got == ref
    monkeypatch.setattr(type(model), "direct_forward_supported", False, raising=False)
    with caplog.at_level("INFO", logger="pagedllm"):
        assert LlamaDirectForward.build(model, backend) is None
    assert "direct_forward_supported = False" in caplog.text
