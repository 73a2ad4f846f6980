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
   (``CpuKernels.sample_rows`` on a CPU, ``triton_sample`` on a GPU); on a CPU, float32 rows with
   them (no top logprobs, one sample each) take that C kernel too, on the processed logits at
   temperature 1 (``Sampler._launch_processed_cpu``); rows whose generator
   lives on a GPU, and unseeded rows there when filters are on, use the Gumbel-max race
   ``argmax(probs / q)``, ``q ~ Exponential(1)`` from the device's generators.

Stages 0-4 are ``logits_ops.py``; the rows' parameters are gathered once per call into a
``SamplingMetadata`` (``sampling_metadata.py``, with ``SamplingRow`` and ``RowSample``).
Log-probs are computed from the *raw* logits (before any processing).
All device -> host traffic is one non-blocking copy into pinned memory, read by
``SamplerOutput.result()``: ``Sampler.launch`` never waits for the device.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from pagedllm.device_utils import async_tensor_h2d
from pagedllm.logprobs import Logprob, position_logprobs
from pagedllm.model.layers.inverse_cdf import SampleGenerator, draw_uniforms, inverse_cdf_sample
from pagedllm.model.layers.logits_ops import (NEG_INF, apply_logit_adjustments, apply_min_p, apply_penalties,
                                              apply_token_bitmask_, apply_top_k_top_p, col)
