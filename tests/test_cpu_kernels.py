"""The CPU path's native kernels (kernels/cpu/cpu_ops.c) and oneDNN GEMMs, each against its torch oracle.

Decode attention is checked against eq. 4 token by token (``paged_attention_naive``) and against the
torch backend on mixed decode + prefill batches; the fused ops against the layers' ``forward_native``.
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_kernels, cpu_linear, reference
from pagedllm.worker import cpu_memory
from pagedllm.kernels.metadata import AttentionMetadata
from pagedllm.model.layers.attention import NativeCpuAttentionBackend, TorchAttentionBackend
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.layers.rotary import RotaryEmbedding

KERNELS = cpu_kernels.load_cpu_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler: the CPU path runs torch")


def _pool(rng: torch.Generator, num_blocks: int, block_size: int, hk: int, d: int):
    return (torch.randn(num_blocks, block_size, hk, d, generator=rng),
            torch.randn(num_blocks, block_size, hk, d, generator=rng))


@needs_kernels
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("hq,hk", [(4, 4), (9, 3), (8, 2), (8, 1)])
def test_decode_attention_matches_eq4_oracle(block_size, head_dim, hq, hk):
    rng = torch.Generator().manual_seed(block_size * 1000 + head_dim + hq)
    lens = [1, 2, block_size, block_size + 1, 57, 200, 3 * block_size - 1]
    max_blocks = -(-max(lens) // block_size)
    num_blocks = len(lens) * max_blocks + 5
    kc, vc = _pool(rng, num_blocks, block_size, hk, head_dim)
    perm = torch.randperm(num_blocks, generator=rng)[: len(lens) * max_blocks]  # shuffled tables
    tables = perm.view(len(lens), max_blocks).to(torch.int32)
    query = torch.randn(len(lens), hq, head_dim, generator=rng)
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)  # one query token per sequence
    KERNELS.paged_attention(out, query, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), qsl, scale)
    expected = reference.paged_attention_naive(query, kc, vc, tables.tolist(), lens, [1] * len(lens), scale)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)


def _mixed_batch(seed: int, block_size: int, hq: int, hk: int, d: int):
    """20 decodes of ragged length, then prompt chunks with and without cached context: short ones (the
    kernel's token path) and ones of at least 32 tokens (its tile path)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    query_lens = [1] * 20 + [7, 13, 5, 40, 33]
    ctx_lens = [rng.randint(0, 90) for _ in range(20)] + [0, 9, 30, 0, 25]
    num_blocks = sum(-(-(q + c) // block_size) for q, c in zip(query_lens, ctx_lens)) + 8
    kc, vc = _pool(g, num_blocks, block_size, hk, d)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, seq_lens, slots = [], [], []
    for q, c in zip(query_lens, ctx_lens):
        table = [free.pop() for _ in range(-(-(q + c) // block_size))]
        tables.append(table)
        seq_lens.append(q + c)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + q)]
    t = sum(query_lens)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g)  # strided views, as the model hands them over
    query = qkv[:, : hq * d].view(t, hq, d)
    key = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    value = qkv[:, (hq + hk) * d :].view(t, hk, d)
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=torch.tensor([tb + [0] * (width - len(tb)) for tb in tables],
                                                                    dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32),
        seq_lens_cpu=seq_lens, query_lens_cpu=query_lens, num_decodes=20, max_seq_len=max(seq_lens),
        max_query_len=max(query_lens),
    )
    return query, key, value, kc, vc, meta


@needs_kernels
@pytest.mark.parametrize("block_size,hq,hk,d", [(16, 9, 3, 64), (8, 8, 2, 128), (1, 4, 4, 32), (32, 8, 1, 80)])
def test_mixed_batch_matches_eq4_oracle(block_size, hq, hk, d):
    """One call for decodes, fresh prompt chunks and chunks with cached context (causal per chunk)."""
    query, key, value, kc, vc, meta = _mixed_batch(block_size * 7 + hq, block_size, hq, hk, d)
    KERNELS.reshape_and_cache(key, value, kc, vc, meta.slot_mapping)
    out = torch.full_like(query, float("nan"))
    KERNELS.paged_attention(out, query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, d**-0.5)
    tables = [row[: -(-n // block_size)] for row, n in zip(meta.block_tables.tolist(), meta.seq_lens_cpu)]
    expected = reference.paged_attention_naive(query, kc, vc, tables, meta.seq_lens_cpu, meta.query_lens_cpu,
                                               d**-0.5)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)


@needs_kernels
@pytest.mark.parametrize("hq,hk,ctx", [(9, 3, 45), (9, 3, 300), (32, 8, 4500)], ids=["short", "ctx300", "tile-shrinks"])
def test_each_query_token_of_a_chunk_gets_the_bits_it_gets_alone(hq, hk, ctx):
    """Tokens of one sequence run as tiles that read each K/V block once; every token's result must still be
    bit-identical to the same token run alone as a decode (speculative verification and chunked prefill
    rely on it: a row's result may not depend on the batch). Chunk lengths cross the tile size (8) and
    block boundaries; at 32 heads × 4 500 keys the tile shrinks to fit the scores scratch."""
    check_tokens_get_their_lone_bits(KERNELS, hq, hk, ctx)


def check_tokens_get_their_lone_bits(kernels, hq: int, hk: int, ctx: int, d: int = 64) -> None:
    """Chunks of 1–20 query tokens after `ctx` keys (token path below 32 tokens, whose rows of several tokens share
    V loads) against each token as a lone decode: bit for bit, and the naive reference to rounding."""
    block_size = 16
    g = torch.Generator().manual_seed(ctx + hq)
    query_lens = [1, 2, 5, 8, 9, 20]
    seq_lens = [ctx + q for q in query_lens]
    per = -(-max(seq_lens) // block_size)
    num_blocks = len(query_lens) * per
    kc, vc = _pool(g, num_blocks, block_size, hk, d)
    tables = torch.randperm(num_blocks, generator=g).view(len(query_lens), per).to(torch.int32)
    t = sum(query_lens)
    query = torch.randn(t, hq, d, generator=g)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = torch.full_like(query, float("nan"))
    kernels.paged_attention(out, query, kc, vc, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl, d**-0.5)
    # Every token alone: one decode "sequence" per token, its context ending at the token's own position.
    owner = [s for s, q in enumerate(query_lens) for _ in range(q)]
    alone_lens = [seq_lens[s] - query_lens[s] + (i - int(qsl[s])) + 1 for i, s in enumerate(owner)]
    alone = torch.full_like(query, float("nan"))
    kernels.paged_attention(alone, query, kc, vc, tables[owner].contiguous(),
                            torch.tensor(alone_lens, dtype=torch.int32), torch.arange(t + 1, dtype=torch.int32),
                            d**-0.5)
    assert not torch.isnan(out).any()
    assert torch.equal(out, alone)
    expected = reference.paged_attention_naive(query, kc, vc, tables.tolist(), seq_lens, query_lens, d**-0.5)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)


@needs_kernels
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("hq,hk,d,block_size", [(9, 3, 64, 16), (8, 2, 128, 32), (4, 4, 32, 1)])
def test_partitioned_contexts_get_the_same_bits_alone_and_in_a_full_batch(pool_dtype, hq, hk, d, block_size):
    """A token-path context longer than a partition (256 keys) is read a partition at a time and the partitions
    combined. Alone, one or two sequences spread their partitions over the threads as work items; among 60 other
    decodes each tile runs its partitions in one item. A decode and a 5-token verification across partition
    boundaries (and one inside the first partition) must get the same bits both ways, near eq. 4's result."""
    g = torch.Generator().manual_seed(hq * d + block_size)
    query_lens = [1, 5, 5] + [1] * 60
    seq_lens = [1000, 514, 200] + [300 + 11 * s for s in range(60)]
    per = -(-max(seq_lens) // block_size)
    kc, vc = (p.to(pool_dtype) for p in _pool(g, len(query_lens) * per, block_size, hk, d))
    tables = torch.randperm(len(query_lens) * per, generator=g).view(len(query_lens), per).to(torch.int32)
    query = torch.randn(sum(query_lens), hq, d, generator=g)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    full = torch.full_like(query, float("nan"))
    KERNELS.paged_attention(full, query, kc, vc, tables, lens, qsl, d**-0.5, k_scale=0.5, v_scale=2.0)
    assert not torch.isnan(full).any()
    for s in range(3):
        rows = slice(int(qsl[s]), int(qsl[s + 1]))
        alone = torch.full_like(query[rows], float("nan"))
        KERNELS.paged_attention(alone, query[rows], kc, vc, tables[s : s + 1].contiguous(), lens[s : s + 1],
                                torch.tensor([0, query_lens[s]], dtype=torch.int32), d**-0.5, k_scale=0.5,
                                v_scale=2.0)
        assert torch.equal(alone, full[rows])
    scales = (0.5, 2.0) if pool_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    expected = reference.paged_attention_naive(query[:11], kc.float() * scales[0], vc.float() * scales[1],
                                               tables[:3].tolist(), seq_lens[:3], query_lens[:3], d**-0.5)
    torch.testing.assert_close(full[:11], expected, atol=2e-6, rtol=2e-5)


@needs_kernels
def test_raising_the_tile_threshold_keeps_a_long_chunk_on_the_token_path():
    """Speculative decoding with k ≥ 31 drafts raises min_tile_query_len above 1 + k, so a 40-token verification
    chunk gets, row for row, the bits of 40 lone decodes."""
    block_size, hq, hk, d, ctx, qlen = 16, 9, 3, 64, 50, 40
    g = torch.Generator().manual_seed(7)
    per = -(-(ctx + qlen) // block_size)
    kc, vc = _pool(g, per, block_size, hk, d)
    table = torch.randperm(per, generator=g).to(torch.int32).view(1, -1)
    query = torch.randn(qlen, hq, d, generator=g)
    chunk, alone = torch.full_like(query, float("nan")), torch.full_like(query, float("nan"))
    KERNELS.paged_attention(chunk, query, kc, vc, table, torch.tensor([ctx + qlen], dtype=torch.int32),
                            torch.tensor([0, qlen], dtype=torch.int32), d**-0.5, min_tile_query_len=2 + 40)
    KERNELS.paged_attention(alone, query, kc, vc, table.expand(qlen, -1).contiguous(),
                            torch.arange(ctx + 1, ctx + qlen + 1, dtype=torch.int32),
                            torch.arange(qlen + 1, dtype=torch.int32), d**-0.5)
    assert torch.equal(chunk, alone)


@needs_kernels
@pytest.mark.parametrize("block_size,hq,hk,d", [(16, 9, 3, 64), (8, 8, 2, 128), (32, 4, 4, 80)])
def test_a_long_chunks_tokens_get_the_same_bits_in_any_long_chunk(block_size, hq, hk, d):
    """Chunks of at least 32 tokens take the tile path (scores and probabilities as small GEMMs over runs of
    blocks). A token's arithmetic there does not depend on the tile either: the last 33 tokens of a 70-token
    prompt get the same bits as a chunk of their own (the first 37 in the cache) as inside one chunk of 70,
    whatever else shares the call."""
    g = torch.Generator().manual_seed(block_size + hq + d)
    total, tail = 70, 33
    per = -(-total // block_size)
    kc, vc = _pool(g, 2 * per + 4, block_size, hk, d)
    table = torch.randperm(2 * per + 4, generator=g)[:per].to(torch.int32)
    query = torch.randn(total, hq, d, generator=g)
    whole = torch.full_like(query, float("nan"))
    KERNELS.paged_attention(whole, query, kc, vc, table.view(1, -1), torch.tensor([total], dtype=torch.int32),
                            torch.tensor([0, total], dtype=torch.int32), d**-0.5)
    # the tail as its own chunk, after a decode and a 40-token chunk of another sequence in the same call
    other = torch.randn(41, hq, d, generator=g)
    batch = torch.cat([other, query[total - tail:]])
    split = torch.full_like(batch, float("nan"))
    tables = torch.stack([table, table.roll(1), table])
    KERNELS.paged_attention(split, batch, kc, vc, tables, torch.tensor([5, 60, total], dtype=torch.int32),
                            torch.tensor([0, 1, 41, 41 + tail], dtype=torch.int32), d**-0.5)
    assert not torch.isnan(whole).any()
    assert torch.equal(split[41:], whole[total - tail:])
    expected = reference.paged_attention_naive(query, kc, vc, [table.tolist()], [total], [total], d**-0.5)
    torch.testing.assert_close(whole, expected, atol=2e-6, rtol=2e-5)


@needs_kernels
@pytest.mark.parametrize("block_size,hq,hk,d", [(16, 9, 3, 64), (8, 8, 2, 128), (1, 4, 4, 32), (32, 8, 1, 80)])
def test_bf16_pool_write_rounds_as_torch_and_attention_reads_it_exactly(block_size, hq, hk, d):
    """--kv-cache-dtype bfloat16 on the CPU: the cache write stores what torch's .to(torch.bfloat16) gives
    (round to nearest even, bit for bit), and attention over the bf16 pool equals eq. 4 on the same bf16
    values read as float32, for decodes and chunks with and without context."""
    query, key, value, kc, vc, meta = _mixed_batch(block_size * 7 + hq, block_size, hq, hk, d)
    kb, vb, out = check_bf16_pool(KERNELS, query, key, value, kc, vc, meta, d)
    tables = [row[: -(-n // block_size)] for row, n in zip(meta.block_tables.tolist(), meta.seq_lens_cpu)]
    expected = reference.paged_attention_naive(query, kb, vb, tables, meta.seq_lens_cpu, meta.query_lens_cpu,
                                               d**-0.5)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)


def check_bf16_pool(kernels, query, key, value, kc, vc, meta, d):
    """On bf16 copies of the pools: the kernels' cache write stores torch's .to(torch.bfloat16) bit for bit,
    and attention over the bf16 pool has the bits of the float32 kernel on the widened pool (the bf16 path
    only changes what is streamed) → (key pool, value pool, attention output)."""
    kb, vb = kc.bfloat16(), vc.bfloat16()
    kr, vr = kb.clone(), vb.clone()
    kernels.reshape_and_cache(key, value, kb, vb, meta.slot_mapping)
    reference.reshape_and_cache(key, value, kr, vr, meta.slot_mapping)
    assert torch.equal(kb.view(torch.int16), kr.view(torch.int16))
    assert torch.equal(vb.view(torch.int16), vr.view(torch.int16))
    out, same = torch.full_like(query, float("nan")), torch.full_like(query, float("nan"))
    kernels.paged_attention(out, query, kb, vb, meta.block_tables, meta.seq_lens, meta.query_start_loc, d**-0.5)
    kernels.paged_attention(same, query, kb.float(), vb.float(), meta.block_tables, meta.seq_lens,
                            meta.query_start_loc, d**-0.5)
    assert torch.equal(out, same)
    return kb, vb, out


@needs_kernels
def test_bf16_pool_rounding_ties_and_specials():
    """Ties go to the even bf16, the largest floats round to inf as in torch, NaN stays NaN."""
    specials = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 3.4e38, float("inf"),
                             -float("inf"), 0.0, -0.0, 1e-40, float("nan")] + [0.0] * 6).view(1, 2, 8)
    kc, vc = torch.zeros(1, 1, 2, 8, dtype=torch.bfloat16), torch.zeros(1, 1, 2, 8, dtype=torch.bfloat16)
    KERNELS.reshape_and_cache(specials, specials, kc, vc, torch.tensor([0]))
    want = specials.bfloat16()
    finite = ~want.isnan()
    assert torch.equal(kc.view(torch.int16)[0, 0][finite[0]], want.view(torch.int16)[0][finite[0]])
    assert bool(kc[0, 0][~finite[0]].isnan().all())


@needs_kernels
@pytest.mark.parametrize("max_native_query_len", [512, 4], ids=["all-native", "long-chunks-to-torch"])
@pytest.mark.parametrize("block_size,hq,hk,d", [(16, 9, 3, 64), (8, 8, 2, 128), (1, 4, 4, 32)])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["f32-pool", "bf16-pool"])
def test_native_backend_equals_torch_backend_on_mixed_batches(block_size, hq, hk, d, max_native_query_len, pool_dtype):
    query, key, value, kc, vc, meta = _mixed_batch(block_size + hq, block_size, hq, hk, d)
    kc, vc = kc.to(pool_dtype), vc.to(pool_dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    # The torch path attends a fresh chunk to its own K/V as computed, the native kernel to what the pool
    # holds: with a bf16 pool the oracle gets the K/V rounded as the pool stores them.
    kq, vq = (key, value) if pool_dtype == torch.float32 else (key.bfloat16().float(), value.bfloat16().float())
    expected = TorchAttentionBackend().forward(query, kq, vq, (kc, vc), meta, d**-0.5)
    meta.decode_buckets = None
    backend = NativeCpuAttentionBackend(KERNELS)
    backend.max_native_query_len = max_native_query_len  # 4: the 5-13 token chunks take the torch path
    out = backend.forward(query, key, value, (kc2, vc2), meta, d**-0.5)
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc), "the native cache write must store the same rows"
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)


@needs_kernels
@pytest.mark.parametrize("block_size,hq,hk,d", [(16, 9, 3, 64), (8, 8, 2, 128)])
def test_native_backend_serves_a_bfloat16_model(block_size, hq, hk, d):
    """A bfloat16 model's q/k/v go through the kernels widened to float32 (decodes and short chunks) or through
    torch's SDPA in bf16 (the 33- and 40-token prompt chunks): the pool holds the bf16 K/V bit for bit, and the
    output matches float32 attention over the same bf16 values to bf16 precision."""
    query, key, value, kc, vc, meta = _mixed_batch(block_size + hq, block_size, hq, hk, d)
    kc, vc = kc.bfloat16(), vc.bfloat16()
    kc2, vc2 = kc.clone(), vc.clone()
    q16, k16, v16 = query.bfloat16(), key.bfloat16(), value.bfloat16()
    expected = TorchAttentionBackend().forward(q16.float(), k16.float(), v16.float(), (kc, vc), meta, d**-0.5)
    meta.decode_buckets = None
    out = NativeCpuAttentionBackend(KERNELS).forward(q16, k16, v16, (kc2, vc2), meta, d**-0.5)
    assert out.dtype == torch.bfloat16 and out.shape == query.shape
    assert torch.equal(kc2.view(torch.int16), kc.view(torch.int16)) and torch.equal(vc2.view(torch.int16),
                                                                                    vc.view(torch.int16))
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    decode_rows = 20  # the token path: float32 arithmetic, one rounding to bf16 at the end
    torch.testing.assert_close(out[:decode_rows], expected[:decode_rows].bfloat16(), atol=0, rtol=2**-7)


@needs_kernels
def test_backend_checks_each_steps_indices_once_and_refuses_bad_ones():
    """Indices are checked once per step (not per layer), and a new step's bad block id is still refused."""
    query, key, value, kc, vc, meta = _mixed_batch(3, 16, 9, 3, 64)
    backend = NativeCpuAttentionBackend(KERNELS)
    first = backend.forward(query, key, value, (kc, vc), meta, 0.125)
    assert backend._checked_meta is meta
    torch.testing.assert_close(backend.forward(query, key, value, (kc, vc), meta, 0.125), first)  # layer 2
    _, _, _, _, _, bad = _mixed_batch(3, 16, 9, 3, 64)
    bad.block_tables[0, 0] = kc.shape[0]  # one past the pool
    with pytest.raises(ValueError, match="block_tables hold ids outside the pool"):
        backend.forward(query, key, value, (kc, vc), bad, 0.125)


@needs_kernels
def test_reshape_and_cache_skips_padding_and_reads_strided_rows():
    kc, vc = torch.zeros(4, 2, 2, 3), torch.zeros(4, 2, 2, 3)
    rows = torch.arange(3 * 12, dtype=torch.float32).view(3, 12)
    key, value = rows[:, :6].view(3, 2, 3), rows[:, 6:].view(3, 2, 3)
    KERNELS.reshape_and_cache(key, value, kc, vc, torch.tensor([5, -1, 0]))
    assert torch.equal(kc.view(-1, 2, 3)[5], key[0]) and torch.equal(vc.view(-1, 2, 3)[0], value[2])
    assert kc.view(-1, 2, 3)[[1, 2, 3, 4, 6, 7]].abs().sum() == 0, "slot -1 must not be written"


ONE_ROW = torch.tensor([0, 1], dtype=torch.int32)


@needs_kernels
def test_kernels_reject_what_they_cannot_read():
    kc, vc = torch.zeros(4, 2, 1, 8), torch.zeros(4, 2, 1, 8)
    q = torch.zeros(1, 1, 8)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="query must be a float32 CPU tensor"):
        KERNELS.paged_attention(q.clone(), q.double(), kc, vc, tables, lens, ONE_ROW, 1.0)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        KERNELS.paged_attention(q.clone(), q, kc, vc, tables.long(), lens, ONE_ROW, 1.0)
    with pytest.raises(ValueError, match="query must be .* contiguous heads"):
        KERNELS.paged_attention(q.clone(), torch.zeros(1, 8, 2)[:, :, :1].transpose(1, 2), kc, vc, tables, lens, ONE_ROW, 1.0)
    with pytest.raises(ValueError, match="slot_mapping must be a contiguous int64"):
        KERNELS.reshape_and_cache(q, q, kc, vc, torch.zeros(1, dtype=torch.int32))
    # Indices the C code would follow out of the pool are refused before any pointer is handed over.
    with pytest.raises(ValueError, match="block_tables hold ids outside the pool of 4 blocks"):
        KERNELS.paged_attention(q.clone(), q, kc, vc, torch.full((1, 1), 4, dtype=torch.int32), lens, ONE_ROW, 1.0)
    with pytest.raises(ValueError, match=r"seq_lens must be in \[1, 2\]"):
        KERNELS.paged_attention(q.clone(), q, kc, vc, tables, torch.full((1,), 3, dtype=torch.int32), ONE_ROW, 1.0)
    with pytest.raises(ValueError, match="query_start_loc must rise from 0 to the 1 query rows"):
        KERNELS.paged_attention(q.clone(), q, kc, vc, tables, lens, torch.tensor([0, 2], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="at least each sequence's query length"):
        q2 = torch.zeros(2, 1, 8)
        KERNELS.paged_attention(q2.clone(), q2, kc, vc, tables, lens, torch.tensor([0, 2], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="slot_mapping holds slots beyond the pool's 8"):
        KERNELS.reshape_and_cache(q, q, kc, vc, torch.tensor([8]))


# ------------------------------------------------------------------------------------ fused elementwise ops


def _ulp_close(out: torch.Tensor, ref: torch.Tensor, max_ulps: int = 8) -> None:
    """float32 results within a few ulps of the torch ops (only the summation order / FMA contraction differ)."""
    diff = (out - ref).abs()
    ulp = torch.finfo(torch.float32).eps * ref.abs().clamp_min(torch.finfo(torch.float32).tiny)
    assert (diff <= max_ulps * ulp + 1e-30).all(), f"max {(diff / ulp).max().item():.1f} ulps"


@needs_kernels
@pytest.mark.parametrize("tokens,hidden", [(1, 576), (37, 96), (300, 576), (5, 17)])
def test_rms_norm_and_fused_add_match_torch(tokens, hidden):
    g = torch.Generator().manual_seed(hidden + tokens)
    norm = RMSNorm(hidden, 1e-5, torch.float32)
    norm.weight.data.copy_(1 + 0.5 * torch.randn(hidden, generator=g))
    wide = 3 * torch.randn(tokens, hidden + 7, generator=g)
    x = wide[:, 3 : 3 + hidden]  # strided rows
    residual = 4 * torch.randn(tokens, hidden, generator=g)
    x0, r0 = x.clone(), residual.clone()
    _ulp_close(KERNELS.rms_norm(x, norm.weight, norm.eps), norm.forward_native(x))
    out, new_res = KERNELS.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    ref_out, ref_res = norm.forward_native(x, residual)
    assert torch.equal(x, x0) and torch.equal(residual, r0), "inputs must not be written"
    assert torch.equal(new_res, ref_res)
    _ulp_close(out, ref_out)


@needs_kernels
@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (8, 2, 128), (4, 4, 32), (3, 1, 80)])
def test_rotary_in_place_matches_torch(hq, hk, d, kernels_by_isa):
    """Bit for bit at every ISA level this CPU runs (AVX2 and portable forced too): the C rotation is torch's
    x·cos + rotate_half(x)·sin element for element (a·c - b·s, b·c + a·s: the same two products and one add, the
    negation exact) and gcc under -std=c11 contracts nothing into an FMA."""
    rope = RotaryEmbedding(d, 4096, {"rope_type": "default", "rope_theta": 10000.0}, torch.float32)
    t = 41
    for isa, kernels in kernels_by_isa.items():
        g = torch.Generator().manual_seed(hq * d)
        qkv = 8 * torch.randn(t, (hq + 2 * hk) * d, generator=g)
        q, k = qkv[:, : hq * d], qkv[:, hq * d : (hq + hk) * d]
        positions = torch.randint(0, 4096, (t,), generator=g)
        ref_q, ref_k = rope.forward_native(positions, q, k)
        v_before = qkv[:, (hq + hk) * d :].clone()
        kernels.rotary_embedding(positions, q, k, rope.cos_cache, rope.sin_cache, d)
        assert torch.equal(q, ref_q) and torch.equal(k, ref_k), isa
        assert torch.equal(qkv[:, (hq + hk) * d :], v_before), "V columns must be untouched"
        with pytest.raises(ValueError, match="beyond the rotary cache"):
            kernels.rotary_embedding(torch.full((t,), 4096), q, k, rope.cos_cache, rope.sin_cache, d)


@needs_kernels
@pytest.mark.parametrize("tokens,inter", [(1, 1536), (64, 1536), (7, 100)])
def test_silu_and_mul_matches_torch(tokens, inter):
    g = torch.Generator().manual_seed(inter)
    x = 4 * torch.randn(tokens, 2 * inter, generator=g)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(KERNELS.silu_and_mul(x), F.silu(gate) * up, atol=1e-6, rtol=4e-6)


# ------------------------------------------------------------------------------------------ build and opt-out


def test_opt_out_and_missing_compiler_fall_back_to_torch(monkeypatch, tmp_path, caplog):
    try:
        monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "torch")
        cpu_kernels.load_cpu_kernels.cache_clear()
        assert cpu_kernels.load_cpu_kernels() is None
        monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "native")
        monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
        monkeypatch.setenv("CC", "/bin/false")
        cpu_kernels.load_cpu_kernels.cache_clear()
        with caplog.at_level("WARNING", logger="pagedllm"):
            assert cpu_kernels.load_cpu_kernels() is None
        assert "CPU kernels unavailable" in caplog.text and "failed" in caplog.text
        monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "fast")
        with pytest.raises(ValueError, match="PAGEDLLM_CPU_KERNELS='fast' is not one of"):
            cpu_kernels.kernels_choice()
    finally:
        cpu_kernels.load_cpu_kernels.cache_clear()


# ------------------------------------------------------------------------------------------------ oneDNN GEMM


@pytest.mark.skipif(not cpu_linear.onednn_linear_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("dtype,tol", [
    (torch.float32, 1e-5),
    pytest.param(torch.bfloat16, 2e-2, marks=pytest.mark.skipif(
        cpu_linear.bf16_packing_unsupported_reason() is not None,
        reason=f"no bfloat16 packing here: {cpu_linear.bf16_packing_unsupported_reason()}")),
], ids=str)
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_matches_f_linear(dtype, tol, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(rows, 80, generator=g).to(dtype)
    packed = cpu_linear.pack_linear_weight(w)
    out = cpu_linear.packed_linear(x, packed, b)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), F.linear(x, w, b).float(), atol=tol * 10, rtol=tol)
    with pytest.raises(ValueError, match="oneDNN packing takes a CPU weight"):
        cpu_linear.pack_linear_weight(w.half())


def test_gemm_row_plan_uses_few_shapes_and_wastes_little():
    """Exact up to 16 rows, then 8 sizes per octave; padding at most 1/8 of the rows (1 % from 512 rows)."""
    plan = cpu_linear.gemm_row_plan
    assert [plan(r) for r in (0, 1, 16, 17)] == [[], [(1, 1)], [(16, 16)], [(17, 18)]]
    assert plan(1151) == [(1024, 1024), (127, 128)]
    sizes = set()
    for rows in range(1, 4097):
        p = plan(rows)
        assert sum(n for n, _ in p) == rows and len(p) <= 2
        assert all(run >= n and run - n <= n / 8 for n, run in p)
        assert sum(run for _, run in p) <= rows * (1.01 if rows >= cpu_linear.SPLIT_ROWS else 1.125)
        sizes.update(run for _, run in p)
    assert len(sizes) == 16 + 8 * 8  # 16 exact + 8 octaves (16..4096) of 8


@pytest.mark.skipif(not cpu_linear.onednn_linear_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("shape", [(17, 80), (100, 80), (3, 37, 80), (1151, 80)], ids=str)
def test_padded_packed_linear_matches_f_linear(shape):
    """Padded and split row counts (and [..., in] inputs) give the same rows as F.linear, in x's shape."""
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 80, generator=g), torch.randn(96, generator=g)
    x = torch.randn(*shape, generator=g)
    out = cpu_linear.packed_linear(x, cpu_linear.pack_linear_weight(w), b)
    assert out.shape == (*shape[:-1], 96) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not cpu_linear.onednn_linear_available(), reason="torch built without oneDNN")
