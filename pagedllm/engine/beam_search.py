"""Beam search inside the engine, with Hugging Face transformers' semantics (paper §4.4).

Every step, all running beams of a request are computed together (the scheduler runs a
multi-sequence group in lockstep); from the k·|V| candidates ``cumulative + log p(token)`` the
top ``K = max(2, 1 + #eos) · k`` are taken, as in ``transformers.GenerationMixin._beam_search``:

* the best k candidates that do not stop become the next running beams: a parent kept once
  appends in place, a parent kept j > 1 times is forked j − 1 times (its block table is shared,
  no KV bytes move; copy-on-write happens later only on a shared, partly filled last block),
  and a parent kept zero times is freed;
* candidates among the first k of the K that stop (EOS, a stop token, or the length limit) become
  finished hypotheses with score ``cumulative / generated_len ** length_penalty``, where
  ``generated_len`` counts the generated tokens including the final one (not the prompt — as in
  transformers 5.x); the best k hypotheses are kept;
* the request stops when no running beam can improve on the worst kept hypothesis (HF's
  heuristic, ``early_stopping`` False/"never"), when k hypotheses exist and
  ``early_stopping is True``, or when every candidate stops (the length limit).

Finished hypotheses own no blocks: they are token lists only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.logprobs import Logprob, position_logprobs
from pagedllm.model.layers.sampler import token_rank
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from pagedllm.core.block_manager import BlockManager

_NEG = -1.0e9  # HF's "impossible" score


@dataclass
class BeamSearchState:
    """Per-request beam search bookkeeping, kept in ``group.extra["beam"]``."""

    beam_width: int
    length_penalty: float
    early_stopping: bool | str
    max_tokens: int
    # Finished hypotheses, best first, at most beam_width: (score, sequence without blocks).
    finished: list[tuple[float, Sequence]] = field(default_factory=list)
    # HF's is_early_stop_heuristic_unsatisfied: can a running beam still beat the kept hypotheses?
    improvable: bool = True
    done: bool = False


def new_beam_state(params: SamplingParams, max_tokens: int) -> BeamSearchState:
    return BeamSearchState(
        beam_width=params.best_of or params.n,
        length_penalty=float(params.length_penalty),
        early_stopping=params.early_stopping,
        max_tokens=max_tokens,
    )


@dataclass
class BeamContext:
    """What a beam step needs from the engine: the block manager and fresh sequence ids."""

    block_manager: BlockManager
    new_seq_id: Callable[[], int]
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    # Output token ids → the stop string their text contains, if any (None: the request has no stop strings).
    find_stop_string: Callable[[list[int]], str | None] | None = None


def beam_step(group: SequenceGroup, parents: list[Sequence], logprobs: torch.Tensor, ctx: BeamContext) -> None:
    """Advance one beam-search request by one token; ``logprobs`` is ``[len(parents), vocab]``.

    ``parents`` are the group's running beams, each sampled this step, in row order.
    """
    state: BeamSearchState = group.extra["beam"]
    params: SamplingParams = group.sampling_params
    k = state.beam_width
    n_out = len(parents[0].output_token_ids)
    if any(len(p.output_token_ids) != n_out for p in parents):
        raise RuntimeError("beam search got beams of different lengths in one step")
    gen_len = n_out + 1  # generated tokens once this step's token is appended

    eos = () if params.ignore_eos else ctx.eos_token_ids
    stop_ids = set(params.stop_token_ids or ())
    stop_tokens = set(eos) | stop_ids
    lp = logprobs.float()
    vocab = lp.shape[-1]
    if n_out < params.min_tokens and stop_tokens:
        lp = lp.clone()
        lp[:, [t for t in stop_tokens if 0 <= t < vocab]] = float("-inf")
    cum = torch.tensor([p.cumulative_logprob for p in parents], dtype=torch.float32, device=lp.device)
    scores = (lp + cum[:, None]).reshape(-1)
    num_keep = min(max(2, 1 + len(eos)) * k, scores.numel())
    top_scores, top_idx = torch.topk(scores, num_keep)
    top_tok_lp = lp.reshape(-1)[top_idx]
    length_capped = n_out + 1 >= state.max_tokens or parents[0].get_len() + 1 >= ctx.max_model_len
    normalized = top_scores / (gen_len**state.length_penalty)
    host = torch.stack([top_idx.double(), top_scores.double(), top_tok_lp.double(), normalized.double()]).tolist()

    cands = []
    for j in range(num_keep):
        flat, score, tok_lp, norm = int(host[0][j]), host[1][j], host[2][j], host[3][j]
        parent, tok = parents[flat // vocab], flat % vocab
        stop_str = None
        if tok in stop_tokens and n_out + 1 >= params.min_tokens:
            status = SequenceStatus.FINISHED_STOPPED
        elif (ctx.find_stop_string is not None and n_out + 1 >= params.min_tokens
              and (stop_str := ctx.find_stop_string([*parent.output_token_ids, tok])) is not None):
            status = SequenceStatus.FINISHED_STOPPED  # its text reached a stop string: a finished hypothesis
        elif length_capped:
            status = SequenceStatus.FINISHED_LENGTH_CAPPED
        else:
            status = None
        cands.append((parent, tok, score, tok_lp, norm, status, stop_str))

    # Finished hypotheses: only from the first k candidates, only while they can still matter.
    full_and_early = len(state.finished) == k and state.early_stopping is True
    if state.improvable and not full_and_early:
        for parent, tok, score, tok_lp, norm, status, stop_str in cands[:k]:
            if status is None:
                continue
            hyp = parent.fork(ctx.new_seq_id())
            _append(hyp, tok, tok_lp, score, params, lp, parents.index(parent))
            hyp.status = status
            if stop_str is not None:
                hyp.stop_reason = stop_str
            elif status is SequenceStatus.FINISHED_STOPPED and tok in stop_ids and tok not in eos:
                hyp.stop_reason = tok
            state.finished.append((norm, hyp))
        state.finished.sort(key=lambda x: x[0], reverse=True)
        del state.finished[k:]

    running = [c for c in cands if c[5] is None][:k]
    all_stop = not running
    # Early-stop heuristic on the best running beam (HF's _check_early_stop_heuristic).
    if running and len(state.finished) == k:
        if state.early_stopping == "never" and state.length_penalty > 0.0:
            hyp_len = state.max_tokens
        else:
            hyp_len = gen_len
        best = torch.tensor(running[0][2], dtype=torch.float32) / (hyp_len**state.length_penalty)
        worst = torch.tensor(state.finished[-1][0], dtype=torch.float32)
        state.improvable = state.improvable and bool(best > worst)
    full_and_early = len(state.finished) == k and state.early_stopping is True
    state.done = all_stop or not state.improvable or full_and_early

    bm = ctx.block_manager
    if state.done:
        for p in parents:
            bm.free(p)
        group.seqs = [seq for _, seq in state.finished] or _fallback(parents)
        return
    # Forks first (a child copies its parent's tokens before the parent appends), then appends.
    used: set[int] = set()
    new_seqs: list[tuple[Sequence, tuple]] = []
    for cand in running:
        parent = cand[0]
        if parent.seq_id in used:
            child = parent.fork(ctx.new_seq_id())
            bm.fork(parent, child)
            new_seqs.append((child, cand))
        else:
            used.add(parent.seq_id)
            new_seqs.append((parent, cand))
    for p in parents:
        if p.seq_id not in used:
            bm.free(p)
    for seq, (parent, tok, score, tok_lp, _norm, _status, _stop_str) in new_seqs:
        _append(seq, tok, tok_lp, score, params, lp, parents.index(parent))
        seq.status = SequenceStatus.RUNNING
    group.seqs = [seq for seq, _ in new_seqs]


def _append(seq: Sequence, tok: int, tok_lp: float, score: float, params: Any, lp: torch.Tensor, row: int) -> None:
    seq.output_token_ids.append(tok)
    seq.cumulative_logprob = score  # float32 running score, exactly as HF accumulates it
    if params.logprobs is not None:
        vals, ids = lp[row].topk(min(params.logprobs, lp.shape[-1]))
        seq.output_logprobs.append(position_logprobs(tok, tok_lp, token_rank(lp[row], tok), ids.tolist(),
                                                     vals.tolist()))


def _fallback(parents: list[Sequence]) -> list[Sequence]:
    for p in parents:
        p.status = SequenceStatus.FINISHED_LENGTH_CAPPED
    return list(parents)


def output_seqs(group: SequenceGroup, n: int) -> list[Sequence]:
    """The sequences a RequestOutput reports: the best n hypotheses, or the best running beams."""
    state: BeamSearchState = group.extra["beam"]
    if state.done:
        return list(group.seqs[:n])
    return sorted(group.seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:n]


def hypothesis_score(seq: Sequence, length_penalty: float) -> float:
    """HF's finished-hypothesis score: cumulative logprob / generated_len ** length_penalty."""
    return seq.cumulative_logprob / (max(1, len(seq.output_token_ids)) ** length_penalty)


