"""Batched token sampling on the logits' device (vLLM semantics).

Pipeline per call (stages are skipped entirely when no row needs them):

0. ``allowed_token_ids`` (every other token to ``-inf``) and ``logit_bias`` (added), as vLLM applies them
   before penalties,
1. penalties (repetition / frequency / presence),
2. ``min_tokens``: EOS and ``stop_token_ids`` masked to ``-inf``; ``bad_words``: a word's last token where
   the output ends with the rest of it,
3. temperature,
4. top-k, top-p, min-p,
5. sampling: greedy rows take ``argmax``; a random row draws one uniform per sample from
   its own generator on the host (the engine's: a ``random.Random``) and takes the token
   where it falls in its cumulative distribution (``inverse_cdf.py``), so a seeded row's
   samples depend only on the seed and its history, never on the rest of the batch.
   Rows without penalties, filters or top logprobs take one kernel for the whole batch
   (``CpuKernels.sample_rows`` on a CPU, ``triton_sample`` on a GPU); rows whose generator
   lives on a GPU, and unseeded rows there when filters are on, use the Gumbel-max race
   ``argmax(probs / q)``, ``q ~ Exponential(1)`` from the device's generators.

Log-probs are computed from the *raw* logits (before any processing).
All device -> host traffic is one non-blocking copy into pinned memory, read by
``SamplerOutput.result()``: ``Sampler.launch`` never waits for the device.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from pagedllm.device_utils import async_tensor_h2d
from pagedllm.model.layers.inverse_cdf import SampleGenerator, draw_uniforms, inverse_cdf_sample
from pagedllm.sampling_params import SAMPLING_EPS, SamplingParams

_NEG_INF = float("-inf")


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
    top-``params.logprobs`` tokens to their raw log-probs (sampled token first).
    """

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None


def _flat_index(seqs: list[list[int]], vocab: int) -> np.ndarray:
    """Row-major linear indices ``row * vocab + token`` of every token in ``seqs``.

    Built with numpy (no per-token Python work); ids outside ``[0, vocab)`` are dropped.
    """
    lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    toks = np.fromiter(chain.from_iterable(seqs), dtype=np.int64, count=int(lens.sum()))
    rows = np.repeat(np.arange(len(seqs), dtype=np.int64), lens)
    ok = (toks >= 0) & (toks < vocab)
    return rows[ok] * vocab + toks[ok]


def _col(values: list[float], device: torch.device) -> torch.Tensor:
    """Per-row float32 column ``[B, 1]``."""
    return async_tensor_h2d(values, torch.float32, device).unsqueeze(1)


