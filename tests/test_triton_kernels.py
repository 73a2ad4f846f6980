"""Triton kernels against the plain-torch reference (kernels/reference.py).

On a CUDA machine the kernels run compiled, over the full grid of block sizes / head dims / GQA ratios
in float32 and bfloat16, plus greedy parity of the engine with HF transformers. Without CUDA they run
under Triton's interpreter (TRITON_INTERPRET=1) at small sizes in float32 / float16 (the interpreter's
``tl.dot`` mishandles bfloat16), or are skipped when Triton is not installed.
"""
from __future__ import annotations

import random

import pytest
import torch

from triton_setup import DEVICE, ON_CUDA, interpreter_numpy_shim  # sets TRITON_INTERPRET without CUDA

triton = pytest.importorskip("triton")
interpreter_numpy_shim()

from pagedllm.kernels import kv_layout, reference, triton_attention, triton_cache_ops  # noqa: E402
from pagedllm.kernels.metadata import AttentionMetadata  # noqa: E402


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _make_batch(rng: random.Random, dtype, block_size: int, head_dim: int, kv_heads: int, group: int,
                seq_lens: list[int], query_lens: list[int]):
    """Random caches with shuffled block tables; decodes first (query_len 1), then prefill chunks."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    hq = kv_heads * group
    nblocks = [-(-n // block_size) for n in seq_lens]
    total = sum(nblocks) + 5
    key_cache = torch.randn(total, block_size, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    value_cache = torch.randn(total, block_size, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    perm = torch.randperm(total, generator=g).tolist()
    tables, i = [], 0
    for n in nblocks:
        tables.append(perm[i : i + n])
        i += n
    width = max(nblocks) + 2  # padded with zeros like the model runner does
    bt = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for r, t in enumerate(tables):
        bt[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
    query = torch.randn(sum(query_lens), hq, head_dim, generator=g).to(DEVICE, dtype)
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    nd = 0
    while nd < len(query_lens) and query_lens[nd] == 1:
        nd += 1
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=DEVICE),
        block_tables=bt.to(DEVICE), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=cu.to(DEVICE), seq_lens_cpu=list(seq_lens), query_lens_cpu=list(query_lens),
        num_decodes=nd, max_seq_len=max(seq_lens), max_query_len=max(query_lens),
    )
    return query, key_cache, value_cache, meta


def _reference(query, key_cache, value_cache, meta, scale):
    """The torch reference in float32 (keys/values read from the cache, so `key`/`value` are unused
    except for chunks with no context, where they equal the cached rows)."""
    q, kc, vc = query.float(), key_cache.float(), value_cache.float()
    fresh_k = torch.empty(q.shape[0], kc.shape[2], kc.shape[3], device=q.device)
    fresh_v = torch.empty_like(fresh_k)
    bs = kc.shape[1]
    for i in range(meta.num_seqs):
        start, end = int(meta.query_start_loc[i]), int(meta.query_start_loc[i + 1])
        ctx = meta.seq_lens_cpu[i] - (end - start)
        for j in range(end - start):
            p = ctx + j
            blk = int(meta.block_tables[i, p // bs])
            fresh_k[start + j], fresh_v[start + j] = kc[blk, p % bs], vc[blk, p % bs]
    return reference.paged_attention(q, fresh_k, fresh_v, kc, vc, meta, scale)


def _ragged_step(rng: random.Random, block_size: int, last_chunk: tuple[int, int]) -> tuple[list[int], list[int]]:
    """(seq_lens, query_lens): ragged decodes (one of them long enough to split), then a fresh prompt and two
    chunks with context, the last one `last_chunk` tokens long (a range)."""
    long = 600 if ON_CUDA else 90
    seq_lens = [rng.randint(1, 40), rng.randint(41, long), 1, rng.randint(2, long)]
    prefill_q = [rng.randint(2, 40), rng.randint(1, 30), rng.randint(*last_chunk)]
    prefill_ctx = [0, rng.randint(1, 70), rng.randint(block_size, 2 * block_size)]
    return seq_lens + [q + c for q, c in zip(prefill_q, prefill_ctx)], [1, 1, 1, 1] + prefill_q


_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
_DTYPES = [torch.float32, torch.bfloat16] if ON_CUDA else [torch.float32, torch.float16]
if ON_CUDA:
    _SHAPES = [(bs, d, g) for bs in (8, 16, 32) for d in (64, 128) for g in (1, 4, 8)]
else:  # interpreter: a covering subset at small sizes
    _SHAPES = [(8, 64, 4), (16, 128, 1), (32, 64, 8)]


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("block_size,head_dim,group", _SHAPES)
def test_paged_attention_matches_reference(dtype, block_size, head_dim, group):
    rng = random.Random(block_size * 1000 + head_dim * 10 + group + (7 if dtype == torch.float32 else 0))
    kv_heads = 2
    scale = head_dim**-0.5
    seq_lens, query_lens = _ragged_step(rng, block_size, last_chunk=(1, 30))
    query, kc, vc, meta = _make_batch(rng, dtype, block_size, head_dim, kv_heads, group, seq_lens, query_lens)
    out = torch.full_like(query, float("nan"))  # every element must be written
    triton_attention.paged_attention(query, kc, vc, meta, scale, out=out)
    ref = _reference(query, kc, vc, meta, scale)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < _TOL[dtype]


@pytest.mark.skipif(not ON_CUDA, reason="1000+-token chunks are too slow for the interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_long_prefill_chunks_match_reference(dtype):
    """A 1100-token chunk after 700 tokens of context, a fresh 1030-token prompt and a short chunk beside
    them (the 64 x 64 tiles of prefill_launch over many row tiles) match the reference."""
    assert triton_attention.prefill_launch(128, 16, 2) == (64, 64, 4, 3)
    rng = random.Random(11)
    query_lens = [1100, 1030, 37]
    seq_lens = [1100 + 700, 1030, 37 + 90]
    query, kc, vc, meta = _make_batch(rng, dtype, 16, 128, 2, 4, seq_lens, query_lens)
    out = torch.full_like(query, float("nan"))
    triton_attention.paged_attention(query, kc, vc, meta, 128**-0.5, out=out)
    assert not out.isnan().any()
    assert _rel_err(out, _reference(query, kc, vc, meta, 128**-0.5)) < _TOL[dtype]


def _padded_layout(meta, num_rows: int, max_seqs: int):
    """The step's layout in static-sized buffers as a whole-step graph holds them: `max_seqs` sequences
    (padding ones with no query rows and garbage tables), `num_rows` query rows (padding rows past the step)."""
    n = meta.num_seqs
    t = int(meta.query_start_loc[-1])
    bt = torch.randint(0, 3, (max_seqs, meta.block_tables.shape[1] + 3), dtype=torch.int32).to(DEVICE)
    bt[:n, : meta.block_tables.shape[1]] = meta.block_tables
    seq_lens = torch.randint(1, 50, (max_seqs,), dtype=torch.int32).to(DEVICE)
    seq_lens[:n] = meta.seq_lens
    qsl = torch.full((max_seqs + 1,), t, dtype=torch.int32, device=DEVICE)
    qsl[: n + 1] = meta.query_start_loc
    return bt, seq_lens, qsl


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("block_size,head_dim,group", _SHAPES + [(16, 64, 3)])
def test_unified_attention_matches_reference(dtype, block_size, head_dim, group):
    """One launch over decodes and chunks alike, its grid from the static sizes only (padding rows and
    sequences, as a whole-step graph replays it), matches the reference on the real rows and leaves the
    padding rows untouched."""
    from pagedllm.kernels.triton_unified_attention import unified_attention

    rng = random.Random(block_size * 7 + head_dim + group)
    seq_lens, query_lens = _ragged_step(rng, block_size, last_chunk=(17, 45))  # several 16-row tiles
    query, kc, vc, meta = _make_batch(rng, dtype, block_size, head_dim, 2, group, seq_lens, query_lens)
    t = query.shape[0]
    padded_q = torch.cat([query, torch.randn(13, *query.shape[1:], device=DEVICE).to(dtype)])
    bt, lens, qsl = _padded_layout(meta, t + 13, max_seqs=12)
    out = torch.full_like(padded_q, float("nan"))
    unified_attention(padded_q, kc, vc, bt, lens, qsl, head_dim**-0.5, out)
    assert not out[:t].isnan().any()
    assert out[t:].isnan().all()  # padding rows: never written
    assert _rel_err(out[:t], _reference(query, kc, vc, meta, head_dim**-0.5)) < _TOL[dtype]


def test_whole_step_staging_serves_successive_layouts_from_one_static_metadata():
    """The whole-step graphs' static metadata, staged step after step (7 sequences, then 2, then 7 with other
    tables, then one prompt: fewer slots and narrower tables than the step before leave stale entries behind),
    gives the unified kernel each step's reference attention; padding rows get KV slot -1 and stay unwritten."""
    from pagedllm.kernels.triton_unified_attention import unified_attention
    from pagedllm.worker.piecewise_graph import stage_whole_step, static_whole_metadata

    rng = random.Random(21)
    bucket, dtype = 128, torch.float32
    layouts = [_ragged_step(rng, 16, last_chunk=(17, 30)), ([5, 30], [1, 12]), _ragged_step(rng, 16, (2, 9)),
               ([40], [40])]
    width = max(-(-max(seq_lens) // 16) + 2 for seq_lens, _ in layouts)  # _make_batch's widest table
    static = static_whole_metadata(bucket, max_seqs=9, table_width=width, device=torch.device(DEVICE))
    for seq_lens, query_lens in layouts:
        query, kc, vc, meta = _make_batch(rng, dtype, 16, 64, 2, 3, seq_lens, query_lens)
        t = query.shape[0]
        meta.slot_mapping = torch.arange(t, device=DEVICE)
        stage_whole_step(static, t, bucket, meta)
        assert static.slot_mapping[:t].tolist() == list(range(t)) and (static.slot_mapping[t:] == -1).all()
        rows = torch.cat([query, torch.randn(bucket - t, *query.shape[1:], device=DEVICE)])
        out = torch.full_like(rows, float("nan"))
        unified_attention(rows, kc, vc, static.block_tables, static.seq_lens, static.query_start_loc, 0.125, out)
        assert out[t:].isnan().all()
        assert _rel_err(out[:t], _reference(query, kc, vc, meta, 0.125)) < _TOL[dtype]


def test_unified_attention_rejects_mismatched_layout():
    from pagedllm.kernels.triton_unified_attention import unified_attention

    q = torch.zeros(4, 2, 64, device=DEVICE)
    kc = torch.zeros(3, 8, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="3 sequence lengths need 4 query start offsets"):
        unified_attention(q, kc, kc, torch.zeros(3, 2, dtype=torch.int32, device=DEVICE),
                          torch.ones(3, dtype=torch.int32, device=DEVICE),
                          torch.zeros(3, dtype=torch.int32, device=DEVICE), 0.1, torch.empty_like(q))


@pytest.mark.parametrize("num_splits", [1, 2, 5, 16])
def test_decode_split_kv_is_exact_reduction(num_splits):
    """Flash-decoding: any split count gives the same attention (empty splits included)."""
    rng = random.Random(num_splits)
    seq_lens = [3, 77, 200, 129] if ON_CUDA else [3, 77, 50]
    query, kc, vc, meta = _make_batch(rng, torch.float32, 16, 64, 2, 4, seq_lens, [1] * len(seq_lens))
    out = triton_attention.paged_decode_attention(
        query, kc, vc, meta.block_tables, meta.seq_lens, 0.125, max(seq_lens), num_splits=num_splits
    )
    ref = _reference(query, kc, vc, meta, 0.125)
    assert _rel_err(out, ref) < 2e-5


def _decode(query, kc, vc, meta, **kw) -> torch.Tensor:
    out = torch.full_like(query, float("nan"))  # every element must be written
    return triton_attention.paged_decode_attention(query, kc, vc, meta.block_tables, meta.seq_lens, 0.125,
                                                   max(meta.seq_lens_cpu), out=out, **kw)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 16])
