"""Sequences and sequence groups: the scheduler's unit of work (pure Python)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.logprobs import Logprob


class SequenceStatus(enum.Enum):
    # The finished statuses are numbered from _FIRST_FINISHED up, so that "is it finished?" (asked for every
    # sequence several times a step) is one comparison rather than a set lookup through Enum's Python __hash__.
    WAITING = 1
    RUNNING = 2
    SWAPPED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_IGNORED = 7

    @property
    def is_finished(self) -> bool:
        return self._value_ >= _FIRST_FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FIRST_FINISHED = 4
_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "length",
}


@dataclass(eq=False)  # an entity: two sequences are equal only if they are the same one
class Sequence:
    """One token stream. Its KV cache covers `num_computed_tokens` of its tokens.

    The engine computes tokens ``[num_computed_tokens, len(token_ids))`` in one or more steps
    (chunked prefill); only when every token is computed does a step sample a new one.

    Under asynchronous scheduling a step's sampled token stays on the device while the next step is
    scheduled: it counts in `num_pending_tokens` (and so in `num_uncomputed_tokens`) until the
    engine appends it, and the worker takes it as the next step's input straight from the device.
    """

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    stop_reason: int | str | None = None
    # Per-token logprob dicts (when the request asked for logprobs).
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    # Sampled by a launched step, not appended yet (asynchronous scheduling); see the class docstring.
    num_pending_tokens: int = 0
    # Free-form per-sequence state owned by the engine (detokenizer, generator, ...).
    extra: dict[str, Any] = field(default_factory=dict)
    # vLLM's cache_salt: the prefix cache finds this sequence's blocks only for requests with the same salt.
    cache_salt: str | None = None
    # Multimodal prompts: (offset, length, content hash) of each image's placeholder run. A block holding any of
    # those positions is cached under the image's hash too, so equal prompts with different images share nothing.
    mm_placeholders: tuple[tuple[int, int, str], ...] = ()

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def get_token_id(self, index: int) -> int:
        n_prompt = len(self.prompt_token_ids)
        if index < n_prompt:
            return self.prompt_token_ids[index]
        return self.output_token_ids[index - n_prompt]

    def tokens_slice(self, start: int, end: int) -> list[int]:
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def get_len_with_pending(self) -> int:
        """Tokens the scheduler plans with: the known ones plus those still on the device."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.get_len_with_pending() - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than one token awaits computation (a prompt or a recompute)."""
        return self.num_uncomputed_tokens > 1

    def is_finished(self) -> bool:
        return self.status._value_ >= _FIRST_FINISHED

    def append_token(self, token_id: int, logprob: float) -> None:
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def reset_for_recompute(self) -> None:
        """Forget the KV cache: everything (prompt + outputs) is computed again."""
        self.num_computed_tokens = 0

    def fork(self, new_seq_id: int) -> Sequence:
        child = Sequence(
            seq_id=new_seq_id,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
            stop_reason=self.stop_reason,
            output_logprobs=list(self.output_logprobs),
            cache_salt=self.cache_salt,
            mm_placeholders=self.mm_placeholders,
        )
        return child


@dataclass(eq=False)
class SequenceGroup:
    """One request: a prompt and the 1..n sequences generated from it, scheduled as a unit."""

    request_id: str
    seqs: list[Sequence]
    sampling_params: Any  # SamplingParams; kept untyped so core/ does not import engine-side modules
    arrival_time: float
    prompt: str | None = None
    priority: int = 0  # under the "priority" scheduling policy: lower values are served first
    lora_int_id: int = 0  # the request's LoRA adapter (0: none); a step holds at most max_loras distinct ones
    # False while the group may not sample yet (its structured-output grammar still compiles): the scheduler
    # runs its prompt up to, not including, the last token, whose step would sample.
    may_sample: bool = True
    # With may_sample False: the last prompt token runs all the same, and the engine keeps that step's logits
    # row to sample the first token from once the grammar is ready (no step of its own for it).
    defer_sample: bool = False
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Sequences that finished and left the running set but belong to the final answer.
    finished_seqs: list[Sequence] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    # A pooling request that reads every prompt row (MEAN, CLS, the per-token tasks): see skips_prefix_cache.
    needs_every_prompt_row: bool = False

    @property
    def skips_prefix_cache(self) -> bool:
        """A request for prompt log-probs (or a pooling request that reads every prompt row) needs every prompt
        position's output, and a cached block has none: it computes its whole prompt (as vLLM). Its blocks are
        still cached for others."""
        return self.needs_every_prompt_row or getattr(self.sampling_params, "prompt_logprobs", None) is not None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids if self.seqs else self.finished_seqs[0].prompt_token_ids

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs)
        return [s for s in self.seqs if s.status == status]

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if s.status._value_ < _FIRST_FINISHED]

    def num_unfinished_seqs(self) -> int:
        n = 0
        for s in self.seqs:
            n += s.status._value_ < _FIRST_FINISHED
        return n

    def is_finished(self) -> bool:
        for s in self.seqs:
            if s.status._value_ < _FIRST_FINISHED:
                return False
        return True

    def has_prefill(self) -> bool:
        """Whether an unfinished sequence has more than one token to compute (a prompt or a recompute)."""
        for s in self.seqs:
            if s.status._value_ < _FIRST_FINISHED and s.is_prefill:
                return True
        return False

    def max_num_running_seqs(self) -> int:
        """Upper bound on sequences this group will run at once (best_of forks after prefill)."""
        seqs = self.seqs
        if len(seqs) == 1:
            seq = seqs[0]
            if seq.status._value_ >= _FIRST_FINISHED:
                return 0
            if seq.output_token_ids:
                return 1
            params = self.sampling_params
            return getattr(params, "best_of", None) or getattr(params, "n", 1) or 1
        return self.num_unfinished_seqs()