def apply_logit_adjustments(x: torch.Tensor, allow_only: list[int], allow_rows: list[int], allow_toks: list[int],
                            bias_rows: list[int], bias_toks: list[int], bias_vals: list[float]) -> torch.Tensor:
    """A copy of `x` whose rows `allow_only` keep only their (allow_rows, allow_toks) entries (the rest -inf), then
    with `bias_vals` added at (bias_rows, bias_toks): ``allowed_token_ids`` and ``logit_bias``."""
    device = x.device
    if allow_only:
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep[async_tensor_h2d(allow_rows, torch.long, device), async_tensor_h2d(allow_toks, torch.long, device)] = True
        restricted = torch.zeros(x.shape[0], 1, dtype=torch.bool, device=device)
        restricted[async_tensor_h2d(allow_only, torch.long, device)] = True
        x = torch.where(restricted & ~keep, _NEG_INF, x)
    else:
        x = x.clone()
    if bias_rows:
        x.index_put_((async_tensor_h2d(bias_rows, torch.long, device), async_tensor_h2d(bias_toks, torch.long, device)),
                     async_tensor_h2d(bias_vals, torch.float32, device), accumulate=True)
    return x


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    presence: list[float],
    frequency: list[float],
    repetition: list[float],
) -> torch.Tensor:
    """vLLM penalties on ``logits`` ``[B, V]`` (returns a new tensor).

    repetition: tokens in prompt or output -> ``logit / r`` if ``logit > 0`` else
    ``logit * r``; frequency: ``- f * count_in_output``; presence:
    ``- p * (count_in_output > 0)``.  Token ids outside ``[0, V)`` are ignored.
    Output counts come from one ``scatter_add_`` over the flattened ``[B * V]``
    count tensor.
    """
    num_rows, vocab = logits.shape
    device = logits.device
    out_lin = torch.from_numpy(_flat_index(output_ids, vocab)).to(device, non_blocking=True)
    counts = torch.zeros(num_rows * vocab, dtype=torch.float32, device=device)
    counts.scatter_add_(0, out_lin, torch.ones(out_lin.shape, dtype=torch.float32, device=device))
    counts = counts.view(num_rows, vocab)
    seen_out = counts > 0

    if any(r != 1.0 for r in repetition):
        prompt_lin = torch.from_numpy(_flat_index(prompt_ids, vocab)).to(device, non_blocking=True)
        seen = torch.zeros(num_rows * vocab, dtype=torch.bool, device=device)
        seen[prompt_lin] = True
        seen = seen.view(num_rows, vocab) | seen_out
        rep = _col(repetition, device)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    if any(f != 0.0 for f in frequency):
        logits = logits - _col(frequency, device) * counts
    if any(p != 0.0 for p in presence):
        logits = logits - _col(presence, device) * seen_out.to(logits.dtype)
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: list[int] | None, top_p: list[float] | None
) -> torch.Tensor:
    """Mask (``-inf``) tokens outside top-k and/or the top-p nucleus.

    ``top_k[i] <= 0`` or ``>= V`` disables top-k for row i; ties at the k-th value
    are kept. top-p keeps the smallest set of tokens whose cumulative probability
    is >= ``top_p[i]`` (always at least one token). Returns a new tensor.
    """
    vocab = logits.shape[1]
    device = logits.device
    if top_k is not None and top_p is None:
        # top-k alone: a partial top-k is much cheaper than a full sort.
        ks = [x if 0 < x < vocab else 0 for x in top_k]
        max_k = max(ks)
        if max_k == 0:
            return logits
        k_t = async_tensor_h2d(ks, torch.long, device).unsqueeze(1)
        top_v = logits.topk(max_k, dim=-1).values
        kth = top_v.gather(1, (k_t - 1).clamp_(min=0))
        kth = kth.masked_fill(k_t == 0, _NEG_INF)
        return logits.masked_fill(logits < kth, _NEG_INF)
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = async_tensor_h2d([vocab if (x <= 0 or x > vocab) else x for x in top_k], torch.long, device)
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    if top_p is not None:
        probs_sorted = sorted_logits.softmax(dim=-1)
        cum = probs_sorted.cumsum(dim=-1)
        drop = cum <= 1.0 - _col(top_p, device)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits.masked_fill_(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Mask tokens whose prob is below ``min_p * max_prob`` (returns a new tensor)."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * _col(min_p, logits.device)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Structured outputs: in place, for each ``r`` in ``rows`` set ``logits[r, t]`` to -inf wherever bit
    ``t`` of the packed int32 row ``bitmask[r]`` is 0 (xgrammar/llguidance layout: bit ``t % 32`` of word
    ``t // 32``). ``bitmask`` (on the host) has a row per logits row (at least); rows not listed are neither
    read nor touched, so unconstrained rows cost nothing.

    On a GPU: one Triton kernel masks the rows (no host sync). A pinned host bitmask (the manager's) is read
    by the kernel in place (pinned memory is mapped into the device's address space under unified addressing),
    which saves the step thread a copy launch; any other is copied first. The row list is copied without
    blocking. On CPU: the native kernel (kernels/cpu/cpu_ops.c; ~14x
    faster than xgrammar's CPU kernel here), else xgrammar's. Masked tokens get probability 0 downstream.
    """
    if not rows:
        return
    batch = logits.shape[0]
    if bitmask.shape[0] < batch:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {batch} logits rows")
    with torch.inference_mode():  # the model's logits are inference tensors
        mask = bitmask[:batch]
        if logits.device.type == "cuda":
            from pagedllm.kernels.triton_bitmask import apply_token_bitmask_triton

            every = len(rows) == batch  # rows are distinct: no row list to copy
            row_ids = None if every else async_tensor_h2d(rows, torch.long, logits.device)
            if mask.is_pinned():
                try:
                    apply_token_bitmask_triton(logits, mask, row_ids)
                    return
                except ValueError:  # pinned but not mapped (registered memory): copy it
                    pass
            apply_token_bitmask_triton(logits, mask.to(logits.device, non_blocking=True), row_ids)
            return
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            from pagedllm.kernels.cpu_kernels import load_cpu_kernels

            native = load_cpu_kernels()
            if native is not None:
                native.apply_token_bitmask(logits, mask, rows)
                return
        import xgrammar

        if logits.device.type != "cpu":
            mask = mask.to(logits.device, non_blocking=True)
        indices = None if len(rows) == batch else rows
        xgrammar.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[1], indices=indices)


class SamplerOutput:
    """A launched sampling call: its device work is queued; `result()` waits for it and reads it back.

    `sampled_token_ids` (one per sample, on the logits' device) can feed the next step's input
    before the host has seen them (asynchronous scheduling).
    """

    def __init__(self, rows: list[SamplingRow], num_samples: list[int], k_top: int, vocab: int,
                 sampled_token_ids: torch.Tensor | None, packed: torch.Tensor | None,
                 full: torch.Tensor | None) -> None:
        self.rows = rows
        self.num_samples = num_samples
        self.k_top = k_top
        self.vocab = vocab
        self.sampled_token_ids = sampled_token_ids
        self.full = full
        self._event = None
        self._host = packed
        if packed is not None and packed.device.type == "cuda":
            # Copy into pinned memory without waiting; result() waits on this event only.
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> tuple[list[RowSample], torch.Tensor | None]:
        """Per-row results and the raw log_softmax (when it was asked for); blocks until the device is done."""
        if self._event is not None:
            self._event.synchronize()
        if not self.rows:
            return [], self.full
        host = self._host.tolist()
        total, num_rows, k_top = sum(self.num_samples), len(self.rows), self.k_top
        tok_list = host[:total]
        lp_list = host[total : 2 * total]
        top_i_list = host[2 * total : 2 * total + num_rows * max(k_top, 0)]
        top_v_list = host[2 * total + num_rows * max(k_top, 0) :]
        results: list[RowSample] = []
        pos = 0
        for i, row in enumerate(self.rows):
            s = self.num_samples[i]
            ids = [int(t) for t in tok_list[pos : pos + s]]
            lps = lp_list[pos : pos + s]
            tops: list[dict[int, float]] | None = None
            k = row.params.logprobs
            if k is not None:
                k = min(k, self.vocab)
                base = i * k_top
                top_pairs = [
                    (int(top_i_list[base + j]), top_v_list[base + j]) for j in range(k)
                ]
                tops = []
                for tok, lp in zip(ids, lps):
                    d = {tok: lp}
                    for t, v in top_pairs:
                        d.setdefault(t, v)
                    tops.append(d)
            results.append(RowSample(token_ids=ids, logprobs=lps, top_logprobs=tops))
            pos += s
        return results, self.full


def _race(probs: torch.Tensor, seeded: list[tuple[int, int, torch.Generator]]) -> torch.Tensor:
    """Gumbel-max race: ``argmax(probs / q)``, ``q ~ Exponential(1)``; rows ``start .. start + count`` of each
    span draw ``q`` from its generator (on the probs' device), the others from the device's default one.
    ``probs`` is overwritten."""
    q = torch.empty_like(probs)
    if not seeded:
        q.exponential_()  # one launch for the batch
    else:
        covered = [False] * probs.shape[0]
        for start, count, gen in seeded:
            if not isinstance(gen, torch.Generator) or gen.device.type != probs.device.type:
                raise ValueError(f"race sampling draws on {probs.device}; a generator there is needed, got {gen!r}")
            q[start:start + count].exponential_(generator=gen)
            covered[start:start + count] = [True] * count
        rest = [r for r, c in enumerate(covered) if not c]
        if rest:
            q[async_tensor_h2d(rest, torch.long, probs.device)] = torch.empty(
                (len(rest), probs.shape[1]), dtype=q.dtype, device=probs.device).exponential_()
    q.clamp_(min=torch.finfo(q.dtype).tiny)  # q == 0 would make 0/0 = NaN win the argmax
    return probs.div_(q).argmax(dim=-1)


def _draws_on_host(gen: SampleGenerator | None) -> bool:
    """An unseeded row (torch's default CPU generator then) or a host generator."""
    return gen is None or isinstance(gen, random.Random) or gen.device.type == "cpu"


def _native_cpu_kernels():
    from pagedllm.kernels.cpu_kernels import load_cpu_kernels

    return load_cpu_kernels()


class Sampler:
    """Samples one or more next tokens per row of a logits batch.

    ``random_sampling``: how random rows draw. "auto": inverse-CDF sampling (one uniform per sample,
    ``inverse_cdf.py``) for every row whose generator draws on the host (the engine's) and every row on a
    CPU, where the race's exponential per vocabulary entry costs ~1 ms per row; on a GPU, a row of a
    generator there and an unseeded row that needs torch ops (filters, penalties) take the Gumbel-max race,
    whose exponentials are cheap there. Rows without filters take one kernel for the batch either way.
    "race" / "inverse_cdf" force one (the random-sampling benchmark's peer and ablation); "race" also keeps
    GPU rows off the one-launch kernel.
    ``native_cpu``: float32 CPU rows without penalties, filters or top logprobs go to the C kernel
    (``CpuKernels.sample_rows``); False keeps them on torch ops (the benchmark's peer).
    ``batch_invariant`` (pagedllm/batch_invariance.py): every batch takes the torch ops, row by row. The one-kernel
    paths are chosen per batch (a batch with a filtered row, a row drawing best_of samples or, for the greedy
    kernel, one random row leaves them), and they sum a row's probabilities in another order than the torch ops,
    so a seeded row's token, or a greedy row's logprob, would depend on what shares its step.
    """

    def __init__(self, random_sampling: str = "auto", native_cpu: bool = True, batch_invariant: bool = False) -> None:
        if random_sampling not in ("auto", "race", "inverse_cdf"):
            raise ValueError(f"random_sampling must be 'auto', 'race' or 'inverse_cdf', got {random_sampling!r}")
        self.random_sampling = random_sampling
        self.native_cpu = native_cpu
        self.batch_invariant = batch_invariant

    @staticmethod
    def _plain_row_params(rows: list[SamplingRow], greedy: list[bool], temps: list[float],
                          mask_rows: list[int] | None = None) -> torch.Tensor:
        """The one-kernel paths' per-row inputs, on the host: float64 ``[rows, 2]`` of (u, 1 / temperature),
        u < 0 for a greedy row, else one uniform from the row's generator; the rows in `mask_rows` (the Triton
        kernel masks them with the step's token bitmask) carry -1 / temperature."""
        spans = [(i, 1, row.generator) for i, row in enumerate(rows) if not greedy[i] and row.generator is not None]
        u = draw_uniforms(spans, len(rows), torch.device("cpu"))
        u[torch.tensor(greedy, dtype=torch.bool)] = -1.0
        inv_temps = [1.0 / t for t in temps]
        for i in mask_rows or ():
            inv_temps[i] = -inv_temps[i]
        return torch.stack([u, torch.tensor(inv_temps, dtype=torch.float64)], dim=1)

    def _launch_one_kernel(self, logits: torch.Tensor, rows: list[SamplingRow], num_samples: list[int],
                           greedy: list[bool], temps: list[float], vocab: int,
                           folded_mask: tuple[torch.Tensor, list[int]] | None = None) -> SamplerOutput | None:
        """Rows without penalties, filters or top logprobs, one sample each: one kernel takes each row's argmax
        or its inverse-CDF draw at its temperature, and the raw logprob (~1 ms for 64 rows of 49 152 against
        5-7 ms of torch ops on a CPU; one launch against one per seeded row on a GPU). The C kernel on a CPU
        (None when it is unavailable), Triton on CUDA, whose row inputs go over in one copy and which applies
        `folded_mask` (a pinned token bitmask and its rows) as it reads the logits."""
        native = _native_cpu_kernels() if logits.device.type == "cpu" else None
        if logits.device.type == "cpu" and native is None:
            return None  # before any draw: the torch path draws the rows' numbers itself
        params = self._plain_row_params(rows, greedy, temps, None if folded_mask is None else folded_mask[1])
        if native is not None:
            tokens, logprobs = native.sample_rows(logits, params[:, 1].float().contiguous(), params[:, 0].contiguous())
        else:
            from pagedllm.kernels.triton_sample import sample_with_logprob

            tokens, logprobs = sample_with_logprob(logits, params.pin_memory().to(logits.device, non_blocking=True),
                                                   None if folded_mask is None else folded_mask[0])
        packed = torch.cat([tokens.to(torch.float64), logprobs.to(torch.float64)])
        return SamplerOutput(rows, num_samples, 0, vocab, tokens, packed, None)

    def _by_race(self, gen: SampleGenerator | None, device: torch.device) -> bool:
        if self.random_sampling != "auto":
            return self.random_sampling == "race"
        if device.type == "cpu":
            return False
        return gen is None or (isinstance(gen, torch.Generator) and gen.device.type == device.type)

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        return_logprobs_tensor: bool = False,
        token_bitmask: tuple[torch.Tensor, list[int]] | None = None,
    ) -> tuple[list[RowSample], torch.Tensor | None]:
        """Sample from ``logits`` ``[len(rows), vocab]``.

        Returns per-row results and, if ``return_logprobs_tensor``, the raw
        ``log_softmax`` of ``logits`` (``[len(rows), vocab]`` float32).
        """
        return self.launch(logits, rows, return_logprobs_tensor, token_bitmask).result()

    def launch(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        return_logprobs_tensor: bool = False,
        token_bitmask: tuple[torch.Tensor, list[int]] | None = None,
    ) -> SamplerOutput:
        """Queue the sampling of ``logits`` ``[len(rows), vocab]`` on its device without waiting for it
        (nothing here synchronises with the device); `SamplerOutput.result()` reads it back.

        `token_bitmask` (structured outputs): the step's packed bitmask and the rows it constrains, applied as
        `apply_token_bitmask_` does. On a GPU, rows that one kernel samples read a pinned mask in place inside
        that kernel (no masking launch); otherwise the logits are masked first (in place)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must have shape [len(rows)={len(rows)}, vocab], got "
                f"{tuple(logits.shape)}."
            )
        if token_bitmask is not None and not token_bitmask[1]:
            token_bitmask = None
        if not rows:
            empty = logits.float().log_softmax(-1) if return_logprobs_tensor else None
            return SamplerOutput([], [], 0, logits.shape[-1], None, None, empty)
        device = logits.device
        num_rows, vocab = logits.shape

        # ---- gather per-row parameters once ------------------------------- #
        temps: list[float] = []
        top_ks: list[int] = []
        top_ps: list[float] = []
        min_ps: list[float] = []
        presence: list[float] = []
        frequency: list[float] = []
        repetition: list[float] = []
        greedy: list[bool] = []
        pen_prompts: list[list[int]] = []  # only rows with repetition_penalty != 1
        pen_outputs: list[list[int]] = []  # only rows with any penalty
        need_pen = need_temp = need_topk = need_topp = need_minp = False
        max_logprobs = -1
        num_samples: list[int] = []
        ban_rows: list[int] = []
        ban_toks: list[int] = []
        bias_rows: list[int] = []  # logit_bias entries, flat
        bias_toks: list[int] = []
        bias_vals: list[float] = []
        allow_rows: list[int] = []  # allowed_token_ids entries, flat
        allow_toks: list[int] = []
        allow_only: list[int] = []  # rows restricted to their allowed tokens
        for i, row in enumerate(rows):
            p = row.params
            if p.logit_bias:
                bias_rows.extend([i] * len(p.logit_bias))
                bias_toks.extend(p.logit_bias)
                bias_vals.extend(p.logit_bias.values())
            if p.allowed_token_ids is not None:
                allow_only.append(i)
                allow_rows.extend([i] * len(p.allowed_token_ids))
                allow_toks.extend(p.allowed_token_ids)
            if row.num_samples < 1:
                raise ValueError(f"num_samples must be at least 1, got {row.num_samples}.")
            num_samples.append(row.num_samples)
            is_greedy = p.use_beam_search or p.temperature < SAMPLING_EPS or p.top_k == 1
            greedy.append(is_greedy)
            presence.append(p.presence_penalty)
            frequency.append(p.frequency_penalty)
            repetition.append(p.repetition_penalty)
            has_rep = p.repetition_penalty != 1.0
            has_pen = has_rep or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            need_pen |= has_pen
            pen_prompts.append(row.prompt_token_ids if has_rep else [])
            pen_outputs.append(row.output_token_ids if has_pen else [])
            if len(row.output_token_ids) < p.min_tokens:
                for t in (*row.eos_token_ids, *(p.stop_token_ids or ())):
                    if 0 <= t < vocab:
                        ban_rows.append(i)
                        ban_toks.append(t)
            for word in row.bad_words_token_ids:
                if len(word) == 1 or tuple(row.output_token_ids[-(len(word) - 1):]) == word[:-1]:
                    ban_rows.append(i)
                    ban_toks.append(word[-1])
            if is_greedy:
                temps.append(1.0)
                top_ks.append(0)
                top_ps.append(1.0)
                min_ps.append(0.0)
            else:
                temps.append(p.temperature)
                top_ks.append(p.top_k)
                top_ps.append(p.top_p)
                min_ps.append(p.min_p)
                need_temp |= p.temperature != 1.0
                need_topk |= 0 < p.top_k < vocab
                need_topp |= p.top_p < 1.0
                need_minp |= p.min_p > 0.0
            if p.logprobs is not None:
                max_logprobs = max(max_logprobs, p.logprobs)

        adjust = bool(bias_rows or allow_only)
        if (device.type == "cuda" and not self.batch_invariant and all(greedy) and not need_pen and not ban_rows
                and not adjust and max_logprobs < 0
                and not return_logprobs_tensor and sum(num_samples) == num_rows and token_bitmask is None):
            # The common decode step: one pass over the logits instead of a float32 copy + argmax + logsumexp.
            from pagedllm.kernels.triton_greedy import greedy_sample_with_logprob

            tokens, tok_lp = greedy_sample_with_logprob(logits)
            packed = torch.cat([tokens.to(torch.float64), tok_lp.to(torch.float64)])
            return SamplerOutput(rows, num_samples, 0, vocab, tokens, packed, None)

        # Rows that one kernel can take: argmax or a draw at a temperature, the raw logprob, one sample each.
        plain = (not self.batch_invariant and not need_pen and not ban_rows and not adjust
                 and not (need_topk or need_topp or need_minp)
                 and max_logprobs < 0 and not return_logprobs_tensor and sum(num_samples) == num_rows)
        host_draws_on_gpu = (plain and device.type == "cuda" and self.random_sampling != "race"
                             and all(greedy[i] or _draws_on_host(row.generator) for i, row in enumerate(rows)))
        one_kernel = plain and (
            (host_draws_on_gpu and (not all(greedy) or token_bitmask is not None))
            or (device.type == "cpu" and self.native_cpu and logits.dtype == torch.float32 and logits.stride(1) == 1
                and (all(greedy) or self.random_sampling != "race")))
        folded_mask = None
        if token_bitmask is not None:
            mask = token_bitmask[0]
            if one_kernel and device.type == "cuda" and (mask.is_pinned() or mask.device == device):
                if mask.shape[0] < num_rows:  # before any draw from the rows' generators
                    raise ValueError(f"bitmask has {mask.shape[0]} rows for {num_rows} logits rows")
                folded_mask = token_bitmask
            else:
                apply_token_bitmask_(logits, *token_bitmask)
        if one_kernel:
            out = self._launch_one_kernel(logits, rows, num_samples, greedy, temps, vocab, folded_mask)
            if out is not None:
                return out

        # ---- logits processing --------------------------------------------- #
        raw = logits.float()  # never modified in place
        x = raw
        if adjust:
            x = apply_logit_adjustments(raw, allow_only, allow_rows, allow_toks, bias_rows, bias_toks, bias_vals)
        if need_pen:
            x = apply_penalties(x, pen_prompts, pen_outputs, presence, frequency, repetition)
        if ban_rows:
            if x is raw:
                x = raw.clone()
            idx_r = async_tensor_h2d(ban_rows, torch.long, device)
            idx_t = async_tensor_h2d(ban_toks, torch.long, device)
            x[idx_r, idx_t] = _NEG_INF
        if need_temp:
            x = x / _col(temps, device)
        if need_topk or need_topp:
            x = apply_top_k_top_p(
                x, top_ks if need_topk else None, top_ps if need_topp else None
            )
        if need_minp:
            x = apply_min_p(x, min_ps)

        # ---- sampling ------------------------------------------------------ #
        total = sum(num_samples)
        expanded = total != num_rows
        flat_rows: list[int] = []  # flat sample position -> row
        for i, s in enumerate(num_samples):
            flat_rows.extend([i] * s)
        flat_rows_t = (
            async_tensor_h2d(flat_rows, torch.long, device) if expanded else None
        )

        n_greedy = sum(greedy)
        tokens: torch.Tensor | None = None
        raw_logsumexp: torch.Tensor | None = None
        if n_greedy:
            g = x.argmax(dim=-1)
            tokens = g.index_select(0, flat_rows_t) if flat_rows_t is not None else g
        if n_greedy < num_rows:
            # Random rows, expanded to one position per sample; each takes the race or inverse-CDF sampling.
            rand_pos: list[int] = []  # flat positions of random samples
            rand_rows: list[int] = []
            race_pos: list[int] = []  # positions in the random sub-batch
            inverse_pos: list[int] = []
            race_spans: list[tuple[int, int, SampleGenerator]] = []  # (start in race_pos, count, generator)
            inverse_spans: list[tuple[int, int, SampleGenerator]] = []
            pos = 0
            for i, row in enumerate(rows):
                s = num_samples[i]
                if not greedy[i]:
                    gen = row.generator
                    by_race = self._by_race(gen, device)
                    chosen, spans = (race_pos, race_spans) if by_race else (inverse_pos, inverse_spans)
                    if gen is not None:
                        spans.append((len(chosen), s, gen))
                    chosen.extend(range(len(rand_rows), len(rand_rows) + s))
                    rand_pos.extend(range(pos, pos + s))
                    rand_rows.extend([i] * s)
                pos += s
            n_rand = len(rand_rows)
            if n_rand == total:  # every row is random
                xr = x.index_select(0, flat_rows_t) if flat_rows_t is not None else x
            else:
                xr = x.index_select(0, async_tensor_h2d(rand_rows, torch.long, device))
            if not race_pos:
                # Unnormalised weights are enough for inverse-CDF sampling; when they are the raw logits'
                # (no processing, every row random and drawn once), their sum also gives the logprobs'
                # logsumexp, and the row takes one exp pass instead of a softmax and a logsumexp.
                top = xr.amax(dim=-1, keepdim=True)
                weights = torch.exp(xr - top)
                sampled = inverse_cdf_sample(weights, draw_uniforms(inverse_spans, n_rand, device))
                if xr is raw:
                    raw_logsumexp = top.squeeze(1) + weights.sum(dim=-1).log()
            elif not inverse_pos:
                sampled = _race(xr.softmax(dim=-1), race_spans)
            else:  # some rows of each kind (a GPU batch mixing device and host generators)
                sampled = torch.empty(n_rand, dtype=torch.long, device=device)
                race_idx = async_tensor_h2d(race_pos, torch.long, device)
                sampled[race_idx] = _race(xr.index_select(0, race_idx).softmax(dim=-1), race_spans)
                inverse_idx = async_tensor_h2d(inverse_pos, torch.long, device)
                # The weights of the branch above, so a seeded row samples the same whatever shares its step.
                xi = xr.index_select(0, inverse_idx)
                sampled[inverse_idx] = inverse_cdf_sample(torch.exp(xi - xi.amax(dim=-1, keepdim=True)),
                                                          draw_uniforms(inverse_spans, len(inverse_pos), device))
            if tokens is None:
                tokens = sampled
            else:
                tokens = tokens.clone()
                tokens[async_tensor_h2d(rand_pos, torch.long, device)] = sampled
        if tokens is None:  # unreachable: every row is greedy or random
            raise RuntimeError("sampler produced no tokens")

        # ---- log-probs (raw distribution) ---------------------------------- #
        need_full = return_logprobs_tensor or max_logprobs >= 0
        full: torch.Tensor | None = raw.log_softmax(dim=-1) if need_full else None
        row_of = (
            flat_rows_t
            if flat_rows_t is not None
            else torch.arange(num_rows, dtype=torch.long, device=device)
        )
        if full is not None:
            tok_lp = full[row_of, tokens]
        else:  # cheap path: gathered raw logit minus the row's logsumexp
            if raw_logsumexp is None:
                raw_logsumexp = raw.logsumexp(dim=-1)
            tok_lp = raw[row_of, tokens] - raw_logsumexp[row_of]

        parts = [tokens.to(torch.float64), tok_lp.to(torch.float64)]
        k_top = min(max_logprobs, vocab)
        if full is not None and k_top > 0:
            top_v, top_i = full.topk(k_top, dim=-1)
            parts += [top_i.to(torch.float64).flatten(), top_v.to(torch.float64).flatten()]
        # The single device -> host transfer, read back by SamplerOutput.result().
        return SamplerOutput(rows, num_samples, k_top, vocab, tokens, torch.cat(parts),
                             full if return_logprobs_tensor else None)


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, k: int
) -> list[dict[int, float]]:
    """Prompt log-probs: ``logits[i]`` predicts ``next_token_ids[i]``.

    Returns, per position, ``{token: logprob}`` for the actual next token (first)
    plus the top-``k`` tokens of the raw distribution.
    """
    if k < 0:
        raise ValueError(f"k must be non-negative, got {k}.")
    if logits.dim() != 2 or next_token_ids.shape != (logits.shape[0],):
        raise ValueError(
            f"logits must be [N, vocab] and next_token_ids [N], got "
            f"{tuple(logits.shape)} and {tuple(next_token_ids.shape)}."
        )
    n, vocab = logits.shape
    if n == 0:
        return []
    lp = logits.float().log_softmax(dim=-1)
    ids = next_token_ids.to(device=logits.device, dtype=torch.long)
    actual = lp.gather(1, ids.unsqueeze(1)).squeeze(1)
    parts = [ids.to(torch.float64), actual.to(torch.float64)]
    k = min(k, vocab)
    if k > 0:
        top_v, top_i = lp.topk(k, dim=-1)
        parts += [top_i.to(torch.float64).flatten(), top_v.to(torch.float64).flatten()]
    host = torch.cat(parts).tolist()
    out: list[dict[int, float]] = []
    for i in range(n):
        d = {int(host[i]): host[n + i]}
        base = 2 * n + n * k + i * k
        for j in range(k):
            d.setdefault(int(host[2 * n + i * k + j]), host[base + j])
        out.append(d)
    return out


__all__ = [
    "RowSample",
    "Sampler",
    "SamplerOutput",
    "SamplingRow",
    "apply_min_p",
    "apply_penalties",
    "apply_token_bitmask_",
    "apply_top_k_top_p",
    "compute_prompt_logprobs",
]


def warm_up_sampler(sampler: "Sampler", vocab_size: int, device: torch.device,
                    dtype: torch.dtype = torch.float32) -> None:
    """Sample once from dummy logits with a greedy row and a random row (temperature, top-k, top-p, min-p,
    penalties), once with greedy rows only (the one-pass kernel on CUDA) and once with a greedy and a plain
    random row (the one-kernel path), so the first request loads or
    compiles none of the sampler's kernels (CUDA loads a kernel module on its first use). `dtype`: the
    logits' as the model runner hands them over (``model_runner.sampler_logits``: the model's on CUDA)."""
    logits = torch.zeros((2, vocab_size), dtype=dtype, device=device)
    greedy = SamplingRow(SamplingParams(temperature=0.0, max_tokens=1), [1], [])
    rows = [greedy,  # a seeded row (inverse-CDF sampling); its own generator leaves the default one alone
            SamplingRow(SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, presence_penalty=0.1,
                                       repetition_penalty=1.1, max_tokens=1), [1], [2], generator=random.Random(0))]
    sampler.launch(logits, rows).result()
    sampler.launch(logits, [greedy, greedy]).result()
    plain = SamplingRow(SamplingParams(temperature=0.8, max_tokens=1), [1], [], generator=random.Random(0))
    sampler.launch(logits, [greedy, plain]).result()  # the one-kernel path (C on a CPU, Triton on a GPU)
    if device.type == "cuda":
        # The same kernel reading a structured-output bitmask (pinned, as the manager's); then unseeded rows'
        # race: the exponential kernel, drawn from a generator of its own.
        mask = torch.full((2, (vocab_size + 31) // 32), -1, dtype=torch.int32).pin_memory()
        sampler.launch(logits, [greedy, plain], token_bitmask=(mask, [1])).result()
        torch.empty_like(logits, dtype=torch.float32).exponential_(generator=torch.Generator(device).manual_seed(0))
