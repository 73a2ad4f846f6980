"""One launch for a whole step's attention (decodes and prefill chunks alike), its layout read on the device.

The decode and prefill kernels of ``triton_attention`` size their grids from host-known numbers (the number of
decodes, the longest chunk), so a captured graph would bake a step's layout in. This kernel's grid depends only
on the sizes of its buffers: ``num_tokens // BLOCK_Q + max_num_seqs`` query tiles × KV heads. Sequence ``i``'s
tiles are numbered from ``query_start_loc[i] // BLOCK_Q + i`` (disjoint, at most that many in all); each
program finds its sequence by a binary search over ``query_start_loc`` and exits when its tile is past the
sequence's query rows. Padding sequences (``query_start_loc`` equal to the step's token count from there on)
have no rows. So a whole-step CUDA graph (``worker/piecewise_graph.PiecewiseGraphRunner.capture_whole``)
replays any mix of decodes and chunks up to its sizes, as vLLM's unified Triton attention does.

A tile holds BLOCK_Q query tokens × the query heads of one KV head (padded to a power of two) as its rows, so
each K/V tile is read once per KV head, as the decode kernel does, and a decode row fills GROUP rows of it.
Keys are gathered through the block table and attended causally with an online softmax, as in the prefill
kernel; each program loads its sequence's block-table row before the loop when the table has at most 256 columns
(as the decode kernel does), so the K/V loads need no load of their own. FP8 pools are read with their scales folded
in (``triton_attention.resolve_fp8_dot``), each V tile converted to fp16 right after its load
(``triton_attention._kv_tile``). Both made an FP8 pool's unified attention 1.3-1.35x faster on an H200 (BENCHMARKS.md
§57.1). There is no
split-KV: a step of few sequences with long contexts is better served by the decode kernel (the whole-step
graphs are for short steps, where launches cost more than the kernel). Sliding windows and logit soft caps work
as in ``triton_attention`` (constexpr SLIDING / SOFT_CAP, runtime ``window`` / ``soft_cap``): a tile's key loop
starts at the key tile of the first key its earliest token sees, key tiles staying where they are without a window,
so a token's bits do not depend on its query tile there either. Attention sinks (GPT-OSS; constexpr HAS_SINKS) join
each row's denominator after the key loop, as in ``triton_attention``'s prefill kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.metadata import window_and_cap
from pagedllm.kernels.triton_attention import (_attend_causal, _check_shapes, _check_sinks, _dot_operand, _precision,
                                               _sink_weight, preloaded_table_row, prefill_launch, resolve_fp8_dot)


@triton.jit
def _find_seq(query_start_loc_ptr, tile, max_num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence whose first tile (query_start_loc[i] // BLOCK_Q + i) is at or before `tile`."""
    lo: tl.int32 = 0
    hi = max_num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit(do_not_specialize=["window"])
