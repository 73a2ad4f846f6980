"""N-gram speculation kept on the device (`"method": "ngram_gpu"`): proposal, step inputs and greedy acceptance
as tensor operations, so that a speculating step never waits for the host (docs/device_side_speculation.md).

The device holds each speculating sequence's token history and length. One step, for the sequences in
`slots` (S of them, k draft tokens each):

1. `propose_ngrams`: the k tokens that followed the most recent earlier occurrence of the sequence's last n
   tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`), as `NgramProposer` does on the host. A
   sequence without a match still gets k (useless) draft tokens: rows stay fixed, and verification keeps the
   output exact whatever the drafts are.
2. `build_rows`: S × (k + 1) decode rows (the last token and the drafts), with positions, KV slots and
   context lengths computed from the device lengths, so a step can be queued before the host knows how many
   tokens the previous one accepted. Rows past a sequence's allocated blocks write no KV (slot -1).
3. The target's forward pass over those rows (the caller's: a decode graph on CUDA).
4. `accept_greedy`: each row's argmax; the longest prefix of drafts equal to it, plus the target's next token,
   capped by the sequence's remaining token budget, is appended to the history.

Only greedy sequences use this (the argmax chain is what they would emit anyway, so exactness needs no
random state); the engine reads each step's emitted tokens one step later (engine/device_spec_loop.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def propose_ngrams(hist: torch.Tensor, lens: torch.Tensor, k: int, nmin: int, nmax: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts [S, k] continuing each row of `hist` [S, W] (its first `lens[i]` tokens), and how many of them
    came from a match [S] (0: no n-gram recurred; the drafts are then a repeat of the last token).

    The host rule (`NgramProposer`): the longest n in [nmin, nmax] whose last-n-token suffix occurs earlier
    (never the suffix itself); among its occurrences the most recent with k tokens after it inside the sequence,
    else the most recent. Here every n at once, in a fixed number of kernels (a CUDA graph holds them): for each
    window of nmax tokens, the length of its trailing run of tokens equal to the suffix's."""
    rows, width = hist.shape
    dev = hist.device
    # Left padding with a value no token has, so matches that start near position 0 have a whole window.
    padded = torch.cat([torch.full((rows, nmax - 1), -1, dtype=hist.dtype, device=dev), hist], dim=1)
    offs = torch.arange(nmax, device=dev)
    at = lens[:, None] - nmax + offs[None, :]  # the suffix's positions; before 0: -2, which matches nothing
    suffix = torch.where(at >= 0, hist.gather(1, at.clamp(min=0)), torch.full_like(at, -2))
    windows = padded.unfold(1, nmax, 1)  # window w: tokens at w - nmax + 1 .. w of hist
    equal = windows == suffix[:, None, :]
    run = equal.flip(-1).long().cumprod(dim=-1).sum(dim=-1)  # [S, W]: matched tokens ending at e - 1
    ends = torch.arange(1, run.shape[1] + 1, device=dev)  # e = w + 1: where the continuation starts
    valid = (ends[None, :] <= (lens - 1)[:, None]) & (run >= nmin)  # ends before the suffix's last token
    best = torch.where(valid, run, 0).max(dim=1).values  # the longest n that recurs (0: none)
    cand = valid & (run >= best[:, None])
    latest = torch.where(cand, ends[None, :], -1).max(dim=1).values
    full = cand & (ends[None, :] + k <= lens[:, None])
    latest_full = torch.where(full, ends[None, :], -1).max(dim=1).values
    chosen = torch.where(latest_full >= 0, latest_full, latest)
    has = chosen >= 0
    cols = (chosen[:, None] + torch.arange(k, device=dev)[None, :]).clamp(0, width - 1)
    last = (lens - 1).clamp(min=0)
    drafts = torch.where(has[:, None], hist.gather(1, cols), hist.gather(1, last[:, None]).expand(rows, k))
    num_real = torch.where(has, (lens - chosen).clamp(0, k), torch.zeros_like(lens))
    return drafts, num_real


@dataclass
class DecodeRows:
    """Static-shape decode rows for one speculating step (row i*(k+1)+j: sequence i's j-th query token)."""

    input_ids: torch.Tensor  # [R] int64
    positions: torch.Tensor  # [R] int64
    slot_mapping: torch.Tensor  # [R] int64, -1: no KV write
    seq_lens: torch.Tensor  # [R] int32: context length of the row (itself included)
    block_tables: torch.Tensor  # [R, max_blocks] int32


def build_rows(last_tokens: torch.Tensor, drafts: torch.Tensor, lens: torch.Tensor, tables: torch.Tensor,
               capacity: torch.Tensor, block_size: int, max_model_len: int) -> DecodeRows:
    """Rows for the last token (at position len - 1) and the k drafts after it, per sequence; `tables` [S, B]
    block tables, `capacity` [S] the token slots they hold."""
    rows, k = drafts.shape
    q = k + 1
    dev = drafts.device
    tokens = torch.cat([last_tokens[:, None], drafts], dim=1).reshape(-1)
    # Rows past what the tables can address (only rows whose output is discarded) stay inside them.
    limit = min(max_model_len, tables.shape[1] * block_size)
    raw = (lens - 1)[:, None] + torch.arange(q, device=dev)[None, :]
    writable = (raw < capacity[:, None]) & (raw < limit)  # a clamped row must not overwrite a real token's KV
    pos = raw.clamp(max=limit - 1)
    entry = (pos // block_size).clamp(max=tables.shape[1] - 1)
    block = tables.long().gather(1, entry)
    slots = torch.where(writable, block * block_size + pos % block_size, torch.full_like(pos, -1))
    return DecodeRows(tokens, pos.reshape(-1), slots.reshape(-1), (pos + 1).to(torch.int32).reshape(-1),
                      tables.repeat_interleave(q, dim=0))


def accept_greedy(logits: torch.Tensor, drafts: torch.Tensor, remaining: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the rows' logits [S*(k+1), V]: (emitted tokens [S, k+1] (the first `count` valid), their logprobs,
    count [S], accepted drafts [S]). `remaining` [S]: tokens each sequence may still emit."""
    rows, k = drafts.shape
    lg = logits.float()
    best, pred = lg.max(dim=-1)
    logprob = (best - lg.logsumexp(dim=-1)).view(rows, k + 1)
    pred = pred.view(rows, k + 1)
    accepted = (drafts == pred[:, :k]).long().cumprod(dim=1).sum(dim=1)
    count = torch.minimum(accepted + 1, remaining.clamp(min=0))
    return pred, logprob, count, accepted


def append_history(hist: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor,
                   count: torch.Tensor) -> None:
    """hist[slot, len .. len + count) = tokens[:, :count]; lens += count (in place, on the device). Entries past
    `count` are written too (beyond the new length, where nothing reads them as history)."""
    width = hist.shape[1]
    cols = (lens[slots][:, None] + torch.arange(tokens.shape[1], device=hist.device)[None, :]).clamp(max=width - 1)
    hist[slots[:, None], cols] = tokens
    lens[slots] += count
