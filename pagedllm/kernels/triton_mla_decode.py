"""Split-KV decode of multi-head latent attention (MLA, DeepSeek-V2/V3) over the cached latent, in Triton.

The pool holds one row per token, [c_kv (latent_dim) ; k_pe (rope dim)], read by every query head (one KV head);
queries are [q_latent ; q_pe] per head. As vLLM's ``_fwd_grouped_kernel_stage1`` (BLOCK_DMODEL 512, BLOCK_DPE 64),
a score is two dots, q_latent·c_kv + q_pe·k_pe, so the 576-wide row is never padded to 1 024, and the value is the
c_kv part of the key tile already loaded: each cache row is read once. One program per (sequence, block of BLOCK_H
query heads, split) holds a [BLOCK_H, latent] float32 accumulator; splits cover equal shares of the context
(computed in-kernel from ``seq_lens``, as ``triton_attention._decode_kernel``), so the launch is CUDA-graph safe, and
write unnormalised partials into a ``DecodeWorkspace`` that a second, small kernel merges (``_merge_splits``).

Output: the first latent_dim values of each head (Σ p·c_kv / Σ p). The last (rope) values of each head's output row
are NOT written: they keep whatever the output buffer held, and callers ignore them (MLA drops them).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels import kv_quant
from pagedllm.kernels.triton_attention import (
    DecodeWorkspace,
    _merge_splits,
    _precision,
    choose_num_splits,
    preloaded_table_row,
)

# Query heads per program: the rows of the tile's dots (tensor cores need >= 16).
MLA_BLOCK_H = 16
# Splits the merge reads per step ([SPLIT_CHUNK, latent] float32 per program); one value whatever the split count,
# so the merge compiles once.
_MERGE_CHUNK = 8


@triton.jit(do_not_specialize=["num_splits"])
def _mla_decode_kernel(
    q_ptr, kv_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_ml_ptr,
    scale,
    stride_qt, stride_qh,
    stride_kb, stride_ko,
    stride_bt, table_width,
    stride_ot, stride_oh,
    num_heads, num_splits,
    WRITE_PARTIAL: tl.constexpr, TABLE_ROW: tl.constexpr, BLOCK_H: tl.constexpr,
    LATENT_DIM: tl.constexpr, LATENT_PAD: tl.constexpr, ROPE_DIM: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PREC: tl.constexpr,
):
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if TABLE_ROW > 0:
        # Loaded next to seq_len: the first K addresses then wait for one memory round trip, not two.
        cols = tl.arange(0, TABLE_ROW)
        table_row = tl.load(table + cols, mask=cols < table_width, other=0)
    seq_len = tl.load(seq_lens_ptr + seq)
    tiles = tl.cdiv(seq_len, TILE)
    tiles_per_split = tl.cdiv(tiles, num_splits)
    start = split * tiles_per_split * TILE
    end = tl.minimum(start + tiles_per_split * TILE, seq_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    lat = tl.arange(0, LATENT_PAD)
    lat_ok = lat < LATENT_DIM
    rope = tl.arange(0, ROPE_PAD)
    rope_ok = rope < ROPE_DIM
    q_row = q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + lat[None, :], mask=head_ok[:, None] & lat_ok[None, :], other=0.0)
    q_pe = tl.load(q_row + LATENT_DIM + rope[None, :], mask=head_ok[:, None] & rope_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LATENT_PAD], tl.float32)
    offs = tl.arange(0, TILE)
    qk_scale = scale * 1.4426950408889634  # exp(x) = exp2(x·log2 e)
    for tile_start in range(start, end, TILE):
        pos = tile_start + offs
        ok = pos < end
        if TABLE_ROW > 0:
            blk = tl.gather(table_row, tl.minimum(pos // BLOCK_SIZE, TABLE_ROW - 1), 0).to(tl.int64)
        else:
            blk = tl.load(table + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        row = kv_ptr + blk * stride_kb + (pos % BLOCK_SIZE) * stride_ko
        c_kv = tl.load(row[:, None] + lat[None, :], mask=ok[:, None] & lat_ok[None, :], other=0.0).to(q_lat.dtype)
        k_pe = tl.load(row[:, None] + LATENT_DIM + rope[None, :], mask=ok[:, None] & rope_ok[None, :],
                       other=0.0).to(q_pe.dtype)
        s = tl.dot(q_lat, tl.trans(c_kv), input_precision=PREC)
        s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision=PREC)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # The values are the c_kv part of the keys just loaded.
        acc = acc * alpha[:, None] + tl.dot(p.to(c_kv.dtype), c_kv, input_precision=PREC)
        m_i = m_new

    if not WRITE_PARTIAL:
        o = acc / l_i[:, None]
        tl.store(out_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + lat[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & lat_ok[None, :])
    else:
        # Partials [S, H, num_splits, LATENT_DIM] unnormalised, plus (max, sum) in log2 units (_merge_splits' layout).
        idx = (seq * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + idx[:, None] * LATENT_DIM + lat[None, :], acc,
                 mask=head_ok[:, None] & lat_ok[None, :])
        tl.store(part_ml_ptr + idx * 2, m_i, mask=head_ok)
        tl.store(part_ml_ptr + idx * 2 + 1, l_i, mask=head_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _mla_reduce_kernel(
    part_out_ptr, part_ml_ptr, out_ptr, stride_ot, stride_oh, num_splits,
    LATENT_DIM: tl.constexpr, LATENT_PAD: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
):
    """One program per (sequence, head): merges its splits' partials into the output's first LATENT_DIM values."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    _merge_splits(part_out_ptr, part_ml_ptr, out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh, stride_oh,
                  seq * tl.num_programs(1) + head, num_splits, 1, 1, LATENT_DIM, LATENT_PAD, SPLIT_CHUNK)


