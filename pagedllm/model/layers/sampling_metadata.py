"""What the sampler needs of each row (`SamplingRow`), what it returns per row (`RowSample`), and the batch's
per-row parameters gathered once per call (`SamplingMetadata`, as vLLM names it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.logprobs import Logprob
from pagedllm.model.layers.inverse_cdf import SampleGenerator
from pagedllm.sampling_params import SAMPLING_EPS, SamplingParams


@dataclass
class SamplingRow:
    """One row of the logits batch plus what is needed to sample from it.

    ``generator`` (``None``: torch's default generator) gives the row's random
    numbers: a ``random.Random`` (the engine's, on every device) or a CPU torch
    generator draws one uniform per sample on the host; a torch generator on the
    logits' GPU draws the race's exponentials there. ``num_samples`` > 1 draws that
    many tokens independently (with replacement) from this row, e.g. when a
    parallel-sampling request forks at the end of its prompt.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: SampleGenerator | None = None
    num_samples: int = 1
    eos_token_ids: tuple[int, ...] = ()
    #: ``bad_words`` as token sequences (``bad_words_token_ids``): a sequence's last token is banned when the
    #: output ends with the rest of it.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()


@dataclass
class RowSample:
    """Sampling result of one row.

    ``logprobs[j]`` is the raw log-prob of ``token_ids[j]``; ``top_logprobs[j]``
    (only when ``params.logprobs`` is set) maps the sampled token and the
    top-``params.logprobs`` tokens to their `Logprob` (raw log-prob and rank; sampled token first).
    """

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, Logprob]] | None


@dataclass
class SamplingMetadata:
    """The batch's per-row sampling parameters in lists (one entry per row unless noted), and which processing
    stages any row needs. A greedy row carries neutral values (temperature 1, no filters)."""

    greedy: list[bool] = field(default_factory=list)
    num_samples: list[int] = field(default_factory=list)
    temps: list[float] = field(default_factory=list)
    top_ks: list[int] = field(default_factory=list)
    top_ps: list[float] = field(default_factory=list)
    min_ps: list[float] = field(default_factory=list)
    presence: list[float] = field(default_factory=list)
    frequency: list[float] = field(default_factory=list)
    repetition: list[float] = field(default_factory=list)
    pen_prompts: list[list[int]] = field(default_factory=list)  # empty unless the row has repetition_penalty != 1
    pen_outputs: list[list[int]] = field(default_factory=list)  # empty unless the row has any penalty
    ban_rows: list[int] = field(default_factory=list)  # (row, token) pairs set to -inf: min_tokens, bad_words
    ban_toks: list[int] = field(default_factory=list)
    bias_rows: list[int] = field(default_factory=list)  # logit_bias entries, flat
    bias_toks: list[int] = field(default_factory=list)
    bias_vals: list[float] = field(default_factory=list)
    allow_rows: list[int] = field(default_factory=list)  # allowed_token_ids entries, flat
    allow_toks: list[int] = field(default_factory=list)
    allow_only: list[int] = field(default_factory=list)  # rows restricted to their allowed tokens
    need_pen: bool = False
    need_temp: bool = False
    need_topk: bool = False
    need_topp: bool = False
    need_minp: bool = False
    max_logprobs: int = -1  # the largest `logprobs` asked for, -1 if none

    @property
    def adjust(self) -> bool:
        """Some row has logit_bias or allowed_token_ids."""
        return bool(self.bias_rows or self.allow_only)

    @property
    def filtered(self) -> bool:
        return self.need_topk or self.need_topp or self.need_minp

    @classmethod
    def from_rows(cls, rows: list[SamplingRow], vocab: int) -> "SamplingMetadata":
        md = cls()
        for i, row in enumerate(rows):
            p = row.params
            if p.logit_bias:
                md.bias_rows.extend([i] * len(p.logit_bias))
                md.bias_toks.extend(p.logit_bias)
                md.bias_vals.extend(p.logit_bias.values())
            if p.allowed_token_ids is not None:
                md.allow_only.append(i)
                md.allow_rows.extend([i] * len(p.allowed_token_ids))
                md.allow_toks.extend(p.allowed_token_ids)
            if row.num_samples < 1:
                raise ValueError(f"num_samples must be at least 1, got {row.num_samples}.")
            md.num_samples.append(row.num_samples)
            is_greedy = p.use_beam_search or p.temperature < SAMPLING_EPS or p.top_k == 1
            md.greedy.append(is_greedy)
            md.presence.append(p.presence_penalty)
            md.frequency.append(p.frequency_penalty)
            md.repetition.append(p.repetition_penalty)
            has_rep = p.repetition_penalty != 1.0
            has_pen = has_rep or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            md.need_pen |= has_pen
            md.pen_prompts.append(row.prompt_token_ids if has_rep else [])
            md.pen_outputs.append(row.output_token_ids if has_pen else [])
            if len(row.output_token_ids) < p.min_tokens:
                for t in (*row.eos_token_ids, *(p.stop_token_ids or ())):
                    if 0 <= t < vocab:
                        md.ban_rows.append(i)
                        md.ban_toks.append(t)
            for word in row.bad_words_token_ids:
                if len(word) == 1 or tuple(row.output_token_ids[-(len(word) - 1):]) == word[:-1]:
                    md.ban_rows.append(i)
                    md.ban_toks.append(word[-1])
            if is_greedy:
                md.temps.append(1.0)
                md.top_ks.append(0)
                md.top_ps.append(1.0)
                md.min_ps.append(0.0)
            else:
                md.temps.append(p.temperature)
                md.top_ks.append(p.top_k)
                md.top_ps.append(p.top_p)
                md.min_ps.append(p.min_p)
                md.need_temp |= p.temperature != 1.0
                md.need_topk |= 0 < p.top_k < vocab
                md.need_topp |= p.top_p < 1.0
                md.need_minp |= p.min_p > 0.0
            if p.logprobs is not None:
                md.max_logprobs = max(md.max_logprobs, p.logprobs)
        return md
