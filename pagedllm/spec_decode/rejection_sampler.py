"""Verification of proposed tokens against the target model (Leviathan et al. 2023, Chen et al. 2023).

For one sequence with drafts d_1..d_k the target gives k+1 rows of logits (row i predicts the token after
d_1..d_i). Each row is processed exactly as the ordinary sampler would process it at that point of the
sequence (penalties over the history *including* the accepted drafts before it, min_tokens, temperature,
top-k, top-p, min-p), giving the target distribution p_i.

- Greedy rows: d_i is accepted while it equals argmax p_i; the first mismatch is replaced by the argmax
  (the "bonus" token when all k are accepted). Outputs are token for token those of plain decoding.
- Random rows: d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); on rejection the token is
  drawn from normalize(max(p_i - q_i, 0)); when all k are accepted, the bonus token is drawn from p_k.
  The emitted tokens are then distributed exactly as sampling from p would give. `q` may be given as full
  distributions (tested against a random q).
- The proposers here are deterministic (q_i one-hot at d_i). Then each row is sampled as the ordinary sampler
  samples it (inverse CDF over exp(x - max x), one uniform), and d_i is accepted while the sample equals it.
  Accepting has probability p_i(d_i), and a rejected row's sample is p_i conditioned on not being d_i, which
  is the residual above. The generator gives one uniform per emitted token, in order, as plain decoding
  draws them, so a seeded sequence emits the tokens that plain decoding would emit from the same logits.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from pagedllm.model.layers.inverse_cdf import SampleGenerator, inverse_cdf_sample, uniforms
from pagedllm.model.layers.sampler import (
    SamplingRow,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
)
from pagedllm.sampling_params import SAMPLING_EPS


def is_greedy(params) -> bool:
    return params.use_beam_search or params.temperature < SAMPLING_EPS or params.top_k == 1


def processed_logits(raw: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The sampler's logits processing (penalties, min_tokens, temperature, top-k/p, min-p) of each row.

    Greedy rows get penalties and min_tokens only (their argmax is the greedy token), as in the Sampler."""
    vocab = raw.shape[-1]
    x = raw.float()
    pen = [r for r in rows if r.params.repetition_penalty != 1.0 or r.params.presence_penalty
           or r.params.frequency_penalty]
    if pen:
        x = apply_penalties(
            x,
            [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else [] for r in rows],
            [r.output_token_ids for r in rows],
            [r.params.presence_penalty for r in rows],
            [r.params.frequency_penalty for r in rows],
            [r.params.repetition_penalty for r in rows],
        )
    ban_r, ban_t = [], []
    for i, r in enumerate(rows):
        if len(r.output_token_ids) < r.params.min_tokens:
            for t in (*r.eos_token_ids, *(r.params.stop_token_ids or ())):
                if 0 <= t < vocab:
                    ban_r.append(i)
                    ban_t.append(t)
    if ban_r:
        x = x.clone() if x is raw else x
        x[torch.tensor(ban_r, device=x.device), torch.tensor(ban_t, device=x.device)] = float("-inf")
    greedy = [is_greedy(r.params) for r in rows]
    if all(greedy):
        return x
    temps = [1.0 if g else r.params.temperature for g, r in zip(greedy, rows)]
    x = x / torch.tensor(temps, device=x.device, dtype=x.dtype).unsqueeze(1)
    top_k = [0 if g else r.params.top_k for g, r in zip(greedy, rows)]
    top_p = [1.0 if g else r.params.top_p for g, r in zip(greedy, rows)]
    need_k = any(0 < k < vocab for k in top_k)
    need_p = any(p < 1.0 for p in top_p)
    if need_k or need_p:
        x = apply_top_k_top_p(x, top_k if need_k else None, top_p if need_p else None)
    min_p = [0.0 if g else r.params.min_p for g, r in zip(greedy, rows)]
    if any(m > 0 for m in min_p):
        x = apply_min_p(x, min_p)
    return x


