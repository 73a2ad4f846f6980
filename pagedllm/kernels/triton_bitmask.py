"""Structured outputs on a GPU: apply the step's packed token bitmask to the logits in one Triton launch.

One program per (constrained row, block of the vocabulary): it reads that block's int32 words of the row's
bitmask and writes -inf into the logits wherever the token's bit is 0. It never reads the logits, and rows
that are not constrained are not visited. The plain-torch oracle is ``kernels.reference.apply_token_bitmask``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096  # tokens per program: 128 words of the bitmask


@triton.jit
def _apply_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab, stride_logits, stride_mask,
                          ALL_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    if ALL_ROWS:
        row = tl.program_id(0).to(tl.int64)
    else:
        row = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    tok = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tok < vocab
    words = tl.load(bitmask_ptr + row * stride_mask + tok // 32, mask=in_vocab, other=-1)
    banned = ((words >> (tok % 32)) & 1) == 0
    tl.store(logits_ptr + row * stride_logits + tok, float("-inf"), mask=in_vocab & banned)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """In place: ``logits[r, t] = -inf`` for each r in ``rows`` (int64 on the logits' device; None: every
    row) wherever bit ``t % 32`` of word ``t // 32`` of ``bitmask[r]`` is 0. ``bitmask`` (int32) is on the device or
    in pinned host memory, which the kernel reads in place. No host sync."""
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask must be contiguous along the vocabulary")
    n, vocab = (logits.shape[0] if rows is None else rows.numel()), logits.shape[1]
    if n == 0:
        return
    grid = (n, triton.cdiv(vocab, _BLOCK))
    _apply_bitmask_kernel[grid](logits, bitmask, bitmask if rows is None else rows, vocab, logits.stride(0),
                                bitmask.stride(0), ALL_ROWS=rows is None, BLOCK=_BLOCK, num_warps=4)