def test_fused_reduction_matches_separate_and_resets_its_counters(num_splits):
    """The single-launch merge (last split to finish) equals the two-kernel one; empty splits add nothing."""
    rng = random.Random(100 + num_splits)
    seq_lens = [3, 77, 200, 129] if ON_CUDA else [3, 77, 50]
    query, kc, vc, meta = _make_batch(rng, torch.float32, 16, 64, 2, 4, seq_lens, [1] * len(seq_lens))
    ws = triton_attention.DecodeWorkspace.allocate(DEVICE)
    fused = _decode(query, kc, vc, meta, num_splits=num_splits, workspace=ws)
    separate = _decode(query, kc, vc, meta, num_splits=num_splits, reduce="separate")
    assert not fused.isnan().any()
    torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-6)
    assert _rel_err(fused, _reference(query, kc, vc, meta, 0.125)) < 2e-5
    if num_splits > 1:
        assert ws.counters.numel() >= len(seq_lens) * 2 and not ws.counters.any()
    # Merging two splits at a time gives the same result; the counters are zero again after each launch.
    again = _decode(query, kc, vc, meta, num_splits=num_splits, workspace=ws, merge_chunk=2)
    torch.testing.assert_close(again, fused, rtol=1e-5, atol=1e-6)
    assert not ws.counters.any()


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_preloaded_table_row_equals_per_tile_table_loads(num_splits):
    """Loading the whole block-table row up front reads the same blocks as loading each tile's entries;
    padding past a sequence's blocks (-1 here, as garbage) is never used either way."""
    rng = random.Random(300 + num_splits)
    seq_lens = [3, 77, 200, 129] if ON_CUDA else [3, 77, 50]
    query, kc, vc, meta = _make_batch(rng, torch.float32, 16, 64, 2, 4, seq_lens, [1] * len(seq_lens))
    ref = _reference(query, kc, vc, meta, 0.125)
    for row, n in enumerate(seq_lens):
        meta.block_tables[row, -(-n // 16):] = -1
    preloaded = _decode(query, kc, vc, meta, num_splits=num_splits, preload_table=True)
    per_tile = _decode(query, kc, vc, meta, num_splits=num_splits, preload_table=False)
    assert not preloaded.isnan().any()
    torch.testing.assert_close(preloaded, per_tile, rtol=1e-6, atol=1e-7)
    assert _rel_err(preloaded, ref) < 2e-5


def test_decode_without_tl_gather_falls_back_to_per_tile_table_loads(monkeypatch):
    """Triton < 3.2 has no tl.gather: the default reads the table per tile; asking for the preload says why not."""
    rng = random.Random(400)
    query, kc, vc, meta = _make_batch(rng, torch.float32, 16, 64, 2, 4, [3, 77, 50], [1, 1, 1])
    monkeypatch.delattr(triton_attention.tl, "gather")
    out = _decode(query, kc, vc, meta, num_splits=2)
    assert _rel_err(out, _reference(query, kc, vc, meta, 0.125)) < 2e-5
    with pytest.raises(ValueError, match="tl.gather"):
        _decode(query, kc, vc, meta, preload_table=True)


def test_decode_workspace_is_reused_and_grows():
    rng = random.Random(5)
    small = _make_batch(rng, torch.float32, 16, 64, 2, 4, [40, 90], [1, 1])
    large = _make_batch(rng, torch.float32, 16, 64, 2, 4, [33, 70, 5, 61, 88], [1] * 5)
    ws = triton_attention.DecodeWorkspace.allocate(DEVICE)

    def check(batch) -> None:
        query, kc, vc, meta = batch
        out = _decode(query, kc, vc, meta, num_splits=4, workspace=ws)
        assert _rel_err(out, _reference(query, kc, vc, meta, 0.125)) < 2e-5
        assert not ws.counters.any()

    check(small)
    check(small)
    buffers = (ws.counters, ws.part_out, ws.part_ml)
    assert ws.counters.numel() >= 2 * 2 and ws.part_out.numel() >= 2 * 8 * 4 * 64 and not ws.retired
    check(large)  # more sequences: counters (zeroed) and partials grow
    assert ws.counters.numel() >= 5 * 2 and ws.part_out.numel() >= 5 * 8 * 4 * 64
    assert all(a is b for a, b in zip(ws.retired, buffers))  # kept alive for graphs captured before
    grown = (ws.counters, ws.part_out, ws.part_ml)
    check(small)  # fewer sequences: the same buffers, never shrunk
    assert all(a is b for a, b in zip((ws.counters, ws.part_out, ws.part_ml), grown))


def test_triton_backend_owns_one_workspace_per_device():
    from pagedllm.model.layers.attention import TritonAttentionBackend

    backend = TritonAttentionBackend()
    rng = random.Random(6)
    for seq_lens in ([90, 7], [50, 3, 100]):  # two splits each (CPU: 4 "SMs")
        query, kc, vc, meta = _make_batch(rng, torch.float32, 16, 64, 2, 4, seq_lens, [1] * len(seq_lens))
        no_tokens = torch.empty(0, 2, 64, device=DEVICE)  # nothing to cache: K/V are already in kc / vc
        out = backend.forward(query, no_tokens, no_tokens, (kc, vc), meta, 0.125)
        assert _rel_err(out, _reference(query, kc, vc, meta, 0.125)) < 2e-5
    (ws,) = backend.workspaces.values()
    assert ws.device == query.device and ws.counters.numel() >= 3 * 2 and not ws.counters.any()


def test_choose_num_splits_fills_the_device_without_sync():
    dev = torch.device(DEVICE)
    few = triton_attention.choose_num_splits(1, 1, 8192, 64, dev)
    many = triton_attention.choose_num_splits(256, 8, 8192, 64, dev)
    short = triton_attention.choose_num_splits(1, 8, 64, 64, dev)
    assert few > 1 and many == 1 and short == 1


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_reshape_and_cache_matches_reference_and_skips_padding(dtype):
    g = torch.Generator().manual_seed(3)
    blocks, bs, heads, dim = 7, 8, 4, 64
    kc = torch.randn(blocks, bs, heads, dim, generator=g).to(DEVICE, dtype)
    vc = torch.randn(blocks, bs, heads, dim, generator=g).to(DEVICE, dtype)
    # K/V as strided views of one fused projection, like the model's qkv split.
    qkv = torch.randn(9, 3 * heads * dim, generator=g).to(DEVICE, dtype)
    key = qkv[:, heads * dim : 2 * heads * dim].view(9, heads, dim)
    value = qkv[:, 2 * heads * dim :].view(9, heads, dim)
    slots = torch.tensor([5, -1, 0, 55, 17, -1, 8, 31, 40], device=DEVICE)
    ref_k, ref_v = kc.clone(), vc.clone()
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots)
    triton_cache_ops.reshape_and_cache(key, value, kc, vc, slots)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


def test_copy_blocks_all_layers_in_one_launch():
    g = torch.Generator().manual_seed(4)
    shape = (9, 16, 2, 64)
    keys = [torch.randn(*shape, generator=g).to(DEVICE) for _ in range(3)]
    values = [torch.randn(*shape, generator=g).to(DEVICE) for _ in range(3)]
    mapping = torch.tensor([[0, 4], [2, 3], [8, 1]], device=DEVICE)
    ref_k, ref_v = [k.clone() for k in keys], [v.clone() for v in values]
    reference.copy_blocks(ref_k, ref_v, mapping)
    triton_cache_ops.copy_blocks(keys, values, mapping)
    assert all(torch.equal(a, b) for a, b in zip(keys + values, ref_k + ref_v))


@pytest.mark.parametrize("head_major", [False, True])
def test_swap_blocks_between_the_device_pool_and_a_pinned_host_pool(head_major):
    """Swaps and the KV offloading tier's copies: every layer's K and V, device → pinned host and back, one launch
    each way, the host pool read and written in place (under the interpreter both pools are host tensors)."""
    g = torch.Generator().manual_seed(6)
    layout = kv_layout.HEAD_MAJOR if head_major else kv_layout.SLOT_MAJOR

    def pool(blocks: int, device: str, pin: bool = False) -> torch.Tensor:
        storage = torch.randn(kv_layout.physical_shape((blocks, 16, 2, 64), layout), generator=g)
        storage = storage.pin_memory() if pin else storage.to(device)
        return kv_layout.logical_view(storage, layout)

    dev = [pool(9, DEVICE) for _ in range(4)]  # K, V of two layers
    host = [pool(5, "cpu", pin=ON_CUDA) for _ in range(4)]
    ref_dev, ref_host = [d.clone() for d in dev], [h.clone() for h in host]
    out = torch.tensor([[0, 4], [8, 1], [3, 0]], device=DEVICE)  # (device block, host block)
    for src, dst in zip(ref_dev, ref_host):
        reference.swap_blocks(src, dst, out.cpu())
    triton_cache_ops.swap_blocks(dev, host, out)
    back = torch.tensor([[4, 2], [1, 7]], device=DEVICE)  # (host block, device block)
    for src, dst in zip(ref_host, ref_dev):
        reference.swap_blocks(src, dst, back.cpu())
    triton_cache_ops.swap_blocks(host, dev, back)
    if ON_CUDA:
        torch.cuda.synchronize()
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(dev + host, ref_dev + ref_host))
    with pytest.raises(ValueError, match="one destination cache per source"):
        triton_cache_ops.swap_blocks(dev, host[:1], out)


