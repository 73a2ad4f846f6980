"""Inverse-CDF sampling: one uniform number per sample instead of one exponential per vocabulary entry.

The Gumbel-max race (``argmax(probs / q)``, ``q ~ Exponential(1)``) draws a random number for every token
of the vocabulary. On a CPU torch's ``exponential_`` costs ~23 ns per number (72 ms for 64 rows of a
49 152-token vocabulary, 1.1 ms for one row with its own generator), more than a decode step's forward pass
at small batch; on a GPU a seeded row needs a launch of its own. Here a sample costs one uniform ``u``
(drawn on the host from the row's generator) and a search in the row's cumulative distribution.

Exactness: a token's chance is the width of its interval in the cumulative sums, which floating point
rounds. The sums are two-level: float32 within blocks of ``CDF_BLOCK`` tokens, block totals accumulated in
float64, so a token's probability is off by a few ulps of its block's total rather than of 1. A token with
probability 0 (masked, top-k/top-p/min-p filtered) is never returned.
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from pagedllm.device_utils import async_tensor_h2d

CDF_BLOCK = 256

#: A seeded sequence's source of random numbers: the engine's ``random.Random``, or a torch generator.
SampleGenerator = random.Random | torch.Generator


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row of ``probs`` ``[rows, vocab]`` (non-negative, any scale) and ``u`` ``[rows]`` in [0, 1):
    the first token whose cumulative probability exceeds ``u`` times the row's total → int64 ``[rows]``.

    Two levels, so that no cumulative sum over the whole vocabulary is taken (torch's CPU cumsum is a
    sequential loop: 2.8 ms for 64 rows of 49 152): the block totals (float32 sums, accumulated in float64)
    choose a block, then a float32 cumulative sum of that block alone chooses the token."""
    rows, vocab = probs.shape
    num_blocks = -(-vocab // CDF_BLOCK)
    p = probs.float()
    if num_blocks * CDF_BLOCK != vocab:
        p = F.pad(p, (0, num_blocks * CDF_BLOCK - vocab))
    blocks = p.view(rows, num_blocks, CDF_BLOCK)
    ends = blocks.sum(-1).double().cumsum(-1)  # [rows, num_blocks]
    total = ends[:, -1:]
    # v < total always (u < 1, then rounding): the chosen block has a positive total.
    v = torch.minimum(u.view(rows, 1).double() * total, torch.nextafter(total, torch.zeros_like(total)))
    blk = torch.searchsorted(ends, v, right=True)  # ends[blk - 1] <= v < ends[blk]
    starts = F.pad(ends, (1, 0))[:, :-1]  # ends[blk - 1], 0 for the first block: v - start >= 0 exactly
    v_in = (v - starts.gather(1, blk)).float()
    in_block = blocks.gather(1, blk.unsqueeze(-1).expand(rows, 1, CDF_BLOCK)).squeeze(1).cumsum(-1)
    j = torch.searchsorted(in_block, v_in, right=True)
    # The block's sequential sum can fall short of its vectorised total by rounding, so v_in can reach it:
    # then the block's last token with p > 0 (the first index where the sum reaches its end).
    last = torch.searchsorted(in_block, in_block[:, -1:].contiguous(), right=False)
    return (blk * CDF_BLOCK + torch.minimum(j, last)).squeeze(1)


def uniforms(n: int, generator: SampleGenerator | None) -> torch.Tensor:
    """``n`` uniforms in [0, 1) (float64) from ``generator``: on the host for a ``random.Random`` or a CPU
    torch generator (None: torch's default one), on its device for a device generator."""
    if isinstance(generator, random.Random):
        return torch.tensor([generator.random() for _ in range(n)], dtype=torch.float64)
    if generator is None:
        return torch.rand(n, dtype=torch.float64)
    return torch.rand(n, generator=generator, device=generator.device, dtype=torch.float64)


def draw_uniforms(spans: list[tuple[int, int, SampleGenerator]], total: int, device: torch.device) -> torch.Tensor:
    """``total`` uniforms in [0, 1) (float64) on ``device``: positions ``start .. start + count`` from each
    span's generator, the rest from torch's default CPU generator. Host generators (the engine's
    ``random.Random`` per seeded sequence: ~1 µs a draw, against several µs for a torch call) fill one host
    list that goes to the device in one copy; a generator on a device draws there."""
    values = torch.rand(total, dtype=torch.float64).tolist()
    on_device: list[tuple[int, torch.Tensor]] = []
    for start, count, gen in spans:
        if isinstance(gen, random.Random):
            for j in range(start, start + count):
                values[j] = gen.random()
        elif gen.device.type == "cpu":
            values[start:start + count] = uniforms(count, gen).tolist()
        else:
            on_device.append((start, uniforms(count, gen)))
    u = async_tensor_h2d(values, torch.float64, device)
    for start, piece in on_device:
        u[start:start + piece.numel()] = piece.to(device)
    return u