@dataclass
class VerifyResult:
    """Tokens to append to one sequence: the accepted drafts, then one target token."""

    token_ids: list[int]
    num_accepted: int  # drafts accepted (len(token_ids) - 1)


def verify(
    target_logits: torch.Tensor,
    rows: list[SamplingRow],
    drafts: list[int],
    draft_probs: torch.Tensor | None = None,
    generator: SampleGenerator | None = None,
) -> VerifyResult:
    """Accept a prefix of `drafts` given the target's k+1 rows of raw logits (rows[i]: the sampling state
    after drafts[:i]). `draft_probs` [k, vocab]: the proposer's distributions (None: one-hot at the drafts)."""
    k = len(drafts)
    if target_logits.shape[0] != k + 1 or len(rows) != k + 1:
        raise ValueError(f"verify needs k+1={k + 1} rows of logits and rows, got "
                         f"{target_logits.shape[0]} and {len(rows)}")
    x = processed_logits(target_logits, rows)
    if is_greedy(rows[0].params):
        best = x.argmax(dim=-1).tolist()
        n = 0
        while n < k and drafts[n] == best[n]:
            n += 1
        return VerifyResult(drafts[:n] + [best[n]], n)
    if draft_probs is None:
        return _sample_and_match(x, drafts, generator)
    probs = x.softmax(dim=-1)
    dev = probs.device
    idx = torch.arange(k, device=dev)
    d = torch.tensor(drafts, device=dev, dtype=torch.long)
    p_d = probs[idx, d]
    q_d = draft_probs[idx, d].to(p_d.dtype)
    u = uniforms(k, generator).to(dev, p_d.dtype)
    accept = (u * q_d <= p_d).tolist()  # u < p/q without dividing by a zero q
    n = 0
    while n < k and accept[n]:
        n += 1
    if n == k:
        last = probs[k]
    else:
        last = (probs[n] - draft_probs[n].to(probs.dtype)).clamp_(min=0.0)
        total = last.sum()
        if float(total) <= 0.0:  # p == q: a rejection has probability 0; guard against rounding
            last = probs[n]
    tok = int(inverse_cdf_sample(last.unsqueeze(0), uniforms(1, generator).to(dev)).item())
    return VerifyResult(drafts[:n] + [tok], n)


def _sample_and_match(x: torch.Tensor, drafts: list[int], generator: SampleGenerator | None) -> VerifyResult:
    """One-hot drafts: sample all k+1 processed rows `x` as the sampler does, keep the samples up to the first
    one that differs from its draft, and leave `generator` as if it had drawn one uniform per kept sample."""
    k = len(drafts)
    saved = _generator_state(generator)
    u = _single_draws(k + 1, generator)
    weights = torch.exp(x - x.amax(dim=-1, keepdim=True))
    samples = inverse_cdf_sample(weights, u.to(weights.device)).tolist()
    n = 0
    while n < k and samples[n] == drafts[n]:
        n += 1
    if saved is not None and n < k:  # rewind, then draw exactly the n + 1 uniforms of the emitted tokens
        _set_generator_state(generator, saved)
        _single_draws(n + 1, generator)
    return VerifyResult(drafts[:n] + [samples[n]], n)


def _single_draws(n: int, generator: SampleGenerator | None) -> torch.Tensor:
    """n uniforms drawn one at a time, as the sampler draws them for n steps of one row."""
    if generator is None or isinstance(generator, random.Random):  # n draws are n single draws here
        return uniforms(n, generator)
    return torch.cat([uniforms(1, generator) for _ in range(n)])


def _generator_state(generator: SampleGenerator | None):
    if generator is None:  # torch's default generator: unseeded, how many numbers it gives does not matter
        return None
    return generator.getstate() if isinstance(generator, random.Random) else generator.get_state()


def _set_generator_state(generator: SampleGenerator, state) -> None:
    if isinstance(generator, random.Random):
        generator.setstate(state)
    else:
        generator.set_state(state)
