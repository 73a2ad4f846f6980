"""PagedAttention in Triton: decode (split-KV / flash-decoding) and prefill chunks over paged KV.

Cache layout as in ``kernels/reference.py``: ``[num_blocks, block_size, num_kv_heads, head_dim]``, read
through its strides (head_dim contiguous), so slot-major and head-major pools (``kv_layout``) both work.
Both kernels gather K/V rows through the block table (``table[pos // block_size]``), so a tile may
span several blocks of any size, and use an online softmax (eq. 4 of the paper).

* Decode: one program per (sequence, KV head, split). All query heads sharing the KV head form the
  rows of one tile (padded to ≥ 16 so ``tl.dot`` uses tensor cores); each split covers an equal share
  of the sequence's context, computed in-kernel from ``seq_lens``, so the split count depends only on
  host-known numbers and the launch is CUDA-graph safe. The splits are merged in the same launch: each
  program writes its partial (unnormalised output, max, sum), then takes a ticket from an int32
  counter of its (sequence, KV head) with an acq_rel atomic; the program drawing the last ticket
  resets the counter to zero and merges every split's partial into the output. Counters and partials
  live in a caller-owned ``DecodeWorkspace`` that only grows and is always zero between launches, so
  one workspace serves all layers and every captured graph. ``reduce="separate"`` keeps the former
  second merge kernel instead. Where the block table is at most 256 columns wide, each program loads
  its whole table row up front, next to ``seq_len``, so the first K/V loads wait for one memory
  round trip rather than two.
* Prefill: one program per (sequence, query tile, query head) attends causally to the sequence's
  cached context and its own new tokens, all read through the block table (chunked prefill and
  prefix caching both reduce to this).

FP8 pools (``kv_quant``): both kernels read fp8 and fold k_scale into the softmax scale, v_scale into
the output; the tile's dots run in fp16 by default (``resolve_fp8_dot``: fp8 → fp16 is exact and one
native conversion per pair on Hopper, fp8 → bf16 is not), or in bf16 on request; fp32 accumulation.

Sliding windows and logit soft caps (Mistral, Phi-3, Gemma 2/3; per layer, as in HF transformers): with window W
a token at position p sees keys p - W < j <= p; with cap c each score s = q·k·scale becomes c·tanh(s / c) before
the softmax. Each is a constexpr flag (SLIDING, SOFT_CAP) beside a runtime value (``window``, not specialised, and
``soft_cap``), so the variants without them compile as before and one binary serves every window size. A window
starts each program's key loop where the first key any of its rows sees lies, so the blocks before it are never
read: the decode at that key, its splits sharing out only the window; the prefill kernel at that key's tile of
BLOCK_N keys (tiles stay where they are without a window, so a key's tile does not depend on its query's), masking
the keys before each row's window, unloaded where no row of the program sees them.

Attention sinks (GPT-OSS): head h's softmax has one more logit, sinks[h] (a float32 [Hq] tensor), in its denominator,
weighing no value. A constexpr flag (HAS_SINKS) beside the tensor: the kernels' loops are untouched and the sink
enters each head's denominator once, after them, relative to the row's running max (``_sink_weight``): in the
prefill kernel's and a single-split decode's normalisation, or in the merge of a decode's splits (either reduce),
never in a split's partial.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from pagedllm.kernels import kv_quant
from pagedllm.kernels.metadata import window_and_cap


@triton.jit
def _merge_splits(
    part_out_ptr, part_ml_ptr, out_ptr, stride_oh, first_head, num_splits,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr, sinks_ptr=None, HAS_SINKS: tl.constexpr = False,
):
    """Merges the split partials of flat heads first_head .. first_head+GROUP-1 into out_ptr (their first
    head's row), SPLIT_CHUNK splits at a time, rescaling to a running max (log2 units) as _reduce_kernel does.
    Loads bypass L1 (.cg), which is not coherent across SMs: a line cached here by an earlier merge of a
    neighbouring (sequence, KV head) may predate the other splits' stores. With HAS_SINKS, `sinks_ptr` points at
    these heads' sink logits (natural units): the merge starts from them, a term of weight 1 and no value."""
    rows = tl.arange(0, GROUP_P2)
    dims = tl.arange(0, DIM_PAD)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    base = (first_head + rows) * num_splits
    if HAS_SINKS:
        # The sink joins the denominator here, once per head, not in any split's partial. A sink of -inf gives
        # l_run 1 · exp2(-inf - m_ref) = 0 at the first step: the plain softmax.
        m_run = tl.load(sinks_ptr + rows, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_run = tl.full([GROUP_P2], 1.0, tl.float32)
    else:
        m_run = tl.full([GROUP_P2], float("-inf"), tl.float32)
        l_run = tl.zeros([GROUP_P2], tl.float32)
    o = tl.zeros([GROUP_P2, DIM_PAD], tl.float32)
    for s0 in range(0, num_splits, SPLIT_CHUNK):
        sp = s0 + tl.arange(0, SPLIT_CHUNK)
        ok = row_ok[:, None] & (sp < num_splits)[None, :]
        idx = base[:, None] + sp[None, :]
        m = tl.load(part_ml_ptr + idx * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(part_ml_ptr + idx * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
        acc = tl.load(part_out_ptr + idx[:, :, None] * HEAD_DIM + dims[None, None, :],
                      mask=ok[:, :, None] & dim_ok[None, None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(m, 1))
        # While every split so far is empty (max -inf) rescale against 0: the weights exp2(-inf) are 0, not NaN.
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m_run - m_ref)
        w = tl.exp2(m - m_ref[:, None])
        l_run = l_run * alpha + tl.sum(l * w, 1)
        o = o * alpha[:, None] + tl.sum(acc * w[:, :, None], 1)
        m_run = m_new
    o = o / l_run[:, None]
    tl.store(out_ptr + rows[:, None] * stride_oh + dims[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _dot_operand(q, DOT: tl.constexpr):
    """The query in the dtype of the tile's dots (K, V and p follow it via ``.to(q.dtype)``). "query": as
    loaded (every plain pool). "fp16" (an FP8 pool's default): e4m3 / e5m2 → fp16 is exact and a native
    conversion on Hopper, where → bf16 is not; q is clamped to fp16's ±65504 first so that a large bf16 or
    fp32 value saturates instead of becoming inf. "bf16": the former FP8 path, kept for comparison."""
    if DOT == "fp16":
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    elif DOT == "bf16":
        q = q.to(tl.bfloat16)
    return q


@triton.jit
def _soft_cap(s, qk_scale, cap):
    """Raw dots `s` → cap·tanh(s·scale / cap) in the online softmax's base-2 units, where `qk_scale` = softmax scale
    · k_scale · log2(e): the cap applies to the natural-scale score. tanh(x) = 1 - 2 / (1 + exp(2x)) (Triton has no
    tanh that its interpreter runs): exp(2x) = inf gives 1 and 0 gives -1, never NaN; its absolute error, ~2e-7, is
    about that of a float32 score of magnitude 1."""
    cap2 = cap * 1.4426950408889634
    return cap2 - (2.0 * cap2) / (1.0 + tl.exp2(s * (2.0 * qk_scale / cap)))


@triton.jit
def _sink_weight(sink, m_i):
    """exp(sink - m): a sink logit's share (`sink` as loaded, natural units) of the denominator of rows whose running
    max is `m_i` (log2 units), relative to that max. It overflows to inf, so the row's output to 0, only where the
    sink outweighs every key by more than 2^128 (the exact output is then below 2^-128 of the values)."""
    return tl.exp2(sink.to(tl.float32) * 1.4426950408889634 - m_i)


@triton.jit(do_not_specialize=["window"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_ml_ptr, counters_ptr, sinks_ptr,
    scale, k_scale, v_scale,
    stride_qt, stride_qh,
    stride_kb, stride_ko, stride_kh,
    stride_vb, stride_vo, stride_vh,
    stride_bt, table_width,
    stride_ot, stride_oh,
    num_splits, window, soft_cap,
    WRITE_PARTIAL: tl.constexpr, FUSED_REDUCE: tl.constexpr, TABLE_ROW: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, GROUP_P2: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PREC: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr,
    SLIDING: tl.constexpr, SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if TABLE_ROW > 0:
        # The whole block-table row, loaded alongside seq_len rather than after it: the K/V addresses
        # then wait for one memory round trip instead of two (seq_len → table → K/V).
        cols = tl.arange(0, TABLE_ROW)
        table_row = tl.load(table + cols, mask=cols < table_width, other=0)
    seq_len = tl.load(seq_lens_ptr + seq)

    # This split's share of the context, in whole tiles.
    if SLIDING:
        # Of the window only, from its first key: the earlier keys are never read, nor masked.
        first_key = tl.maximum(seq_len - window, 0)
        tiles = tl.cdiv(seq_len - first_key, TILE)
        tiles_per_split = tl.cdiv(tiles, num_splits)
        start = first_key + split * tiles_per_split * TILE
    else:
        tiles = tl.cdiv(seq_len, TILE)
        tiles_per_split = tl.cdiv(tiles, num_splits)
        start = split * tiles_per_split * TILE
    end = tl.minimum(start + tiles_per_split * TILE, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kvh * GROUP + rows
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = _dot_operand(q, DOT)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    offs = tl.arange(0, TILE)
    # exp(x) = exp2(x·log2 e); an FP8 cache's k_scale folds in here, its v_scale into the result.
    qk_scale = scale * k_scale * 1.4426950408889634
    for tile_start in range(start, end, TILE):
        pos = tile_start + offs
        ok = pos < end
        if TABLE_ROW > 0:
            blk = tl.gather(table_row, tl.minimum(pos // BLOCK_SIZE, TABLE_ROW - 1), 0).to(tl.int64)
        else:
            blk = tl.load(table + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        k = _kv_tile(k_cache_ptr, blk, slot, kvh * stride_kh, stride_kb, stride_ko, dims, ok, dim_ok, q.dtype, False)
        v = _kv_tile(v_cache_ptr, blk, slot, kvh * stride_vh, stride_vb, stride_vo, dims, ok, dim_ok, q.dtype, UPCAST)
        if SOFT_CAP:
            s = _soft_cap(tl.dot(q, tl.trans(k).to(q.dtype), input_precision=PREC), qk_scale, soft_cap)
        else:
            s = tl.dot(q, tl.trans(k).to(q.dtype), input_precision=PREC) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PREC)
        m_i = m_new
    acc = acc * v_scale

    if not WRITE_PARTIAL:
        if HAS_SINKS:  # one split: the sink joins the denominator here (with several, in the merge)
            l_i = l_i + _sink_weight(tl.load(sinks_ptr + heads, mask=row_ok, other=0.0), m_i)
        o = acc / l_i[:, None]
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        # Partial results [S, Hq, num_splits, D] unnormalised, plus (max, sum) in log2 units.
        idx = (seq * (GROUP * tl.num_programs(1)) + heads) * num_splits + split
        tl.store(part_out_ptr + idx[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=row_ok[:, None] & dim_ok[None, :])
        tl.store(part_ml_ptr + idx * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + idx * 2 + 1, l_i, mask=row_ok)
        if FUSED_REDUCE:
            # The last split of this (sequence, KV head) to finish merges all of them. The barrier puts
            # every thread's partial stores before the atomic's release; its acquire (in the last
            # program) puts the other programs' stores before the loads of the merge.
            tl.debug_barrier()
            counter = counters_ptr + seq * tl.num_programs(1) + kvh
            ticket = tl.atomic_add(counter, 1, sem="acq_rel")
            if ticket == num_splits - 1:
                tl.store(counter, 0)  # every program has drawn its ticket: zero again for the next launch
                _merge_splits(part_out_ptr, part_ml_ptr, out_ptr + seq * stride_ot + kvh * GROUP * stride_oh,
                              stride_oh, (seq * tl.num_programs(1) + kvh) * GROUP, num_splits,
                              GROUP, GROUP_P2, HEAD_DIM, DIM_PAD, SPLIT_CHUNK, sinks_ptr + kvh * GROUP, HAS_SINKS)


@triton.jit
def _reduce_kernel(
    part_out_ptr, part_ml_ptr, out_ptr, sinks_ptr,
    stride_ot, stride_oh,
    num_splits,
    SPLIT_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    base = (seq * tl.num_programs(1) + head) * num_splits
    sp = tl.arange(0, SPLIT_PAD)
    dims = tl.arange(0, DIM_PAD)
    sp_ok = sp < num_splits
    m = tl.load(part_ml_ptr + (base + sp) * 2, mask=sp_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + (base + sp) * 2 + 1, mask=sp_ok, other=0.0)
    m_max = tl.max(m, 0)
    if HAS_SINKS:  # the sink (log2 units) is one more term of the merge, with no value
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    w = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)
    acc = tl.load(part_out_ptr + (base + sp)[:, None] * HEAD_DIM + dims[None, :],
                  mask=sp_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    o = tl.sum(acc * w[:, None], 0)
    l_sum = tl.sum(l * w, 0)
    if HAS_SINKS:
        l_sum += tl.exp2(sink - m_max)
    o = o / l_sum
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims, o.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


@triton.jit
def _kv_tile(cache_ptr, blk, slot, head_offset, stride_b, stride_o, dims, ok, dim_ok, dot_dtype, UPCAST: tl.constexpr):
    """One K or V tile [keys, dims] gathered through the block numbers `blk`. With UPCAST (an FP8 pool's V tile),
    converted to `dot_dtype` right after the load, through a select: otherwise Triton 3.6 keeps the tile 8-bit in
    shared memory and, for sm_90, reads V's transposed dot operand one byte at a time (64 ``ld.shared.b8`` per thread
    per 64-key tile); converted first, it reaches shared memory as 16-bit and ``ldmatrix.trans`` reads it. K's
    operand needs no transpose and stays 8-bit (converting it too was slower; BENCHMARKS.md §57.1)."""
    x = tl.load(cache_ptr + blk[:, None] * stride_b + slot[:, None] * stride_o + head_offset + dims[None, :],
                mask=ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        x = tl.where(ok[:, None], x.to(dot_dtype), 0.0)
    return x


@triton.jit
def _attend_causal(
    q, q_pos, q_first, table, table_row, kv_end, k_cache_ptr, v_cache_ptr, kvh,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
    qk_scale, window, soft_cap, dims, dim_ok,
    ROWS: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
    TABLE_ROW: tl.constexpr, UPCAST: tl.constexpr, SLIDING: tl.constexpr, SOFT_CAP: tl.constexpr,
):
    """Online softmax (eq. 4, base 2) of the query rows `q` at absolute positions `q_pos` over KV head `kvh`'s keys
    0 .. kv_end-1, gathered through the block-table row `table` in tiles of BLOCK_N, each row seeing keys up to its
    own position → (unnormalised output, row sums, row maxima; the sums relative to the maxima, in log2 units: what a
    sink's weight is added to). `qk_scale` is softmax scale · k_scale · log2(e). With TABLE_ROW > 0, `table_row`
    holds the row's first TABLE_ROW entries, loaded before the loop (as the decode kernel does): the K/V addresses
    then need no load of their own. With SLIDING, each row sees its last `window` keys only, and the loop starts at
    the tile of the first key that `q_first` (the earliest row's position) sees; with SOFT_CAP, scores are capped at
    `soft_cap` (``_soft_cap``)."""
    if SLIDING:
        # Tiles stay at multiples of BLOCK_N, as without a window, so a key meets the same tile-mates (the same
        # summation order) whatever tile its query is in: the unified kernel's batch invariance. The keys before
        # the window in that first tile are masked, not loaded.
        kv_start = tl.maximum(q_first - window + 1, 0) // BLOCK_N * BLOCK_N
        # A later row may see no key of the first tiles: a finite start keeps m_new finite there (alpha
        # exp2(-inf - -inf) would be NaN), and its first visible key still rescales the zero sums away.
        m_i = tl.full([ROWS], -1.0e30, tl.float32)
    else:
        kv_start = 0
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM_PAD], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    for n_start in range(kv_start, kv_end, BLOCK_N):
        pos = n_start + offs
        ok = pos < kv_end
        if SLIDING:
            ok = ok & (pos > q_first - window)  # keys no row sees are not even loaded
        if TABLE_ROW > 0:
            blk = tl.gather(table_row, tl.minimum(pos // BLOCK_SIZE, TABLE_ROW - 1), 0).to(tl.int64)
        else:
            blk = tl.load(table + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        k = _kv_tile(k_cache_ptr, blk, slot, kvh * stride_kh, stride_kb, stride_ko, dims, ok, dim_ok, q.dtype, False)
        v = _kv_tile(v_cache_ptr, blk, slot, kvh * stride_vh, stride_vb, stride_vo, dims, ok, dim_ok, q.dtype, UPCAST)
        if SOFT_CAP:
            s = _soft_cap(tl.dot(q, tl.trans(k).to(q.dtype), input_precision=PREC), qk_scale, soft_cap)
        else:
            s = tl.dot(q, tl.trans(k).to(q.dtype), input_precision=PREC) * qk_scale
        if SLIDING:
            # 0 <= q_pos - pos < window in one unsigned compare: two compares cost the unified kernel ~25 registers.
            visible = ok[None, :] & ((q_pos[:, None] - pos[None, :]).to(tl.uint32) < window.to(tl.uint32))
        else:
            visible = ok[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite from the first tile on: every row sees key 0 (or m_i is)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["window"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    scale, k_scale, v_scale, seq_offset,
    stride_qt, stride_qh,
    stride_kb, stride_ko, stride_kh,
    stride_vb, stride_vo, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    window, soft_cap, sinks_ptr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
    DOT: tl.constexpr, SLIDING: tl.constexpr, SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0) + seq_offset
    m_tile = tl.program_id(1)
    head = tl.program_id(2)
    kvh = head // GROUP
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    tok = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = _dot_operand(q, DOT)
    q_pos = ctx + rows  # absolute position of each query row

    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Keys up to the last row's position (causal), never past the sequence.
    kv_end = tl.minimum(seq_len, ctx + (m_tile + 1) * BLOCK_M)
    acc, l_i, m_i = _attend_causal(q, q_pos, ctx + m_tile * BLOCK_M, table, table, kv_end, k_cache_ptr, v_cache_ptr,
                                   kvh, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
                                   scale * k_scale * 1.4426950408889634, window, soft_cap, dims, dim_ok,
                                   BLOCK_M, DIM_PAD, BLOCK_SIZE, BLOCK_N, PREC, 0, False, SLIDING, SOFT_CAP)
    if HAS_SINKS:
        l_i = l_i + _sink_weight(tl.load(sinks_ptr + head), m_i)
    o = acc * v_scale / l_i[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head * stride_oh + dims[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


@functools.lru_cache(maxsize=8)
def num_sms(device_index: int) -> int:
    if not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _precision(query: torch.Tensor, dot: str = "query") -> str:
    """float32 stays exact (IEEE) in tl.dot; 16-bit types use the tensor cores natively."""
    return "ieee" if query.dtype == torch.float32 and dot == "query" else "tf32"


FP8_DOT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_fp8_dot(query: torch.Tensor, key_cache: torch.Tensor, fp8_dot_dtype: str | None) -> str:
    """The kernels' DOT mode: "query" (K/V converted to the query's dtype), "fp16" or "bf16".

    Plain pools always use "query" (`fp8_dot_dtype` must be None). FP8 pools: `fp8_dot_dtype` (one of
    FP8_DOT_DTYPES) or, by default, fp16 for 16-bit queries and the query's dtype for float32 ones (exact
    IEEE dots, as with a plain float32 pool). A dot dtype equal to the query's is "query" (nothing to convert)."""
    if not kv_quant.is_fp8(key_cache.dtype):
        if fp8_dot_dtype is not None:
            raise ValueError(f"fp8_dot_dtype applies to FP8 caches only; this cache is {key_cache.dtype}: "
                             "leave it None.")
        return "query"
    if fp8_dot_dtype is None:
        if query.dtype == torch.float32:
            return "query"
        fp8_dot_dtype = "fp16"
    if fp8_dot_dtype not in FP8_DOT_DTYPES:
        raise ValueError(f"fp8_dot_dtype must be one of {list(FP8_DOT_DTYPES)} or None, got {fp8_dot_dtype!r}.")
    return "query" if query.dtype == FP8_DOT_DTYPES[fp8_dot_dtype] else fp8_dot_dtype


def _check_sinks(sinks: torch.Tensor | None, query: torch.Tensor) -> None:
    """`sinks` (GPT-OSS's attention sinks): None, or one float32 logit per query head, [Hq] contiguous on the query's
    device (the kernels read sinks[h] by pointer; the warm start compiles the float32 variant)."""
    if sinks is None:
        return
    hq = query.shape[1]
    if not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32 or tuple(sinks.shape) != (hq,):
        raise ValueError(f"sinks must be a float32 tensor of shape [num_q_heads = {hq}], got "
                         f"{type(sinks).__name__} {getattr(sinks, 'dtype', '')} {tuple(getattr(sinks, 'shape', ()))}.")
    if sinks.device != query.device or not sinks.is_contiguous():
        raise ValueError(f"sinks must be contiguous on the query's device {query.device}, got {sinks.device} "
                         f"strides {sinks.stride()}.")


def _check_shapes(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int]:
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} differ.")
    hq, d = query.shape[1], query.shape[2]
    hk = key_cache.shape[2]
    if key_cache.shape[3] != d or hq % hk:
        raise ValueError(
            f"query heads {hq} must be a multiple of KV heads {hk} and head dims must match "
            f"(query {d}, cache {key_cache.shape[3]})."
        )
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension.")
    return hq // hk, d


_REDUCE_MODES = ("fused", "separate")
# Splits the fused merge reads in one step, at most: every split at once up to this many. Each step
# is a dependent L2 round trip; on an H200 reading all 32 splits of a batch-1 decode at once took
# 12.9 µs against 14.8 µs in steps of 4 (BENCHMARKS.md §6). Many splits only occur at small batches,
# where the merge's extra registers cost no occupancy.
_MAX_MERGE_CHUNK = 32
#: Padded head widths from here on (MLA's 576-wide latent) run one pipeline stage of small tiles: the shared memory
#: of deeper pipelines of Q, K and V tiles this wide exceeds an H100's.
WIDE_DIM_PAD = 512
# Widest block-table row a decode program loads whole at its start (1 KiB of int32).
_MAX_TABLE_ROW = 256


def preloaded_table_row(table_width: int, preload_table: bool | None) -> int:
    """The TABLE_ROW constexpr: how many block-table entries each program loads before its loop (a power of two
    covering the row), or 0 to load them tile by tile. `preload_table` None: preload rows of at most
    _MAX_TABLE_ROW columns when Triton has ``tl.gather`` (3.2+); True without it is a ValueError."""
    can_gather = hasattr(tl, "gather")
    if preload_table is None:
        preload_table = can_gather and table_width <= _MAX_TABLE_ROW
    elif preload_table and not can_gather:
        raise ValueError(f"preload_table=True needs tl.gather (Triton >= 3.2); this is Triton {triton.__version__}.")
    return triton.next_power_of_2(table_width) if preload_table and table_width else 0


def _pow2_at_least(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@dataclass(eq=False)
class DecodeWorkspace:
    """Scratch of the split-KV decode, owned by the caller and reused by every call on one device.

    ``counters``: one int32 ticket counter per (sequence, KV head), zero between launches (the fused
    kernel's last split resets its own). ``part_out`` / ``part_ml``: flat float32 buffers for the
    per-split partials. Buffers only grow (to powers of two), and not during CUDA-graph capture; a
    replaced buffer is kept in ``retired`` because a graph captured before the growth still uses it.
    """

    counters: torch.Tensor
    part_out: torch.Tensor
    part_ml: torch.Tensor
    retired: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def allocate(cls, device: torch.device | str, num_counters: int = 0, num_partials: int = 0,
                 head_dim: int = 0) -> DecodeWorkspace:
        """A workspace of at least these sizes, counters zeroed (under capture the memset joins the graph)."""
        rows = _pow2_at_least(num_partials) if num_partials else 0
        return cls(torch.zeros(_pow2_at_least(num_counters) if num_counters else 0, dtype=torch.int32, device=device),
                   torch.empty(rows * head_dim, dtype=torch.float32, device=device),
                   torch.empty(rows * 2, dtype=torch.float32, device=device))

    @property
    def device(self) -> torch.device:
        return self.counters.device

    def reserve(self, num_counters: int, num_partials: int, head_dim: int) -> None:
        """Grow to at least `num_counters` counters and `num_partials` partial rows of `head_dim`."""
        grow_counters = self.counters.numel() < num_counters
        grow_partials = self.part_ml.numel() < 2 * num_partials or self.part_out.numel() < num_partials * head_dim
        if not (grow_counters or grow_partials):
            return
        if _capturing(self.device):
            # Counters zeroed here would only be zeroed at replay; eager calls would read garbage.
            raise RuntimeError("a DecodeWorkspace cannot grow during CUDA-graph capture: run the same call "
                               "once before capturing it (the capture warm-up does).")
        new = DecodeWorkspace.allocate(self.device, num_counters if grow_counters else 0,
                                       num_partials if grow_partials else 0, head_dim)
        if grow_counters:
            self.retired += [self.counters] if self.counters.numel() else []
            self.counters = new.counters
        if grow_partials:
            self.retired += [t for t in (self.part_out, self.part_ml) if t.numel()]
            self.part_out, self.part_ml = new.part_out, new.part_ml


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, tile: int, device: torch.device, programs_per_sm: int = 2,
    min_tiles_per_split: int = 1,
) -> int:
    """Splits per sequence so that ~`programs_per_sm` programs per SM run; from host-known numbers only (no sync)."""
    sms = num_sms(device.index or 0) if device.type == "cuda" else 4
    want = -(-programs_per_sm * sms // max(1, num_seqs * num_kv_heads))
    max_useful = max(1, -(-max_seq_len // (min_tiles_per_split * tile)))
    return int(max(1, min(want, max_useful, 64)))


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    tile: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    programs_per_sm: int = 2,
    min_tiles_per_split: int = 1,
    reduce: str = "fused",
    workspace: DecodeWorkspace | None = None,
    merge_chunk: int | None = None,
    preload_table: bool | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8_dot_dtype: str | None = None,
    fp8_upcast: bool = False,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence: query [S, Hq, D] → [S, Hq, D] over each sequence's seq_lens[i] keys.

    `max_seq_len` (a host int, e.g. max_model_len under CUDA graphs) only bounds the split count.
    `reduce` merges the splits in the same launch ("fused") or in a second kernel ("separate").
    `workspace` holds the counters and partials (grown as needed); without one, a zeroed one is
    allocated for this call. `merge_chunk` (a power of two): splits the fused merge reads per step;
    by default all of them, up to 32. `preload_table`: each program loads its sequence's whole
    block-table row up front (default: when the table has at most 256 columns and Triton has
    ``tl.gather``, 3.2+). `num_stages`: software-pipeline depth; by default 2 with a preloaded row and
    3 without (the faster pair at every benchmarked point on an H200, BENCHMARKS.md §7); an FP8 pool with at
    least one (sequence, KV head) per SM: 3. `tile` (keys per loop iteration, default 16 KiB of 16-bit K) and
    `num_warps` (default 4; 8 for padded head dims of WIDE_DIM_PAD or more; an FP8 pool with a program per SM: 64
    keys on 2 warps, the fastest of a sweep of tiles, warps, stages and splits, §29.2; below that, 128 keys on 4
    warps).
    `fp8_dot_dtype`: with an FP8 cache, the dtype of the tile's dots, "fp16" (default for 16-bit queries)
    or "bf16"; fp32 accumulation either way (``resolve_fp8_dot``). `fp8_upcast`: convert each FP8 V tile to the
    dots' dtype right after its load (``_kv_tile``); off by default, slower here on an H200 (BENCHMARKS.md §57.1).
    `sliding_window` W: each token sees its last W keys only (the splits share out just those, so the split count
    is bounded by the window rather than `max_seq_len`); `logits_soft_cap` c: scores become c·tanh(s / c).
    `sinks` (GPT-OSS's attention sinks, float32 [Hq]): head h's softmax denominator gains exp(sinks[h]), a logit
    that weighs no value; it joins the merge of the splits (either reduce), or a single split's normalisation.
    """
    window, soft_cap = window_and_cap(sliding_window, logits_soft_cap)
    _check_sinks(sinks, query)
    if reduce not in _REDUCE_MODES:
        raise ValueError(f"reduce must be one of {_REDUCE_MODES}, got {reduce!r}.")
    if merge_chunk is not None and (merge_chunk < 1 or merge_chunk & (merge_chunk - 1)):
        raise ValueError(f"merge_chunk must be a power of two, got {merge_chunk}.")
    if workspace is not None and workspace.device != query.device:
        raise ValueError(f"workspace is on {workspace.device}, query on {query.device}.")
    group, d = _check_shapes(query, key_cache, value_cache)
    dot = resolve_fp8_dot(query, key_cache, fp8_dot_dtype)
    num_seqs, hq = query.shape[0], query.shape[1]
    hk, block_size = key_cache.shape[2], key_cache.shape[1]
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    dim_pad = triton.next_power_of_2(d)
    # An FP8 pool with a (sequence, KV head) program per SM or more: 8 KiB tiles on two warps stream fastest
    # (§29.2's sweep at batch 64/128). With fewer, the split-KV programs are few and the former launch (twice
    # the keys per tile on four warps) was faster (batch 1: 0.78-0.83x bf16 against 0.99-1.12x).
    fp8_wide = key_cache.element_size() == 1 and num_seqs * hk >= num_sms(query.device.index or 0)
    if tile is None:  # 16 KiB of 16-bit K per tile (an FP8 pool at small batch: twice the keys for those bytes)
        tile = max(16, min(64, 8192 // dim_pad)) * (2 if key_cache.element_size() == 1 and not fp8_wide else 1)
    if num_warps is None:  # wide heads (MLA's padded latent): a [16, 1 024] accumulator spills less on 8 warps
        num_warps = 2 if fp8_wide else 8 if dim_pad >= WIDE_DIM_PAD else 4
    tile = max(tile, triton.next_power_of_2(block_size))
    if num_splits is None:
        span = max_seq_len if not window else min(max_seq_len, window + block_size - 1)  # from its first block
        num_splits = choose_num_splits(num_seqs, hk, span, tile, query.device, programs_per_sm, min_tiles_per_split)
    fused = reduce == "fused"
    part_out = part_ml = counters = out  # unused with a single split
    if num_splits > 1:
        sizes = (num_seqs * hk if fused else 0, num_seqs * hq * num_splits, d)
        if workspace is None:
            workspace = DecodeWorkspace.allocate(query.device, *sizes)
        else:
            workspace.reserve(*sizes)
        part_out, part_ml = workspace.part_out, workspace.part_ml
        counters = workspace.counters if fused else out
    table_width = block_tables.shape[1]
    table_row = preloaded_table_row(table_width, preload_table)
    if num_stages is None:
        num_stages = 1 if dim_pad >= WIDE_DIM_PAD else 3 if fp8_wide or not table_row else 2
    group_p2 = triton.next_power_of_2(group)
    if merge_chunk is None:
        merge_chunk = min(_MAX_MERGE_CHUNK, triton.next_power_of_2(num_splits))
    _decode_kernel[(num_seqs, hk, num_splits)](
        query, key_cache, value_cache, block_tables, seq_lens,
        out, part_out, part_ml, counters, out if sinks is None else sinks,
        scale, k_scale, v_scale,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), table_width,
        out.stride(0), out.stride(1),
        num_splits, window, soft_cap,
        WRITE_PARTIAL=num_splits > 1, FUSED_REDUCE=fused and num_splits > 1, TABLE_ROW=table_row,
        GROUP=group, GROUP_PAD=max(16, group_p2), GROUP_P2=group_p2,
        SPLIT_CHUNK=min(triton.next_power_of_2(num_splits), merge_chunk),
        HEAD_DIM=d, DIM_PAD=dim_pad, BLOCK_SIZE=block_size, TILE=tile, PREC=_precision(query, dot), DOT=dot,
        UPCAST=fp8_upcast and key_cache.element_size() == 1, SLIDING=window > 0, SOFT_CAP=soft_cap > 0,
        HAS_SINKS=sinks is not None, num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1 and not fused:
        _reduce_kernel[(num_seqs, hq)](
            part_out, part_ml, out, out if sinks is None else sinks, out.stride(0), out.stride(1),
            num_splits, SPLIT_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=d, DIM_PAD=dim_pad, HAS_SINKS=sinks is not None, num_warps=4,
        )
    return out


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    first_seq: int,
    num_seqs: int,
    max_query_len: int,
    out: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8_dot_dtype: str | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Sequences first_seq .. first_seq+num_seqs-1 of a flat batch: causal attention of their query tokens
    (rows query_start_loc[i]:query_start_loc[i+1] of `query`) over all seq_lens[i] cached keys; writes `out`.
    `fp8_dot_dtype`, `sliding_window`, `logits_soft_cap`, `sinks`: as in ``paged_decode_attention``. `block_m` query
    rows and `block_n` keys per tile, `num_warps`, `num_stages`: launch parameters (defaults: ``prefill_launch``)."""
    window, soft_cap = window_and_cap(sliding_window, logits_soft_cap)
    _check_sinks(sinks, query)
    group, d = _check_shapes(query, key_cache, value_cache)
    dot = resolve_fp8_dot(query, key_cache, fp8_dot_dtype)
    if num_seqs == 0:
        return
    hq = query.shape[1]
    block_size = key_cache.shape[1]
    dim_pad = triton.next_power_of_2(d)
    dm, dn, dw, ds = prefill_launch(dim_pad, block_size, query.element_size())
    block_m, block_n = block_m or dm, block_n or dn
    num_warps, num_stages = num_warps or dw, num_stages or ds
    grid = (num_seqs, triton.cdiv(max_query_len, block_m), hq)
    _prefill_kernel[grid](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out,
        scale, k_scale, v_scale, first_seq,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        window, soft_cap, out if sinks is None else sinks,
        GROUP=group, HEAD_DIM=d, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, PREC=_precision(query, dot), DOT=dot,
        SLIDING=window > 0, SOFT_CAP=soft_cap > 0, HAS_SINKS=sinks is not None,
        num_warps=num_warps, num_stages=num_stages,
    )


def prefill_launch(dim_pad: int, block_size: int, query_bytes: int = 2) -> tuple[int, int, int, int]:
    """Default (block_m, block_n, num_warps, num_stages) of the prefill kernel for a padded head dim and a
    query element size. 16-bit queries, head dim <= 128: 64 x 64 tiles, 3 stages, the best geometric mean of a
    sweep of 54 launches over four step shapes on an H200 (2.0-2.4x the former 32 x 32, 2 stages;
    BENCHMARKS.md §29.4; 128 x 32 tiles on 8 warps for 1024+-token chunks, the best for one such chunk alone,
    made the long workload's mixed steps slower); wider heads keep 2 stages (shared memory); float32 keeps the
    former small tiles. MLA's latent (576 wide, padded to 1 024) takes 16 × 16 tiles in one stage on 8 warps:
    two stages of 64 × 32 need 384 KiB of shared memory, where an H100 has 227."""
    if dim_pad >= WIDE_DIM_PAD:
        return 16, 16, 8, 1
    if query_bytes <= 2:
        return (64, 64, 4, 3) if dim_pad <= 128 else (64, 32, 4, 2)
    block_m = 64 if dim_pad <= 64 else 32
    block_n = max(32, triton.next_power_of_2(block_size)) if block_size <= 64 else block_size
    return block_m, block_n, 4, 2


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta,
    scale: float,
    out: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8_dot_dtype: str | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    latent_dim: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``reference.paged_attention`` (K/V already cached): decodes, then prefill chunks.
    `workspace`: the decode's scratch, reused across calls (see ``paged_decode_attention``).
    FP8 caches are read as fp8 · k_scale / v_scale (``kv_quant.dequantize``), their dots in `fp8_dot_dtype`
    (``resolve_fp8_dot``). `sliding_window`, `logits_soft_cap`: the layer's, as in ``paged_decode_attention``.
    `latent_dim` (MLA: key_cache is value_cache, one row [c_kv ; k_pe] per token): the decodes take
    ``triton_mla_decode.mla_decode_attention``, which writes only each head's first `latent_dim` output values
    (the rest is left as `out` held it); prefill chunks stay on the generic kernel. `sinks` (GPT-OSS, float32 [Hq]):
    each head's sink logit in its softmax denominator (``paged_decode_attention``); not with `latent_dim`."""
    if sinks is not None and latent_dim is not None:
        raise ValueError("attention sinks (GPT-OSS) with latent_dim (MLA) are not supported: the MLA decode kernel "
                         "has no sinks.")
    if out is None:
        out = torch.empty_like(query)
    nd = meta.num_decodes
    if nd and latent_dim is not None:
        from pagedllm.kernels import triton_mla_decode  # imports this module

        triton_mla_decode.check_mla_supported(key_cache, sliding_window, logits_soft_cap)
        if key_cache is not value_cache:
            raise ValueError("latent_dim (MLA): the key and value caches must be one tensor, the latent pool.")
        triton_mla_decode.mla_decode_attention(query[:nd], key_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                                               scale, max(meta.seq_lens_cpu[:nd]), latent_dim, out=out[:nd],
                                               workspace=workspace)
    elif nd:
        max_len = max(meta.seq_lens_cpu[:nd])
        paged_decode_attention(query[:nd], key_cache, value_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                               scale, max_len, out=out[:nd], workspace=workspace,
                               k_scale=k_scale, v_scale=v_scale, fp8_dot_dtype=fp8_dot_dtype,
                               sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks)
    n_prefill = meta.num_seqs - nd
    if n_prefill:
        max_q = max(meta.query_lens_cpu[nd:])
        paged_prefill_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, scale, nd, n_prefill, max_q, out, k_scale, v_scale,
                                fp8_dot_dtype, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                sinks=sinks)
    return out