def _head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values in a head-major pool (what CUDA pools are, ``kv_layout``)."""
    pool = kv_layout.to_layout(cache, kv_layout.HEAD_MAJOR)
    assert kv_layout.layout_of(pool) == kv_layout.HEAD_MAJOR and torch.equal(pool, cache)
    return pool


def test_head_major_pool_gives_the_same_attention_bits():
    """Decodes and prefill chunks read a head-major pool through its strides: bit-identical output."""
    rng = random.Random(21)
    seq_lens = [5, 70, 1, 33 + 20, 12]
    query_lens = [1, 1, 1, 20, 12]
    query, kc, vc, meta = _make_batch(rng, torch.float32, 16, 64, 2, 4, seq_lens, query_lens)
    out_slot = triton_attention.paged_attention(query, kc, vc, meta, 0.125, out=torch.empty_like(query))
    out_head = triton_attention.paged_attention(query, _head_major(kc), _head_major(vc), meta, 0.125,
                                                out=torch.empty_like(query))
    assert torch.equal(out_slot, out_head)


def test_reshape_and_cache_and_copy_blocks_on_a_head_major_pool():
    g = torch.Generator().manual_seed(5)
    blocks, bs, heads, dim = 7, 8, 4, 64
    kc = torch.randn(blocks, bs, heads, dim, generator=g).to(DEVICE)
    vc = torch.randn(blocks, bs, heads, dim, generator=g).to(DEVICE)
    key = torch.randn(6, heads, dim, generator=g).to(DEVICE)
    value = torch.randn(6, heads, dim, generator=g).to(DEVICE)
    slots = torch.tensor([5, -1, 0, 55, 17, 31], device=DEVICE)
    hk, hv = _head_major(kc), _head_major(vc)
    ref_k, ref_v = _head_major(kc), _head_major(vc)  # the torch reference writes a head-major pool too
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots)
    reference.reshape_and_cache(key, value, kc, vc, slots)
    triton_cache_ops.reshape_and_cache(key, value, hk, hv, slots)
    assert torch.equal(hk, kc) and torch.equal(hv, vc) and torch.equal(ref_k, kc) and torch.equal(ref_v, vc)
    mapping = torch.tensor([[0, 4], [6, 1]], device=DEVICE)
    reference.copy_blocks([kc], [vc], mapping)
    triton_cache_ops.copy_blocks([hk], [hv], mapping)
    assert torch.equal(hk, kc) and torch.equal(hv, vc)
    with pytest.raises(ValueError, match="one layout"):
        triton_cache_ops.reshape_and_cache(key, value, hk, vc, slots)
    with pytest.raises(ValueError, match="layout"):
        triton_cache_ops.copy_blocks([hk], [vc], mapping)


def test_kernels_reject_bad_shapes():
    q = torch.randn(2, 6, 64, device=DEVICE)
    kc = torch.randn(4, 16, 4, 64, device=DEVICE)  # 6 query heads over 4 KV heads
    bt = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="multiple"):
        triton_attention.paged_decode_attention(q, kc, kc, bt, torch.ones(2, dtype=torch.int32, device=DEVICE), 1.0, 1)
    with pytest.raises(ValueError, match="reduce"):
        triton_attention.paged_decode_attention(q[:, :4], kc, kc, bt, torch.ones(2, dtype=torch.int32, device=DEVICE),
                                                1.0, 1, reduce="twice")
    with pytest.raises(ValueError, match="slot_mapping"):
        k = torch.randn(3, 4, 64, device=DEVICE)
        triton_cache_ops.reshape_and_cache(k, k, kc, kc.clone(), torch.zeros(2, dtype=torch.int64, device=DEVICE))


@pytest.mark.cuda
def test_engine_greedy_matches_hf_on_cuda(tmp_path):
    """A random-weight Llama (GQA) on CUDA through the Triton backend equals HF transformers in float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm import LLM, SamplingParams

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    hf = LlamaForCausalLM(cfg).to("cuda", torch.float32).eval()
    for p in hf.parameters():  # larger-than-default weights so logits are well separated
        p.data.normal_(0, 0.08)
    hf.save_pretrained(tmp_path)
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 1024) for _ in range(n)] for n in (5, 17, 40, 3, 90, 33)]
    max_tokens = 24
    hf_out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                            min_new_tokens=max_tokens, pad_token_id=0)
            hf_out.append(g[0, len(p):].tolist())
    del hf
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", device="cuda",
              num_gpu_blocks_override=256, max_model_len=256, block_size=16, max_num_batched_tokens=64)
    assert llm.llm_engine is not None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    ours = [o.outputs[0].token_ids for o in outs]
    for i, (a, b) in enumerate(zip(ours, hf_out)):
        assert list(a) == b, f"prompt {i}: pagedllm {list(a)} != hf {b}"


@pytest.mark.cuda
def test_gpu_pool_sized_by_profiling(tmp_path):
    """Without an override, the CUDA pool comes from profiling and fits at least one max_model_len sequence."""
    from transformers import LlamaConfig

    from pagedllm import LLM, SamplingParams

    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    cfg.save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), load_format="dummy", skip_tokenizer_init=True, device="cuda",
              max_model_len=512, gpu_memory_utilization=0.3)
    total = llm.stats()["kv_blocks_total"]
    assert total * 16 >= 512
    free, whole = torch.cuda.mem_get_info()
    assert total * 2 * 2 * 16 * 2 * 32 * 2 <= 0.3 * whole  # 2 layers × K,V × 16 tok × 2 heads × 32 dim × bf16
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=str(tmp_path), load_format="dummy", skip_tokenizer_init=True, device="cuda",
            max_model_len=512, gpu_memory_utilization=1e-6)
