"""PagedAttention in Triton: decode (split-KV / flash-decoding) and prefill chunks over paged KV.

Cache layout as in ``kernels/reference.py``: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Both kernels gather K/V rows through the block table (``table[pos // block_size]``), so a tile may
span several blocks of any size, and use an online softmax (eq. 4 of the paper).

* Decode: one program per (sequence, KV head, split). All query heads sharing the KV head form the
  rows of one tile (padded to ≥ 16 so ``tl.dot`` uses tensor cores); each split covers an equal share
  of the sequence's context, computed in-kernel from ``seq_lens``, so the split count depends only on
  host-known numbers and the launch is CUDA-graph safe. A second kernel merges the splits.
* Prefill: one program per (sequence, query tile, query head) attends causally to the sequence's
  cached context and its own new tokens, all read through the block table (chunked prefill and
  prefix caching both reduce to this).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_ml_ptr,
    scale,
    stride_qt, stride_qh,
    stride_kb, stride_ko, stride_kh,
    stride_vb, stride_vo, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    num_splits,
    WRITE_PARTIAL: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PREC: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    # This split's share of the context, in whole tiles.
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

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    offs = tl.arange(0, TILE)
    qk_scale = scale * 1.4426950408889634  # exp(x) = exp2(x·log2 e)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(start, end, TILE):
        pos = tile_start + offs
        ok = pos < end
        blk = tl.load(table + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        k = tl.load(k_cache_ptr + blk[:, None] * stride_kb + slot[:, None] * stride_ko + kvh * stride_kh + dims[None, :],
                    mask=ok[:, None] & dim_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + blk[:, None] * stride_vb + slot[:, None] * stride_vo + kvh * stride_vh + dims[None, :],
                    mask=ok[:, None] & dim_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k).to(q.dtype), input_precision=PREC) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new

    if not WRITE_PARTIAL:
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


@triton.jit
def _reduce_kernel(
    part_out_ptr, part_ml_ptr, out_ptr,
    stride_ot, stride_oh,
    num_splits,
    SPLIT_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
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
    w = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)
    acc = tl.load(part_out_ptr + (base + sp)[:, None] * HEAD_DIM + dims[None, :],
                  mask=sp_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims, o.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    scale, seq_offset,
    stride_qt, stride_qh,
    stride_kb, stride_ko, stride_kh,
    stride_vb, stride_vo, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
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
    q_pos = ctx + rows  # absolute position of each query row

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    qk_scale = scale * 1.4426950408889634
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Keys up to the last row's position (causal), never past the sequence.
    kv_end = tl.minimum(seq_len, ctx + (m_tile + 1) * BLOCK_M)
    offs = tl.arange(0, BLOCK_N)
    for n_start in range(0, kv_end, BLOCK_N):
        pos = n_start + offs
        ok = pos < kv_end
        blk = tl.load(table + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        k = tl.load(k_cache_ptr + blk[:, None] * stride_kb + slot[:, None] * stride_ko + kvh * stride_kh + dims[None, :],
                    mask=ok[:, None] & dim_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + blk[:, None] * stride_vb + slot[:, None] * stride_vo + kvh * stride_vh + dims[None, :],
                    mask=ok[:, None] & dim_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k).to(q.dtype), input_precision=PREC) * qk_scale
        visible = ok[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head * stride_oh + dims[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    if not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _precision(query: torch.Tensor) -> str:
    """float32 stays exact (IEEE) in tl.dot; 16-bit types use the tensor cores natively."""
    return "ieee" if query.dtype == torch.float32 else "tf32"


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


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, tile: int, device: torch.device, programs_per_sm: int = 2,
    min_tiles_per_split: int = 1,
) -> int:
    """Splits per sequence so that ~`programs_per_sm` programs per SM run; from host-known numbers only (no sync)."""
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 4
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
    num_warps: int = 4,
    num_stages: int = 3,
    programs_per_sm: int = 2,
    min_tiles_per_split: int = 1,
) -> torch.Tensor:
    """One query token per sequence: query [S, Hq, D] → [S, Hq, D] over each sequence's seq_lens[i] keys.

    `max_seq_len` (a host int, e.g. max_model_len under CUDA graphs) only bounds the split count.
    """
    group, d = _check_shapes(query, key_cache, value_cache)
    num_seqs, hq = query.shape[0], query.shape[1]
    hk, block_size = key_cache.shape[2], key_cache.shape[1]
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    dim_pad = triton.next_power_of_2(d)
    if tile is None:
        tile = max(16, min(64, 8192 // dim_pad))
    tile = max(tile, triton.next_power_of_2(block_size))
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, hk, max_seq_len, tile, query.device, programs_per_sm,
                                       min_tiles_per_split)
    if num_splits > 1:
        part_out = torch.empty((num_seqs, hq, num_splits, d), dtype=torch.float32, device=query.device)
        part_ml = torch.empty((num_seqs, hq, num_splits, 2), dtype=torch.float32, device=query.device)
    else:
        part_out = part_ml = out  # unused
    _decode_kernel[(num_seqs, hk, num_splits)](
        query, key_cache, value_cache, block_tables, seq_lens,
        out, part_out, part_ml,
        scale,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        num_splits, WRITE_PARTIAL=num_splits > 1, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d, DIM_PAD=dim_pad, BLOCK_SIZE=block_size, TILE=tile, PREC=_precision(query),
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _reduce_kernel[(num_seqs, hq)](
            part_out, part_ml, out, out.stride(0), out.stride(1),
            num_splits, SPLIT_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=d, DIM_PAD=dim_pad, num_warps=4,
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
) -> None:
    """Sequences first_seq .. first_seq+num_seqs-1 of a flat batch: causal attention of their query tokens
    (rows query_start_loc[i]:query_start_loc[i+1] of `query`) over all seq_lens[i] cached keys; writes `out`."""
    group, d = _check_shapes(query, key_cache, value_cache)
    if num_seqs == 0:
        return
    hq = query.shape[1]
    block_size = key_cache.shape[1]
    dim_pad = triton.next_power_of_2(d)
    block_m = 64 if dim_pad <= 64 else 32
    block_n = max(32, triton.next_power_of_2(block_size)) if block_size <= 64 else block_size
    grid = (num_seqs, triton.cdiv(max_query_len, block_m), hq)
    _prefill_kernel[grid](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out,
        scale, first_seq,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=d, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, PREC=_precision(query),
        num_warps=4, num_stages=2,
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``reference.paged_attention`` (K/V already cached): decodes, then prefill chunks."""
    if out is None:
        out = torch.empty_like(query)
    nd = meta.num_decodes
    if nd:
        max_len = max(meta.seq_lens_cpu[:nd])
        paged_decode_attention(query[:nd], key_cache, value_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                               scale, max_len, out=out[:nd])
    n_prefill = meta.num_seqs - nd
    if n_prefill:
        max_q = max(meta.query_lens_cpu[nd:])
        paged_prefill_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, scale, nd, n_prefill, max_q, out)
    return out