# -- the LLM.beam_search convenience API (vLLM's names) ---------------------------------------
@dataclass
class BeamSearchSequence:
    """One returned beam: prompt + generated ``tokens``, generated ``text``, its scores."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float
    text: str | None
    score: float
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def to_sampling_params(params: BeamSearchParams) -> SamplingParams:
    """The engine-level request equivalent to ``LLM.beam_search(prompts, params)``."""
    if params.temperature != 0.0:
        raise ValueError(
            f"beam search in this engine is deterministic: temperature must be 0, got {params.temperature}."
        )
    if params.beam_width < 2:
        raise ValueError(f"beam_width must be at least 2 for beam search, got {params.beam_width}.")
    return SamplingParams(
        n=params.beam_width,
        best_of=params.beam_width,
        use_beam_search=True,
        temperature=0.0,
        max_tokens=params.max_tokens,
        ignore_eos=params.ignore_eos,
        length_penalty=params.length_penalty,
        include_stop_str_in_output=params.include_stop_str_in_output,
    )


def to_beam_search_output(out: Any, length_penalty: float) -> BeamSearchOutput:
    """Convert one finished RequestOutput of a beam-search request."""
    seqs = [
        BeamSearchSequence(
            tokens=list(out.prompt_token_ids) + list(c.token_ids),
            logprobs=list(c.logprobs or []),
            cum_logprob=c.cumulative_logprob,
            text=c.text,
            score=c.cumulative_logprob / (max(1, len(c.token_ids)) ** length_penalty),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in out.outputs
    ]
    return BeamSearchOutput(sequences=seqs)
