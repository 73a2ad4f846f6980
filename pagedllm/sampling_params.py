"""Sampling parameters for text generation (mirrors vLLM's ``SamplingParams``).

Conventions that differ from (or pick one of) vLLM's:

* ``top_k``: ``0`` means "disabled" (vLLM >= 0.6 convention). ``-1`` (vLLM V0's
  "disabled") is accepted and normalised to ``0``.
* ``best_of``: ``None`` is resolved to ``n`` in ``__post_init__``.
* Every invalid value raises :class:`ValueError` whose message names the field,
  the offending value and what is allowed.
"""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from pagedllm.structured_output.params import StructuredOutputsParams

#: Temperatures below this are treated as greedy (argmax) decoding.
SAMPLING_EPS = 1e-5

_SEED_MIN = -0x8000_0000_0000_0000
_SEED_MAX = 0xFFFF_FFFF_FFFF_FFFF


class RequestOutputKind(IntEnum):
    """Which outputs a request yields from the engine's steps (vLLM's names): every step's cumulative output
    (``CUMULATIVE``, the default), only what is new since its previous output (``DELTA``: each completion's new
    token ids, text and logprobs, the prompt logprobs in the first output only; a step that added nothing yields
    none), or only the finished one (``FINAL_ONLY``: what ``LLM.generate`` asks for; the engine then builds no
    output object for the request's unfinished steps). ``DELTA`` cannot be combined with beam search or
    ``best_of > n``, whose completions are chosen only at the end."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingType(IntEnum):
    """How the next token of a sequence is chosen."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2
    BEAM = 3


# --------------------------------------------------------------------------- #
# Validation helpers (raise ValueError naming the field).
# --------------------------------------------------------------------------- #
def _type_name(value: Any) -> str:
    return type(value).__name__


def _check_int(name: str, value: Any) -> int:
    """Return ``value`` as ``int``; reject bools, floats and non-numbers."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"{name} must be an int, got {value!r} (type {_type_name(value)})."
        )
    return int(value)


def _check_opt_int(name: str, value: Any) -> int | None:
    return None if value is None else _check_int(name, value)


def _check_float(name: str, value: Any) -> float:
    """Return ``value`` as a finite ``float``; ints are accepted, bools are not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"{name} must be a float, got {value!r} (type {_type_name(value)})."
        )
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}.")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(
            f"{name} must be a bool, got {value!r} (type {_type_name(value)})."
        )
    return value


def _check_early_stopping(value: Any) -> bool | str:
    if isinstance(value, bool) or (isinstance(value, str) and value == "never"):
        return value
    raise ValueError(
        f"early_stopping must be True, False, or 'never', got {value!r}."
    )


def _check_output_kind(value: Any) -> RequestOutputKind:
    if isinstance(value, bool) or not isinstance(value, (int, RequestOutputKind)) or value not in (0, 1, 2):
        raise ValueError("output_kind must be RequestOutputKind.CUMULATIVE (0), RequestOutputKind.DELTA (1) or "
                         f"RequestOutputKind.FINAL_ONLY (2), got {value!r}.")
    return RequestOutputKind(value)


def _normalise_stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ValueError(
            f"stop must be a str, a list of str or None, got {value!r} "
            f"(type {_type_name(value)})."
        )
    for s in items:
        if not isinstance(s, str):
            raise ValueError(
                f"stop must contain only strings, got {s!r} (type {_type_name(s)})."
            )
        if s == "":
            raise ValueError(f"stop cannot contain an empty string, got {items!r}.")
    return items


def _normalise_stop_token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"stop_token_ids must be a list of int or None, got {value!r} "
            f"(type {_type_name(value)})."
        )
    out: list[int] = []
    for t in value:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
            raise ValueError(
                f"stop_token_ids must contain only non-negative ints, got {t!r} "
                f"in {list(value)!r}."
            )
        out.append(int(t))
    return out


def _token_id(name: str, t: Any) -> int:
    if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
        raise ValueError(f"{name} must hold non-negative int token ids, got {t!r} (type {_type_name(t)}).")
    return int(t)


def _normalise_logit_bias(value: Any) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> float or None, got {value!r} "
                         f"(type {_type_name(value)}).")
    return {_token_id("logit_bias", t): _check_float(f"logit_bias[{t}]", b) for t, b in value.items()}


def _normalise_allowed_token_ids(value: Any) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"allowed_token_ids must be a non-empty list of token ids or None, got {value!r}.")
    return [_token_id("allowed_token_ids", t) for t in value]


def _normalise_bad_words(value: Any) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in value):
        raise ValueError(f"bad_words must be a list of non-blank strings or None, got {value!r}.")
    return list(value)


