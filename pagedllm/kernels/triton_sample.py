"""Sampling on a GPU in one launch: each row's argmax or a tempered inverse-CDF draw, with the raw logprob.

The general sampler runs a dozen torch ops per step (softmax, an exponential per vocabulary entry drawn
with each seeded row's own generator: one launch per row, clamp, divide, argmax, logsumexp, gathers): on
an H100 about 1.3 ms of host time for 64 seeded rows, more than a small model's whole forward pass. Here
one program per row reads the row once, and a random row part of it a second time:

1. the running max, its first index (greedy rows), the raw softmax normaliser and the tempered one
   ``Σ exp((x - m) · inv_temp)`` (online, rescaled as the max grows), as ``triton_greedy`` does;
2. block sums of ``exp((x - m) · inv_temp)``, accumulated in float64, until they pass ``u`` times the
   tempered total; inside that block a cumulative sum finds the token. A token of weight 0 (logit -inf: a
   grammar mask) is never chosen.

``u`` (one per row, drawn on the host from the row's own generator, or < 0 for a greedy row) makes a
seeded row's token depend only on its generator and its logits. The plain-torch reference is
``model.layers.inverse_cdf.inverse_cdf_sample`` on ``softmax(logits * inv_temp)``.

Structured outputs: with a packed token bitmask (xgrammar's layout, one int32 row per logits row, read in
place from pinned host memory) the rows whose ``inv_temp`` is negative see a banned token as -inf in both passes,
exactly as if ``triton_bitmask`` had masked the logits first, without that launch (~60-90 µs of host time
per constrained step on an H100's host, where a small model's whole step is ~1-2 ms).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton_greedy import online_max_step

_BLOCK = 4096


@triton.jit
def _load_row_block(base, tok, vocab, mask_base, mask_limit, HAS_MASK: tl.constexpr):
    """A block of the row's logits as float32; with a mask, a banned token (bit 0) reads as -inf. `mask_limit`
    is the vocabulary size for a masked row, 0 for one that is not (its mask row is never read)."""
    x = tl.load(base + tok, mask=tok < vocab, other=float("-inf")).to(tl.float32)
    if HAS_MASK:
        words = tl.load(mask_base + tok // 32, mask=tok < mask_limit, other=-1)
        x = tl.where(((words >> (tok % 32)) & 1) == 0, float("-inf"), x)
    return x


@triton.jit
def _sample_kernel(logits_ptr, stride, vocab, params_ptr, token_ptr, logprob_ptr, mask_ptr, mask_stride,
                   HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    offs = tl.arange(0, BLOCK)
    u = tl.load(params_ptr + 2 * row)  # float64
    signed_inv_temp = tl.load(params_ptr + 2 * row + 1).to(tl.float32)  # < 0: a row the bitmask constrains
    inv_temp = tl.abs(signed_inv_temp)
    mask_limit = 0
    mask_base = mask_ptr
    if HAS_MASK:
        mask_limit = vocab * (signed_inv_temp < 0).to(tl.int32)
        mask_base = mask_ptr + row * mask_stride
    # 1. The max, its first index, the raw normaliser and the tempered one (online, rescaled as the max grows).
    best = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.full((), 0, tl.int64)
    run_sum = tl.full((), 0.0, tl.float32)
    run_sum_t = tl.full((), 0.0, tl.float32)
    for start in range(0, vocab, BLOCK):
        tok = start + offs
        x = _load_row_block(base, tok, vocab, mask_base, mask_limit, HAS_MASK)
        old_max = best
        best, best_idx, run_sum, safe = online_max_step(x, start, best, best_idx, run_sum)
        run_sum_t = run_sum_t * tl.exp((old_max - safe) * inv_temp) + tl.sum(tl.exp((x - safe) * inv_temp), 0)
    token = best_idx
    if u >= 0:
        # 2. Block sums of exp((x - max) * inv_temp) until they pass u * total; the token inside that block.
        target = u * run_sum_t.to(tl.float64)
        cum = tl.full((), 0.0, tl.float64)
        found = tl.full((), 0, tl.int32)
        last_pos = tl.full((), 0, tl.int64)  # the last token of positive weight read (rounding fallback)
        for start in range(0, vocab, BLOCK):
            if found == 0:
                tok = start + offs
                x = _load_row_block(base, tok, vocab, mask_base, mask_limit, HAS_MASK)
                w = tl.exp((x - best) * inv_temp)
                block = tl.sum(w, 0).to(tl.float64)
                block_last = tl.max(tl.where(w > 0, tok, 0), 0).to(tl.int64)
                last_pos = tl.where(block > 0, block_last, last_pos)
                if cum + block > target:
                    inside = cum + tl.cumsum(w, 0).to(tl.float64)
                    hit = inside > target  # its first True has w > 0: the sum grows only there
                    first = tl.argmax(hit.to(tl.int32), 0).to(tl.int64) + start
                    # No hit: the block's tree sum beat its scan by rounding; its last token of weight.
                    token = tl.where(tl.max(hit.to(tl.int32), 0) > 0, first, block_last)
                    found = 1
                cum += block
        token = tl.where(found == 0, last_pos, token)  # the total's rounding put the target past the end
    x_tok = tl.load(base + token).to(tl.float32)
    tl.store(token_ptr + row, token)
    tl.store(logprob_ptr + row, x_tok - (best + tl.log(run_sum)))


def sample_with_logprob(logits: torch.Tensor, params: torch.Tensor,
                        bitmask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row of ``logits`` ``[rows, vocab]`` (any float dtype, contiguous along the vocabulary) and
    ``params`` ``[rows, 2]`` float64 on the same device (``u``, ``inv_temp``): ``u < 0`` takes the argmax (its
    first index), ``u`` in [0, 1) draws from ``softmax(logits * inv_temp)`` by inverse CDF → int64 tokens and
    the float32 log-probability of each under the raw ``softmax(logits)``. No host sync.

    With ``bitmask`` (int32 ``[>= rows, ceil(vocab / 32)]``, on the device or pinned host memory read in place),
    a row given as ``-inv_temp`` is masked (bit ``t % 32`` of word ``t // 32`` of ``bitmask[row]`` at 0 bans token
    ``t``): its token and logprob are those of the masked logits. (The sign is the flag so that the host builds
    no extra column: ~20 µs a step.)"""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be 2-D and contiguous along the vocabulary, got shape "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    rows, vocab = logits.shape
    if params.shape != (rows, 2) or params.dtype != torch.float64 or not params.is_contiguous():
        raise ValueError(f"params must be a contiguous float64 tensor of shape ({rows}, 2), got "
                         f"{params.dtype} {tuple(params.shape)}")
    if bitmask is not None and (bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.stride(1) != 1
                                or bitmask.shape[0] < rows or bitmask.shape[1] * 32 < vocab):
        raise ValueError(f"bitmask must be int32 [>= {rows}, >= {triton.cdiv(vocab, 32)}] and contiguous along "
                         f"the vocabulary, got {bitmask.dtype} {tuple(bitmask.shape)}")
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        mask = tokens if bitmask is None else bitmask  # any pointer when there is no mask: never read
        _sample_kernel[(rows,)](logits, logits.stride(0), vocab, params, tokens, logprobs, mask,
                                0 if bitmask is None else bitmask.stride(0), HAS_MASK=bitmask is not None,
                                BLOCK=_BLOCK, num_warps=8)
    return tokens, logprobs
