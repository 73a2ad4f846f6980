"""Device-side n-gram speculation in two kernels per step (`"method": "ngram_gpu"` on CUDA).

`spec_decode/device_ngram.py` states a step as plain torch: the proposal (`propose_ngrams`), the decode rows
(`build_rows`, copied into the decode graph's static buffers), then, after the forward pass, greedy acceptance
and the history append (`accept_greedy`, `append_history`). As torch ops that is ~70 small kernels, 0.25 ms of
a 1.2 ms step on an H100 even inside CUDA graphs. Here:

- `propose_rows`: one program per sequence scans its history once (every n-gram length at once: the run of
  tokens equal to the suffix, ending at each position), picks the continuation by the host's rule, and writes
  the drafts and the sequence's k + 1 rows straight into the static buffers; one more program writes the
  bucket's padding rows.
- `accept_append`: after `greedy_sample_with_logprob` (the kernel plain greedy decoding samples with, so
  ties break the same way), one program per sequence counts the accepted drafts, appends the emitted tokens
  to the history, moves the length and the budget, and packs the step's results for the host.

The torch functions stay the reference (tests/test_triton_ngram.py) and the CPU path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_SCAN_BLOCK = 256
_TABLE_BLOCK = 128


@triton.jit
def _propose_rows_kernel(
    hist_ptr, hist_stride, width, lens_ptr, idx_ptr, tables_ptr, tables_stride, table_width, capacity_ptr,
    drafts_ptr, num_real_ptr,
    ids_ptr, pos_ptr, slot_ptr, seq_lens_ptr, rows_tables_ptr, rows_tables_stride,
    num_seqs, num_rows_bucket, block_size, limit,
    K: tl.constexpr, Q_PAD: tl.constexpr, NMIN: tl.constexpr, NMAX: tl.constexpr, N_PAD: tl.constexpr,
    SCAN: tl.constexpr, TBLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    Q: tl.constexpr = K + 1
    if i < num_seqs:
        slot = tl.load(idx_ptr + i)
        length = tl.load(lens_ptr + slot)
        row = hist_ptr + slot * hist_stride
        # The suffix's last NMAX tokens (before position 0: -2, which matches nothing).
        n_offs = tl.arange(0, N_PAD)
        at = length - NMAX + n_offs
        suffix = tl.load(row + at, mask=(n_offs < NMAX) & (at >= 0), other=-2)
        n_len = n_offs  # slot n of the per-length trackers stands for n-grams of length n
        latest = tl.full((N_PAD,), -1, tl.int64)
        latest_full = tl.full((N_PAD,), -1, tl.int64)
        scan = tl.arange(0, SCAN)
        for start in range(0, length, SCAN):
            ends = start + 1 + scan  # a continuation starting at `ends`, after a window ending at ends - 1
            valid = ends <= length - 1
            run = tl.zeros((SCAN,), tl.int64)
            alive = valid
            for j in tl.static_range(NMAX):
                p = ends - 1 - j
                tok = tl.load(row + p, mask=valid & (p >= 0), other=-1)
                want = tl.sum(tl.where(n_offs == NMAX - 1 - j, suffix, 0), 0)
                alive = alive & (tok == want)
                run += alive.to(tl.int64)
            hit = valid[:, None] & (run[:, None] >= n_len[None, :])
            e2 = ends.to(tl.int64)[:, None]
            latest = tl.maximum(latest, tl.max(tl.where(hit, e2, -1), 0))
            room = (e2 + K) <= length
            latest_full = tl.maximum(latest_full, tl.max(tl.where(hit & room, e2, -1), 0))
        usable = (n_len >= NMIN) & (n_len <= NMAX) & (latest >= 0)
        best = tl.max(tl.where(usable, n_len, 0), 0)
        pick = (n_len == best) & (best > 0)
        chosen_any = tl.max(tl.where(pick, latest, -1), 0)
        chosen_full = tl.max(tl.where(pick, latest_full, -1), 0)
        chosen = tl.where(chosen_full >= 0, chosen_full, chosen_any)
        has = chosen >= 0
        last_pos = tl.maximum(length - 1, 0)
        last = tl.load(row + last_pos)
        # Row j: the last token (j = 0), then draft j - 1.
        q_offs = tl.arange(0, Q_PAD)
        in_q = q_offs < Q
        d = q_offs - 1
        cols = tl.minimum(tl.maximum(chosen + d, 0), width - 1)
        drafted = tl.load(row + cols, mask=in_q & (q_offs >= 1), other=0)
        token = tl.where(q_offs == 0, last, tl.where(has, drafted, last))
        tl.store(drafts_ptr + i * K + d, token, mask=in_q & (q_offs >= 1))
        num_real = tl.where(has, tl.minimum(tl.maximum(length - chosen, 0), K), 0)
        tl.store(num_real_ptr + i, num_real)
        raw = length - 1 + q_offs
        cap = tl.load(capacity_ptr + i)
        writable = (raw < cap) & (raw < limit)
        pos = tl.minimum(raw, limit - 1)
        entry = tl.minimum(pos // block_size, table_width - 1)
        block = tl.load(tables_ptr + i * tables_stride + entry, mask=in_q, other=0).to(tl.int64)
        slots = tl.where(writable, block * block_size + pos % block_size, -1)
        r = i * Q + q_offs
        tl.store(ids_ptr + r, token, mask=in_q)
        tl.store(pos_ptr + r, pos, mask=in_q)
        tl.store(slot_ptr + r, slots, mask=in_q)
        tl.store(seq_lens_ptr + r, (pos + 1).to(tl.int32), mask=in_q)
        t_offs = tl.arange(0, TBLOCK)
        for c0 in range(0, table_width, TBLOCK):
            c = c0 + t_offs
            entries = tl.load(tables_ptr + i * tables_stride + c, mask=c < table_width, other=0)
            for j in tl.static_range(Q):
                tl.store(rows_tables_ptr + (i * Q + j) * rows_tables_stride + c, entries, mask=c < table_width)
    else:  # the bucket's padding rows: token 0 at position 0, no KV write, one token of context
        t_offs = tl.arange(0, TBLOCK)
        for r0 in range(num_seqs * Q, num_rows_bucket, TBLOCK):
            r = r0 + t_offs
            m = r < num_rows_bucket
            tl.store(ids_ptr + r, tl.zeros((TBLOCK,), tl.int64), mask=m)
            tl.store(pos_ptr + r, tl.zeros((TBLOCK,), tl.int64), mask=m)
            tl.store(slot_ptr + r, tl.full((TBLOCK,), -1, tl.int64), mask=m)
            tl.store(seq_lens_ptr + r, tl.full((TBLOCK,), 1, tl.int32), mask=m)
            tl.store(rows_tables_ptr + r * rows_tables_stride, tl.zeros((TBLOCK,), tl.int32), mask=m)


def propose_rows(hist: torch.Tensor, lens: torch.Tensor, idx: torch.Tensor, tables: torch.Tensor,
                 capacity: torch.Tensor, k: int, nmin: int, nmax: int, block_size: int, max_model_len: int,
                 drafts: torch.Tensor, num_real: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                 num_rows_bucket: int) -> None:
    """For the `n = len(idx)` sequences in rows `idx` of `hist` / `lens`: drafts [n, k] and num_real [n] as
    `propose_ngrams`, and rows 0 .. n (k + 1) of the static buffers (`input_ids`, `positions`, `slot_mapping`
    int64; `seq_lens` int32; `block_tables` int32 [rows, >= tables.shape[1]]) as `build_rows`, rows up to
    `num_rows_bucket` made padding. `tables` [n, B] int32 and `capacity` [n] are in member order."""
    n = int(idx.shape[0])
    q = k + 1
    if nmin < 1 or nmax < nmin:
        raise ValueError(f"n-gram lengths must satisfy 1 <= nmin <= nmax, got {nmin}, {nmax}")
    if num_rows_bucket < n * q or block_tables.shape[1] < tables.shape[1]:
        raise ValueError(f"static buffers too small: bucket {num_rows_bucket} for {n * q} rows, "
                         f"{block_tables.shape[1]} table columns for {tables.shape[1]}")
    table_width = int(tables.shape[1])
    limit = min(max_model_len, table_width * block_size)
    _propose_rows_kernel[(n + 1,)](
        hist, hist.stride(0), hist.shape[1], lens, idx, tables, tables.stride(0), table_width, capacity,
        drafts, num_real, input_ids, positions, slot_mapping, seq_lens, block_tables, block_tables.stride(0),
        n, num_rows_bucket, block_size, limit,
        K=k, Q_PAD=triton.next_power_of_2(q), NMIN=nmin, NMAX=nmax, N_PAD=triton.next_power_of_2(nmax + 1),
        SCAN=_SCAN_BLOCK, TBLOCK=_TABLE_BLOCK,
    )


@triton.jit
def _accept_append_kernel(
    pred_ptr, logprob_ptr, drafts_ptr, num_real_ptr, idx_ptr, hist_ptr, hist_stride, width, lens_ptr,
    remaining_ptr, out_ptr, out_stride, K: tl.constexpr, Q_PAD: tl.constexpr,
):
    i = tl.program_id(0)
    Q: tl.constexpr = K + 1
    q_offs = tl.arange(0, Q_PAD)
    in_q = q_offs < Q
    pred = tl.load(pred_ptr + i * Q + q_offs, mask=in_q, other=0)
    logprob = tl.load(logprob_ptr + i * Q + q_offs, mask=in_q, other=0.0)
    draft = tl.load(drafts_ptr + i * K + q_offs, mask=q_offs < K, other=-1)
    # Accepted: the drafts before the first one that differs from the target's argmax.
    differs = (q_offs < K) & (draft != pred)
    first_diff = tl.min(tl.where(differs | (q_offs >= K), q_offs, Q_PAD), 0)
    accepted = tl.minimum(first_diff, K).to(tl.int64)
    slot = tl.load(idx_ptr + i)
    remaining = tl.load(remaining_ptr + slot)
    count = tl.minimum(accepted + 1, tl.maximum(remaining, 0))
    length = tl.load(lens_ptr + slot)
    cols = tl.minimum(length + q_offs, width - 1)
    tl.store(hist_ptr + slot * hist_stride + cols, pred, mask=in_q)
    tl.store(lens_ptr + slot, length + count)
    tl.store(remaining_ptr + slot, remaining - count)
    num_real = tl.load(num_real_ptr + i)
    base = out_ptr + i * out_stride
    tl.store(base + q_offs, pred.to(tl.float64), mask=in_q)
    tl.store(base + Q + q_offs, logprob.to(tl.float64), mask=in_q)
    tl.store(base + 2 * Q, count.to(tl.float64))
    tl.store(base + 2 * Q + 1, tl.minimum(accepted, num_real).to(tl.float64))
    tl.store(base + 2 * Q + 2, num_real.to(tl.float64))


def accept_append(pred: torch.Tensor, logprob: torch.Tensor, drafts: torch.Tensor, num_real: torch.Tensor,
                  idx: torch.Tensor, hist: torch.Tensor, lens: torch.Tensor, remaining: torch.Tensor,
                  out: torch.Tensor) -> None:
    """Greedy acceptance for the n = len(idx) sequences from the rows' argmax `pred` [n (k + 1)] and its
    logprob: as `accept_greedy` + `append_history`, with `remaining` decreased by the count, and `out[:n]`
    (float64, [n, 2 (k + 1) + 3]) = tokens, logprobs, count, accepted real drafts, real drafts."""
    n, k = int(idx.shape[0]), int(drafts.shape[1])
    if n:
        _accept_append_kernel[(n,)](pred, logprob, drafts, num_real, idx, hist, hist.stride(0), hist.shape[1],
                                    lens, remaining, out, out.stride(0), K=k, Q_PAD=triton.next_power_of_2(k + 1))