from pagedllm.model.layers.sampling_metadata import RowSample, SamplingMetadata, SamplingRow
from pagedllm.sampling_params import SamplingParams


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
        rank_list = host[2 * total : 3 * total] if k_top >= 0 else []
        top_at = 3 * total if k_top >= 0 else 2 * total
        top_i_list = host[top_at : top_at + num_rows * max(k_top, 0)]
        top_v_list = host[top_at + num_rows * max(k_top, 0) :]
        results: list[RowSample] = []
        pos = 0
        for i, row in enumerate(self.rows):
            s = self.num_samples[i]
            ids = [int(t) for t in tok_list[pos : pos + s]]
            lps = lp_list[pos : pos + s]
            tops: list[dict[int, Logprob]] | None = None
            k = row.params.logprobs
            if k is not None:
                base = i * k_top
                top_ids = [int(t) for t in top_i_list[base : base + min(k, self.vocab)]]
                top_vals = top_v_list[base : base + len(top_ids)]
                tops = [position_logprobs(tok, lp, int(rank), top_ids, top_vals)
                        for tok, lp, rank in zip(ids, lps, rank_list[pos : pos + s])]
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
    whose exponentials are cheap there. Rows without filters take one kernel for the batch either way (on a CPU,
    float32 rows with filters or penalties too, after their processing).
    "race" / "inverse_cdf" force one (the random-sampling benchmark's peer and ablation); "race" also keeps
    GPU rows off the one-launch kernel.
    ``native_cpu``: float32 CPU rows without penalties, filters or top logprobs go to the C kernel
    (``CpuKernels.sample_rows``); False keeps them on torch ops (the benchmark's peer).
    ``batch_invariant`` (pagedllm/batch_invariance.py): every batch takes the torch ops, row by row. The one-kernel
    paths are chosen per batch (a batch with a filtered row, a row drawing best_of samples or, for the greedy
    kernel, one random row leaves them), and they sum a row's probabilities in another order than the torch ops,
    so a seeded row's token, or a greedy row's logprob, would depend on what shares its step.
    ``logprobs_mode`` (vLLM's, config.LOGPROBS_MODES): what the log-probs report; any but raw_logprobs takes the
    torch ops (the one-kernel paths report raw log-probs only).
    """

    def __init__(self, random_sampling: str = "auto", native_cpu: bool = True, batch_invariant: bool = False,
                 logprobs_mode: str = "raw_logprobs") -> None:
        if random_sampling not in ("auto", "race", "inverse_cdf"):
            raise ValueError(f"random_sampling must be 'auto', 'race' or 'inverse_cdf', got {random_sampling!r}")
        self.random_sampling = random_sampling
        self.native_cpu = native_cpu
        self.batch_invariant = batch_invariant
        self.logprobs_mode = logprobs_mode

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
        return SamplerOutput(rows, num_samples, -1, vocab, tokens, packed, None)

    def _launch_processed_cpu(self, raw: torch.Tensor, rows: list[SamplingRow], md: SamplingMetadata,
                              vocab: int) -> SamplerOutput | None:
        """CPU float32 rows with filters, penalties or other logit processing, one sample each, no top logprobs: the
        processed logits (temperature, penalties, top-k / top-p / min-p, bans: `_process_logits`) go to the C kernel
        at temperature 1 (the same inverse-CDF draw as `_sample`'s, one pass instead of ~4 torch passes), and the
        raw logprob is the raw row's logit minus its logsumexp. None when the kernel is unavailable."""
        native = _native_cpu_kernels()
        if native is None:
            return None  # before any draw: the torch path draws the rows' numbers itself
        x = _process_logits(raw, md)
        if x.stride(1) != 1:
            x = x.contiguous()
        params = self._plain_row_params(rows, md.greedy, [1.0] * len(rows))
        tokens, _ = native.sample_rows(x, params[:, 1].float().contiguous(), params[:, 0].contiguous())
        tok_lp = raw.gather(1, tokens.unsqueeze(1)).squeeze(1) - _logsumexp(raw)
        packed = torch.cat([tokens.to(torch.float64), tok_lp.to(torch.float64)])
        return SamplerOutput(rows, md.num_samples, -1, vocab, tokens, packed, None)

    def greedy_rows(self, logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Argmax (first index of the max) and raw logprob of every row of ``logits`` [rows, vocab], in one
        device→host transfer: speculative verification's greedy rows. The one-pass kernels of plain greedy
        decoding take them (C on a CPU for float32, Triton on CUDA: a torch max + logsumexp over a 20-row step
        of the bundled model's 49 152 logits cost ~1.3 ms, 4 % of a 4-concurrent CPU verification step); torch
        ops under batch invariance, or where neither kernel applies."""
        tokens = logprobs = None
        if not self.batch_invariant and logits.dim() == 2 and logits.shape[0] and logits.stride(1) == 1:
            if logits.device.type == "cuda":
                from pagedllm.kernels.triton_greedy import greedy_sample_with_logprob

                tokens, logprobs = greedy_sample_with_logprob(logits)
            elif logits.device.type == "cpu" and self.native_cpu and logits.dtype == torch.float32:
                native = _native_cpu_kernels()
                if native is not None:
                    rows = logits.shape[0]
                    tokens, logprobs = native.sample_rows(logits, torch.ones(rows),
                                                          torch.full((rows,), -1.0, dtype=torch.float64))
        if tokens is None:
            lg = logits.float()
            best, tokens = lg.max(dim=-1)
            logprobs = best - lg.logsumexp(dim=-1)
        both = torch.stack([tokens.to(torch.float64), logprobs.to(torch.float64)]).tolist()
        return [int(t) for t in both[0]], both[1]

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
        raw_logits: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Queue the sampling of ``logits`` ``[len(rows), vocab]`` on its device without waiting for it
        (nothing here synchronises with the device); `SamplerOutput.result()` reads it back.

        `token_bitmask` (structured outputs): the step's packed bitmask and the rows it constrains, applied as
        `apply_token_bitmask_` does. On a GPU, rows that one kernel samples read a pinned mask in place inside
        that kernel (no masking launch); otherwise the logits are masked first (in place).

        `raw_logits` (custom logits processors ran on ``logits``): the model's own logits, which the log-probs are
        of (vLLM's raw log-probs); sampling then takes the general path."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must have shape [len(rows)={len(rows)}, vocab], got "
                f"{tuple(logits.shape)}."
            )
        if token_bitmask is not None and not token_bitmask[1]:
            token_bitmask = None
        if not rows:
            empty = logits.float().log_softmax(-1) if return_logprobs_tensor else None
            return SamplerOutput([], [], -1, logits.shape[-1], None, None, empty)
        device = logits.device
        num_rows, vocab = logits.shape
        md = SamplingMetadata.from_rows(rows, vocab)
        one_row_each = sum(md.num_samples) == num_rows
        untouched = (not md.need_pen and not md.ban_rows and not md.adjust and raw_logits is None
                     and self.logprobs_mode == "raw_logprobs")
        if (device.type == "cuda" and not self.batch_invariant and all(md.greedy) and untouched
                and md.max_logprobs < 0 and not return_logprobs_tensor and one_row_each and token_bitmask is None):
            # The common decode step: one pass over the logits instead of a float32 copy + argmax + logsumexp.
            from pagedllm.kernels.triton_greedy import greedy_sample_with_logprob

            tokens, tok_lp = greedy_sample_with_logprob(logits)
            packed = torch.cat([tokens.to(torch.float64), tok_lp.to(torch.float64)])
            return SamplerOutput(rows, md.num_samples, -1, vocab, tokens, packed, None)

        # Rows that one kernel can take: argmax or a draw at a temperature, the raw logprob, one sample each.
        plain = (not self.batch_invariant and untouched and not md.filtered and md.max_logprobs < 0
                 and not return_logprobs_tensor and one_row_each)
        host_draws_on_gpu = (plain and device.type == "cuda" and self.random_sampling != "race"
                             and all(md.greedy[i] or _draws_on_host(row.generator) for i, row in enumerate(rows)))
        one_kernel = plain and (
            (host_draws_on_gpu and (not all(md.greedy) or token_bitmask is not None))
            or (device.type == "cpu" and self.native_cpu and logits.dtype == torch.float32 and logits.stride(1) == 1
                and (all(md.greedy) or self.random_sampling != "race")))
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
            out = self._launch_one_kernel(logits, rows, md.num_samples, md.greedy, md.temps, vocab, folded_mask)
            if out is not None:
                return out
        elif (device.type == "cpu" and self.native_cpu and self.random_sampling != "race" and not self.batch_invariant
              and md.max_logprobs < 0 and not return_logprobs_tensor and one_row_each and raw_logits is None
              and self.logprobs_mode == "raw_logprobs"
              and logits.dtype == torch.float32 and logits.stride(1) == 1):
            out = self._launch_processed_cpu(logits, rows, md, vocab)
            if out is not None:
                return out

        raw = (logits if raw_logits is None else raw_logits).float()  # never modified in place
        x = _process_logits(raw if raw_logits is None else logits.float(), md)
        flat_rows_t = (async_tensor_h2d([i for i, s in enumerate(md.num_samples) for _ in range(s)], torch.long,
                                        device) if not one_row_each else None)  # flat sample position -> row
        tokens, raw_logsumexp = self._sample(x, raw, rows, md, flat_rows_t)

        # ---- log-probs (the raw distribution, or what logprobs_mode names) ---- #
        row_of = flat_rows_t if flat_rows_t is not None else torch.arange(num_rows, dtype=torch.long, device=device)
        beam_full = raw.log_softmax(dim=-1) if return_logprobs_tensor else None  # beams rank by the model's
        if self.logprobs_mode == "raw_logprobs":
            full: torch.Tensor | None = beam_full if beam_full is not None else (
                raw.log_softmax(dim=-1) if md.max_logprobs >= 0 else None)
            if full is not None:
                tok_lp = full[row_of, tokens]
            else:  # cheap path: gathered raw logit minus the row's logsumexp
                if raw_logsumexp is None:
                    raw_logsumexp = _logsumexp(raw)
                tok_lp = raw[row_of, tokens] - raw_logsumexp[row_of]
        else:
            source = raw if self.logprobs_mode.startswith("raw") else x
            full = source.log_softmax(dim=-1) if self.logprobs_mode.endswith("logprobs") else source
            tok_lp = full[row_of, tokens]

        parts = [tokens.to(torch.float64), tok_lp.to(torch.float64)]
        k_top = min(md.max_logprobs, vocab)
        if k_top >= 0:  # the sampled tokens' ranks (vLLM's: 1 + the other tokens at least as likely)
            rows_lp = full if flat_rows_t is None else full[row_of]
            parts.append((rows_lp >= tok_lp.unsqueeze(1)).sum(dim=-1).to(torch.float64))
        if full is not None and k_top > 0:
            top_v, top_i = full.topk(k_top, dim=-1)
            parts += [top_i.to(torch.float64).flatten(), top_v.to(torch.float64).flatten()]
        # The single device -> host transfer, read back by SamplerOutput.result().
        return SamplerOutput(rows, md.num_samples, k_top, vocab, tokens, torch.cat(parts), beam_full)

    def _sample(self, x: torch.Tensor, raw: torch.Tensor, rows: list[SamplingRow], md: SamplingMetadata,
                flat_rows_t: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token per sample position from the processed logits `x`: greedy rows their argmax, random rows
        the race or inverse-CDF sampling → (tokens, the raw logits' logsumexp where it came for free, else None)."""
        device = x.device
        num_rows, total = len(rows), sum(md.num_samples)
        n_greedy = sum(md.greedy)
        tokens: torch.Tensor | None = None
        raw_logsumexp: torch.Tensor | None = None
        if n_greedy:
            g = x.argmax(dim=-1)
            tokens = g.index_select(0, flat_rows_t) if flat_rows_t is not None else g
        if n_greedy == num_rows:
            return tokens, None
        # Random rows, expanded to one position per sample; each takes the race or inverse-CDF sampling.
        rand_pos: list[int] = []  # flat positions of random samples
        rand_rows: list[int] = []
        race_pos: list[int] = []  # positions in the random sub-batch
        inverse_pos: list[int] = []
        race_spans: list[tuple[int, int, SampleGenerator]] = []  # (start in race_pos, count, generator)
        inverse_spans: list[tuple[int, int, SampleGenerator]] = []
        pos = 0
        for i, row in enumerate(rows):
            s = md.num_samples[i]
            if not md.greedy[i]:
                gen = row.generator
                chosen, spans = (race_pos, race_spans) if self._by_race(gen, device) else (inverse_pos, inverse_spans)
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
            weights = _exp_shifted(xr, top)
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
            sampled[inverse_idx] = inverse_cdf_sample(_exp_shifted(xi, xi.amax(dim=-1, keepdim=True)),
                                                      draw_uniforms(inverse_spans, len(inverse_pos), device))
        if tokens is None:
            return sampled, raw_logsumexp
        tokens = tokens.clone()
        tokens[async_tensor_h2d(rand_pos, torch.long, device)] = sampled
        return tokens, raw_logsumexp


#: Below this, float32 exp is subnormal or 0. On a CPU torch's exp (and logsumexp) runs 4-20x slower on vectors
#: holding such lanes, and masked or filtered logits (-inf) put one in nearly every vector (BENCHMARKS.md §76.6).
_EXP_FLOOR = -87.0
_EXP_FLOOR_WEIGHT = 2.0e-38  # > exp(_EXP_FLOOR) = 1.65e-38, whatever the exp's last bit


def _exp_shifted(x: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """exp(x - top): sampling weights, 0 for -inf logits. On a CPU the exponents are raised to _EXP_FLOOR and the
    weights at or below _EXP_FLOOR_WEIGHT (a little above exp(_EXP_FLOOR)) set to 0 in one pass: the masked and
    filtered tokens get exactly 0, every weight above 2e-38 of the top token's keeps its bits."""
    d = x - top
    if d.device.type != "cpu":
        return d.exp_()
    return F.threshold_(d.clamp_(min=_EXP_FLOOR).exp_(), _EXP_FLOOR_WEIGHT, 0.0)


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    """x.logsumexp(-1). On a CPU, with each row's terms below _EXP_FLOOR raised to it (each then adds ~1e-38 to a
    sum of at least 1: the same float), where its rows' maxima are finite."""
    if x.device.type != "cpu":
        return x.logsumexp(dim=-1)
    top = x.amax(dim=-1, keepdim=True)
    if not bool(torch.isfinite(top).all()):
        return x.logsumexp(dim=-1)
    return (x - top).clamp_(min=_EXP_FLOOR).exp_().sum(dim=-1).log_().add_(top.squeeze(1))


def _process_logits(raw: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Stages 0-4 of the module docstring on the float32 logits `raw` (returned as is when no row needs any;
    `raw` itself is never modified)."""
    x = raw
    if md.adjust:
        x = apply_logit_adjustments(raw, md.allow_only, md.allow_rows, md.allow_toks, md.bias_rows, md.bias_toks,
                                    md.bias_vals)
    if md.need_pen:
        x = apply_penalties(x, md.pen_prompts, md.pen_outputs, md.presence, md.frequency, md.repetition)
    if md.ban_rows:
        if x is raw:
            x = raw.clone()
        x[async_tensor_h2d(md.ban_rows, torch.long, x.device), async_tensor_h2d(md.ban_toks, torch.long, x.device)] \
            = NEG_INF
    if md.need_temp:
        x = x / col(md.temps, x.device)
    if md.need_topk or md.need_topp:
        x = apply_top_k_top_p(x, md.top_ks if md.need_topk else None, md.top_ps if md.need_topp else None)
    if md.need_minp:
        x = apply_min_p(x, md.min_ps)
    return x


def token_rank(logprobs: torch.Tensor, token: int) -> int:
    """vLLM's rank of `token` in one row of log-probs: 1 + the number of other tokens at least as likely."""
    return int((logprobs >= logprobs[token]).sum())


def compute_prompt_logprobs(logits: torch.Tensor, next_token_ids: torch.Tensor, k: int,
                            logits_values: bool = False) -> list[dict[int, Logprob]]:
    """Prompt log-probs: ``logits[i]`` predicts ``next_token_ids[i]``.

    Returns, per position, the actual next token (first) and the top-``k`` tokens of the raw distribution, each
    with its `Logprob`: the actual token's rank is vLLM's (1 + the number of other tokens at least as likely, so
    ties rank it lower); the top tokens rank 1, 2, … in order. `logits_values` (logprobs_mode raw_logits /
    processed_logits): the values are the logits themselves (no sampling processing applies to prompt positions).
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
    lp = logits.float() if logits_values else logits.float().log_softmax(dim=-1)
    ids = next_token_ids.to(device=logits.device, dtype=torch.long)
    actual = lp.gather(1, ids.unsqueeze(1)).squeeze(1)
    ranks = (lp >= actual.unsqueeze(1)).sum(dim=-1)
    parts = [ids.to(torch.float64), actual.to(torch.float64), ranks.to(torch.float64)]
    k = min(k, vocab)
    if k > 0:
        top_v, top_i = lp.topk(k, dim=-1)
        parts += [top_i.to(torch.float64).flatten(), top_v.to(torch.float64).flatten()]
    host = torch.cat(parts).tolist()
    out: list[dict[int, Logprob]] = []
    for i in range(n):
        ids_at, vals_at = 3 * n + i * k, 3 * n + n * k + i * k
        out.append(position_logprobs(int(host[i]), host[n + i], int(host[2 * n + i]),
                                     [int(t) for t in host[ids_at:ids_at + k]], host[vals_at:vals_at + k]))
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
    "token_rank",
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