def check_mla_supported(key_cache: torch.Tensor, sliding_window: int | None, logits_soft_cap: float | None) -> None:
    """ValueError for what the MLA decode does not take: FP8 pools, sliding windows, logit soft caps."""
    if kv_quant.is_fp8(key_cache.dtype):
        raise ValueError("the MLA decode kernel reads 16- or 32-bit latent pools only; FP8 KV is refused with MLA.")
    if sliding_window is not None or logits_soft_cap is not None:
        raise ValueError("the MLA decode kernel has no sliding window or logit soft cap (DeepSeek's MLA has neither).")


def mla_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    latent_dim: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    tile: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    programs_per_sm: int = 2,
    min_tiles_per_split: int = 4,
    workspace: DecodeWorkspace | None = None,
    preload_table: bool | None = None,
) -> torch.Tensor:
    """One query token per sequence: query [S, H, D] → out [S, H, D] over the latent pool
    `kv_cache` [num_blocks, block_size, 1, D], D = latent_dim + rope dim, each row [c_kv ; k_pe].

    Writes out[..., :latent_dim] only (module doc). `max_seq_len` (a host int) bounds the split count; by default
    ~`programs_per_sm` programs per SM with at least `min_tiles_per_split` tiles each (a split's partial,
    BLOCK_H × latent float32, is as large as a 32-key tile of the latent: fewer, longer splits write less).
    `tile`: keys per loop iteration (default 32); `num_warps` (default 4), `num_stages` (default 2): launch
    parameters. `workspace`, `preload_table`: as in ``triton_attention.paged_decode_attention``."""
    check_mla_supported(kv_cache, None, None)
    num_seqs, num_heads, d = query.shape
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1 or kv_cache.shape[3] != d:
        raise ValueError(f"MLA decode: the latent pool must be [blocks, block_size, 1, {d}], got "
                         f"{tuple(kv_cache.shape)}.")
    if not 0 < latent_dim < d:
        raise ValueError(f"latent_dim {latent_dim} must lie in (0, head size {d}): rows are [c_kv ; k_pe].")
    for name, t in (("query", query), ("kv_cache", kv_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension.")
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    block_size = kv_cache.shape[1]
    tile = max(tile or 32, triton.next_power_of_2(block_size))
    head_blocks = triton.cdiv(num_heads, MLA_BLOCK_H)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, head_blocks, max_seq_len, tile, query.device, programs_per_sm,
                                       min_tiles_per_split)
    part_out = part_ml = out  # unused with a single split
    if num_splits > 1:
        sizes = (0, num_seqs * num_heads * num_splits, latent_dim)
        if workspace is None:
            workspace = DecodeWorkspace.allocate(query.device, *sizes)
        else:
            workspace.reserve(*sizes)
        part_out, part_ml = workspace.part_out, workspace.part_ml
    table_width = block_tables.shape[1]
    latent_pad = max(16, triton.next_power_of_2(latent_dim))
    _mla_decode_kernel[(num_seqs, head_blocks, num_splits)](
        query, kv_cache, block_tables, seq_lens,
        out, part_out, part_ml,
        scale,
        query.stride(0), query.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        block_tables.stride(0), table_width,
        out.stride(0), out.stride(1),
        num_heads, num_splits,
        WRITE_PARTIAL=num_splits > 1, TABLE_ROW=preloaded_table_row(table_width, preload_table),
        BLOCK_H=MLA_BLOCK_H, LATENT_DIM=latent_dim, LATENT_PAD=latent_pad,
        ROPE_DIM=d - latent_dim, ROPE_PAD=max(16, triton.next_power_of_2(d - latent_dim)),
        BLOCK_SIZE=block_size, TILE=tile, PREC=_precision(query),
        num_warps=num_warps or 4, num_stages=num_stages or 2,
    )
    if num_splits > 1:
        _mla_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_ml, out, out.stride(0), out.stride(1), num_splits,
            LATENT_DIM=latent_dim, LATENT_PAD=latent_pad,
            SPLIT_CHUNK=_MERGE_CHUNK, num_warps=4,
        )
    return out