@pytest.mark.skipif(not cpu_memory.glibc_mallinfo_available(), reason="needs glibc's mallinfo2")
def test_packed_linear_native_memory_is_bounded_over_row_counts():
    """Every row count 1..600 through one weight: oneDNN caches one ~0.6 MiB primitive per shape, so
    exact shapes held 308 MiB here, the bucket sizes 31 MiB (the soak: server memory stays flat)."""
    w = cpu_linear.pack_linear_weight(torch.randn(40, 72))  # a shape no other test uses: a cold cache
    x = torch.randn(600, 72)
    cpu_linear.packed_linear(x[:1], w, None)
    before = cpu_memory.malloc_in_use_bytes()
    for rows in range(1, 601):
        cpu_linear.packed_linear(x[:rows], w, None)
    grown_mib = (cpu_memory.malloc_in_use_bytes() - before) / 2**20
    assert grown_mib < 120, f"native memory grew {grown_mib:.0f} MiB over 600 row counts"


@pytest.mark.skipif(not cpu_linear.onednn_linear_available(), reason="torch built without oneDNN")
def test_reloaded_weights_are_repacked(hf_model):
    """Worker.load_weights repacks: the oneDNN copy never goes stale (the throughput benchmark reloads)."""
    from pagedllm import LLM

    llm = LLM(num_gpu_blocks_override=64, max_model_len=256)
    worker = llm.llm_engine.executor.driver_worker
    down = worker.model.model.layers[0].mlp.down_proj
    assert down.packed_weight is not None
    out_features, in_features = down.weight_shape()  # float32: the dense copy is released after packing
    x = torch.randn(5, in_features)
    new = torch.randn(out_features, in_features)
    weights = dict(hf_model.state_dict())
    weights["model.layers.0.mlp.down_proj.weight"] = new
    worker.load_weights(iter(weights.items()))
    torch.testing.assert_close(down.matmul(x, None), F.linear(x, new), atol=1e-4, rtol=1e-4)
    x = torch.randn(300, in_features)  # oneDNN's row counts
    torch.testing.assert_close(down.matmul(x, None), F.linear(x, new), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not cpu_linear.onednn_linear_available(), reason="torch built without oneDNN")
def test_one_float32_row_runs_the_dense_weight(monkeypatch):
    """A packed layer sends one float32 row to F.linear on its dense weight (exactly F.linear's bits) and
    more rows to the packed GEMM."""
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(96, 80, generator=g), torch.randn(96, generator=g)
    packed = cpu_linear.pack_linear_weight(w)
    calls = []
    real = cpu_linear.packed_linear
    monkeypatch.setattr(cpu_linear, "packed_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    for shape in ((1, 80), (1, 1, 80), (2, 80)):
        x = torch.randn(*shape, generator=g)
        out = cpu_linear.cpu_linear_forward(x, w, packed, b)
        assert out.shape == (*shape[:-1], 96)
        if x.numel() == 80:
            assert torch.equal(out, F.linear(x, w, b))
        else:
            torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    assert calls == [(2, 80)]