def _unified_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    scale, k_scale, v_scale, max_num_seqs,
    stride_qt, stride_qh,
    stride_kb, stride_ko, stride_kh,
    stride_vb, stride_vo, stride_vh,
    stride_bt, table_width,
    stride_ot, stride_oh,
    window, soft_cap, sinks_ptr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
    DOT: tl.constexpr, TABLE_ROW: tl.constexpr, UPCAST: tl.constexpr, SLIDING: tl.constexpr, SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, tile, max_num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    qi = q_tile * BLOCK_Q + r // GROUP_PAD  # the row's query token within the sequence's chunk
    g = r % GROUP_PAD
    head = kvh * GROUP + g
    row_ok = (qi < q_len) & (g < GROUP)
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    tok = (q_start + qi).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = _dot_operand(q, DOT)
    q_pos = ctx + qi  # absolute position of each row's token

    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    table_row = table
    if TABLE_ROW > 0:
        cols = tl.arange(0, TABLE_ROW)
        table_row = tl.load(table + cols, mask=cols < table_width, other=0)
    kv_end = tl.minimum(seq_len, ctx + (q_tile + 1) * BLOCK_Q)  # the tile's last token's keys (causal)
    acc, l_i, m_i = _attend_causal(q, q_pos, ctx + q_tile * BLOCK_Q, table, table_row, kv_end, k_cache_ptr,
                                   v_cache_ptr, kvh, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
                                   scale * k_scale * 1.4426950408889634, window, soft_cap, dims, dim_ok,
                                   BLOCK_Q * GROUP_PAD, DIM_PAD, BLOCK_SIZE, BLOCK_N, PREC, TABLE_ROW, UPCAST,
                                   SLIDING, SOFT_CAP)
    if HAS_SINKS:  # each row's head's sink logit joins its denominator (a term with no value)
        l_i = l_i + _sink_weight(tl.load(sinks_ptr + head, mask=g < GROUP, other=0.0), m_i)
    o = acc * v_scale / l_i[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


# Rows of a tile: a decode fills GROUP of them, so a tile as tall as the prefill kernel's (64) wastes most of its
# dots on decode-heavy steps (LLaMA-7B, 190 decodes + 800 prompt tokens: 37.9 ms a step against 32.6 ms for the
# decode and prefill kernels, BENCHMARKS.md §50); 16 is the least tl.dot takes.
TILE_ROWS = 16


def unified_launch(group: int, dim_pad: int, block_size: int, query_bytes: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_Q, GROUP_PAD, BLOCK_N, num_warps, num_stages): TILE_ROWS rows (more if the group is larger) shared
    by BLOCK_Q tokens × the KV head's query heads padded to a power of two; the keys per tile, warps and
    stages of the prefill kernel (``prefill_launch``)."""
    _, block_n, warps, stages = prefill_launch(dim_pad, block_size, query_bytes)
    group_pad = triton.next_power_of_2(group)
    return max(1, TILE_ROWS // group_pad), group_pad, block_n, warps, stages


def unified_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8_dot_dtype: str | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    preload_table: bool | None = None,
    fp8_upcast: bool | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention of every query row of `query` [T, Hq, D] over its sequence's cached K/V, in one
    launch whose grid depends only on T and ``len(seq_lens)``. Sequence i owns rows
    ``query_start_loc[i]:query_start_loc[i+1]`` (len(seq_lens) + 1 entries, non-decreasing, at most T; padding
    sequences repeat the last value) and ``seq_lens[i]`` tokens of context including them. Writes `out`.
    `block_n` keys per tile, `num_warps`, `num_stages`: launch parameters (defaults: ``unified_launch``).
    `preload_table`: load each sequence's block-table row before the loop (default: when the table has at most 256
    columns and Triton has ``tl.gather``). `fp8_upcast`: convert an FP8 pool's V tiles right after their load (default
    True; False is the former path, kept for comparison). `sliding_window` W: each token sees its last W keys only;
    `logits_soft_cap` c: scores become c·tanh(s / c); `sinks` (GPT-OSS, float32 [Hq]): head h's softmax denominator
    gains exp(sinks[h]), a logit that weighs no value (``triton_attention.paged_decode_attention``)."""
    window, soft_cap = window_and_cap(sliding_window, logits_soft_cap)
    group, d = _check_shapes(query, key_cache, value_cache)
    _check_sinks(sinks, query)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"unified attention: {num_seqs} sequence lengths need {num_seqs + 1} query start "
                         f"offsets and {num_seqs} block-table rows, got {query_start_loc.shape[0]} and "
                         f"{block_tables.shape[0]}.")
    dot = resolve_fp8_dot(query, key_cache, fp8_dot_dtype)
    t, hk = query.shape[0], key_cache.shape[2]
    if t == 0 or num_seqs == 0:
        return out
    dim_pad = triton.next_power_of_2(d)
    block_q, group_pad, default_n, default_warps, default_stages = unified_launch(group, dim_pad, key_cache.shape[1],
                                                                                  query.element_size())
    block_n, num_warps, num_stages = block_n or default_n, num_warps or default_warps, num_stages or default_stages
    table_width = block_tables.shape[1]
    table_row = preloaded_table_row(table_width, preload_table)
    grid = (t // block_q + num_seqs, hk)
    _unified_kernel[grid](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out,
        scale, k_scale, v_scale, num_seqs,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), table_width,
        out.stride(0), out.stride(1),
        window, soft_cap, out if sinks is None else sinks,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=d, DIM_PAD=dim_pad,
        BLOCK_SIZE=key_cache.shape[1], BLOCK_Q=block_q, BLOCK_N=block_n, PREC=_precision(query, dot), DOT=dot,
        TABLE_ROW=table_row, UPCAST=key_cache.element_size() == 1 and fp8_upcast is not False,
        SLIDING=window > 0, SOFT_CAP=soft_cap > 0, HAS_SINKS=sinks is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