# --------------------------------------------------------------------------- #
# SamplingParams
# --------------------------------------------------------------------------- #
@dataclass
class SamplingParams:
    """Sampling parameters for one request (vLLM semantics).

    ``n`` sequences are returned out of ``best_of`` generated ones. ``temperature``
    0 means greedy. ``max_tokens=None`` means "up to max_model_len" (resolved by
    the engine). ``top_k == 0`` disables top-k (``-1`` is normalised to ``0``).
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    #: Constrain the output to a JSON schema / regex / choice / grammar (see StructuredOutputsParams).
    structured_outputs: StructuredOutputsParams | None = None
    #: Every step's cumulative output, or only the final one (see RequestOutputKind).
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    #: Token id → value added to its logit before any other processing (OpenAI's ``logit_bias``; -100 / 100
    #: in effect ban / force a token).
    logit_bias: dict[int, float] | None = None
    #: Only these token ids may be sampled (every other logit is -inf before any other processing).
    allowed_token_ids: list[int] | None = None
    #: Keep only the prompt's last k tokens (-1: as many as fit with one generated token), as vLLM.
    truncate_prompt_tokens: int | None = None
    #: Words never generated (vLLM's): a word's last token is banned whenever the output so far ends with the rest
    #: of it; each word counts with and without a leading space.
    bad_words: list[str] | None = None
    #: Arguments for custom logits processors (vLLM's ``extra_args``; the server's ``vllm_xargs``): a processor
    #: reads its own keys from the params of each request it is handed (pagedllm/logits_processor.py).
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self._normalise_and_check_types()
        self._verify_args()
        if self.use_beam_search:
            self._verify_beam_search()
        else:
            self._verify_non_beam_search()
            if self.temperature < SAMPLING_EPS:
                # Zero temperature means greedy: other sampling knobs are moot.
                self.top_p = 1.0
                self.top_k = 0
                self.min_p = 0.0
                self._verify_greedy_sampling()

    # ------------------------------------------------------------------ #
    def _normalise_and_check_types(self) -> None:
        self.n = _check_int("n", self.n)
        self.best_of = _check_opt_int("best_of", self.best_of)
        if self.best_of is None:
            self.best_of = self.n
        self.presence_penalty = _check_float("presence_penalty", self.presence_penalty)
        self.frequency_penalty = _check_float(
            "frequency_penalty", self.frequency_penalty
        )
        self.repetition_penalty = _check_float(
            "repetition_penalty", self.repetition_penalty
        )
        self.temperature = _check_float("temperature", self.temperature)
        self.top_p = _check_float("top_p", self.top_p)
        self.top_k = _check_int("top_k", self.top_k)
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = _check_float("min_p", self.min_p)
        self.seed = _check_opt_int("seed", self.seed)
        self.use_beam_search = _check_bool("use_beam_search", self.use_beam_search)
        self.length_penalty = _check_float("length_penalty", self.length_penalty)
        self.early_stopping = _check_early_stopping(self.early_stopping)
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        self.include_stop_str_in_output = _check_bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )
        self.ignore_eos = _check_bool("ignore_eos", self.ignore_eos)
        self.max_tokens = _check_opt_int("max_tokens", self.max_tokens)
        self.min_tokens = _check_int("min_tokens", self.min_tokens)
        self.logprobs = _check_opt_int("logprobs", self.logprobs)
        self.prompt_logprobs = _check_opt_int("prompt_logprobs", self.prompt_logprobs)
        self.skip_special_tokens = _check_bool(
            "skip_special_tokens", self.skip_special_tokens
        )
        self.spaces_between_special_tokens = _check_bool(
            "spaces_between_special_tokens", self.spaces_between_special_tokens
        )
        self.detokenize = _check_bool("detokenize", self.detokenize)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self.output_kind = _check_output_kind(self.output_kind)
        self.logit_bias = _normalise_logit_bias(self.logit_bias)
        self.allowed_token_ids = _normalise_allowed_token_ids(self.allowed_token_ids)
        self.truncate_prompt_tokens = _check_opt_int("truncate_prompt_tokens", self.truncate_prompt_tokens)
        self.bad_words = _normalise_bad_words(self.bad_words)
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict of argument name -> value or None, got {self.extra_args!r}.")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1 \
                and self.truncate_prompt_tokens != -1:
            raise ValueError(f"truncate_prompt_tokens must be at least 1, or -1 (as many as fit), got "
                             f"{self.truncate_prompt_tokens}.")

    def _verify_args(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self._resolved_best_of < self.n:
            raise ValueError(
                f"best_of must be greater than or equal to n, got n={self.n} "
                f"and best_of={self.best_of}."
            )
        if self.output_kind == RequestOutputKind.DELTA and (self.use_beam_search or self._resolved_best_of > self.n):
            raise ValueError(
                "output_kind DELTA streams each completion as it grows, but beam search and best_of > n choose the "
                "returned completions only at the end: use RequestOutputKind.CUMULATIVE or FINAL_ONLY with them."
            )
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}."
            )
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}."
            )
        if not self.repetition_penalty > 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got "
                f"{self.repetition_penalty}."
            )
        if not self.temperature >= 0.0:
            raise ValueError(
                f"temperature must be non-negative, got {self.temperature}."
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(
                f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}."
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None and not _SEED_MIN <= self.seed <= _SEED_MAX:
            raise ValueError(
                f"seed must be in [{_SEED_MIN}, {_SEED_MAX}] or None, got {self.seed}."
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(
                f"max_tokens must be at least 1 (or None), got {self.max_tokens}."
            )
        if self.min_tokens < 0:
            raise ValueError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens="
                f"{self.max_tokens}, got {self.min_tokens}."
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(
                f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}."
            )
        if self.stop and not self.detokenize:
            raise ValueError(
                f"stop strings are only supported when detokenize is True, got "
                f"stop={self.stop!r} with detokenize=False."
            )

    def _verify_beam_search(self) -> None:
        if self.has_logit_adjustments:
            raise ValueError("logit_bias, allowed_token_ids and bad_words are not supported with beam search; drop "
                             "them or sample instead.")
        if self._resolved_best_of == 1:
            raise ValueError(
                f"best_of must be greater than 1 when using beam search, got "
                f"{self.best_of}."
            )
        if self.temperature > SAMPLING_EPS:
            raise ValueError(
                f"temperature must be 0 when using beam search, got {self.temperature}."
            )
        if self.top_p < 1.0 - SAMPLING_EPS:
            raise ValueError(
                f"top_p must be 1 when using beam search, got {self.top_p}."
            )
        if self.top_k != 0:
            raise ValueError(
                f"top_k must be 0 or -1 (disabled) when using beam search, got "
                f"{self.top_k}."
            )
        if self.min_p > SAMPLING_EPS:
            raise ValueError(
                f"min_p must be 0 when using beam search, got {self.min_p}."
            )

    def _verify_non_beam_search(self) -> None:
        if self.early_stopping is not False:
            raise ValueError(
                f"early_stopping is not effective and must be False when not using "
                f"beam search, got {self.early_stopping!r}."
            )
        if not 1.0 - SAMPLING_EPS <= self.length_penalty <= 1.0 + SAMPLING_EPS:
            raise ValueError(
                f"length_penalty is not effective and must be the default value of "
                f"1.0 when not using beam search, got {self.length_penalty}."
            )

    def _verify_greedy_sampling(self) -> None:
        if self._resolved_best_of > 1:
            raise ValueError(
                f"best_of must be 1 when using greedy sampling (temperature=0), got "
                f"{self.best_of}."
            )

    # ------------------------------------------------------------------ #
    @property
    def _resolved_best_of(self) -> int:
        return self.n if self.best_of is None else self.best_of

    @property
    def sampling_type(self) -> SamplingType:
        """GREEDY, RANDOM, RANDOM_SEED or BEAM."""
        if self.use_beam_search:
            return SamplingType.BEAM
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def has_logit_adjustments(self) -> bool:
        """``logit_bias``, ``allowed_token_ids`` or ``bad_words`` is set: the sampler changes the row's logits first
        (and such a request does not speculate)."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)

    @property
    def output_text_buffer_length(self) -> int:
        """Characters of output text to hold back so a stop string can be
        removed before it is streamed (vLLM semantics)."""
        if self.stop and not self.include_stop_str_in_output:
            return max(len(s) for s in self.stop) - 1  # type: ignore[union-attr]
        return 0

    def clone(self) -> "SamplingParams":
        """Deep copy (lists are not shared with the original)."""
        return copy.deepcopy(self)


# --------------------------------------------------------------------------- #
# BeamSearchParams
# --------------------------------------------------------------------------- #
@dataclass
class BeamSearchParams:
    """Parameters for the engine-level beam search API (vLLM's)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        self.beam_width = _check_int("beam_width", self.beam_width)
        self.max_tokens = _check_int("max_tokens", self.max_tokens)
        self.ignore_eos = _check_bool("ignore_eos", self.ignore_eos)
        self.temperature = _check_float("temperature", self.temperature)
        self.length_penalty = _check_float("length_penalty", self.length_penalty)
        self.include_stop_str_in_output = _check_bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not self.temperature >= 0.0:
            raise ValueError(
                f"temperature must be non-negative, got {self.temperature}."
            )

    def clone(self) -> "BeamSearchParams":
        """Copy of these parameters."""
        return copy.deepcopy(self)


__all__ = ["SAMPLING_EPS", "BeamSearchParams", "SamplingParams", "SamplingType", "StructuredOutputsParams"]
