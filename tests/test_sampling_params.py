"""Tests for pagedllm.sampling_params."""

from __future__ import annotations

from typing import Any

import pytest

from pagedllm.sampling_params import BeamSearchParams, SamplingParams, SamplingType

# (kwargs, field name expected in the error message)
INVALID_CASES: list[tuple[dict[str, Any], str]] = [
    ({"n": 0}, "n"),
    ({"n": 1.5}, "n"),
    ({"n": True}, "n"),
    ({"n": "2"}, "n"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 2.0}, "best_of"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"presence_penalty": "0"}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": None}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"seed": 1.0}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"use_beam_search": 1}, "use_beam_search"),
    ({"early_stopping": "always"}, "early_stopping"),
    ({"early_stopping": 1}, "early_stopping"),
    ({"early_stopping": True}, "early_stopping"),  # not beam search
    ({"length_penalty": 2.0}, "length_penalty"),  # not beam search
    ({"stop": ""}, "stop"),
    ({"stop": ["a", ""]}, "stop"),
    ({"stop": ["a", 3]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop": "x", "detokenize": False}, "stop"),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
    ({"stop_token_ids": [1, 2.0]}, "stop_token_ids"),
    ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ({"ignore_eos": None}, "ignore_eos"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 1.0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 1.5}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"skip_special_tokens": 0}, "skip_special_tokens"),
    ({"spaces_between_special_tokens": None}, "spaces_between_special_tokens"),
    ({"detokenize": "no"}, "detokenize"),
    # greedy + best_of > 1
    ({"temperature": 0.0, "n": 2}, "best_of"),
    ({"temperature": 0.0, "best_of": 3}, "best_of"),
    # beam search
    ({"use_beam_search": True, "temperature": 0.0}, "best_of"),
    ({"use_beam_search": True, "best_of": 2}, "temperature"),
    ({"use_beam_search": True, "best_of": 2, "temperature": 0.0, "top_p": 0.5}, "top_p"),
    ({"use_beam_search": True, "best_of": 2, "temperature": 0.0, "top_k": 5}, "top_k"),
    ({"use_beam_search": True, "best_of": 2, "temperature": 0.0, "min_p": 0.1}, "min_p"),
]


@pytest.mark.parametrize(("kwargs", "field"), INVALID_CASES)
def test_invalid_values_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    # The message leads with the offending field's name.
    assert str(info.value).startswith(field + " "), str(info.value)


def test_invalid_table_is_large() -> None:
    assert len(INVALID_CASES) >= 20


def test_message_format() -> None:
    with pytest.raises(ValueError, match=r"temperature must be non-negative, got -1\.0\."):
        SamplingParams(temperature=-1.0)


def test_defaults() -> None:
    p = SamplingParams()
    assert p.n == 1 and p.best_of == 1
    assert p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
    assert p.repetition_penalty == 1.0
    assert p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == 0 and p.min_p == 0.0
    assert p.seed is None and p.use_beam_search is False
    assert p.length_penalty == 1.0 and p.early_stopping is False
    assert p.stop == [] and p.stop_token_ids == []
    assert p.include_stop_str_in_output is False and p.ignore_eos is False
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert p.sampling_type is SamplingType.RANDOM


def test_normalisation() -> None:
    p = SamplingParams(n=2, stop="###", stop_token_ids=(5, 7), top_k=-1, temperature=1)
    assert p.best_of == 2
    assert p.stop == ["###"]
    assert p.stop_token_ids == [5, 7]
    assert p.top_k == 0
    assert isinstance(p.temperature, float)
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(min_tokens=5, max_tokens=5).min_tokens == 5
    assert SamplingParams(min_tokens=100, max_tokens=None).min_tokens == 100
    assert SamplingParams(stop=["ab", "abcd"]).output_text_buffer_length == 3
    keep = SamplingParams(stop=["ab"], include_stop_str_in_output=True)
    assert keep.output_text_buffer_length == 0


def test_greedy_normalises_sampling_knobs() -> None:
    p = SamplingParams(temperature=0.0, top_p=0.3, top_k=5, min_p=0.2, seed=3)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert p.sampling_type is SamplingType.GREEDY


def test_sampling_types() -> None:
    assert SamplingParams(seed=0).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=1e-6).sampling_type is SamplingType.GREEDY
    beam = SamplingParams(n=2, use_beam_search=True, temperature=0.0)
    assert beam.sampling_type is SamplingType.BEAM


def test_beam_search_valid() -> None:
    p = SamplingParams(
        n=2,
        best_of=4,
        use_beam_search=True,
        temperature=0,
        length_penalty=0.7,
        early_stopping="never",
        top_k=-1,
    )
    assert p.best_of == 4 and p.early_stopping == "never" and p.length_penalty == 0.7
    SamplingParams(n=1, best_of=2, use_beam_search=True, temperature=0.0, early_stopping=True)


def test_clone_is_deep() -> None:
    p = SamplingParams(stop=["a"], stop_token_ids=[1], seed=4)
    c = p.clone()
    assert c == p and c is not p
    c.stop.append("b")  # type: ignore[union-attr]
    c.stop_token_ids.append(2)  # type: ignore[union-attr]
    assert p.stop == ["a"] and p.stop_token_ids == [1]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
        ({"beam_width": 2.0, "max_tokens": 4}, "beam_width"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
        ({"beam_width": 2, "max_tokens": 4, "temperature": -0.5}, "temperature"),
        ({"beam_width": 2, "max_tokens": 4, "ignore_eos": 1}, "ignore_eos"),
        ({"beam_width": 2, "max_tokens": 4, "length_penalty": "x"}, "length_penalty"),
    ],
)
def test_beam_search_params_invalid(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as info:
        BeamSearchParams(**kwargs)
    assert str(info.value).startswith(field + " "), str(info.value)


def test_beam_search_params_defaults() -> None:
    b = BeamSearchParams(beam_width=4, max_tokens=32)
    assert (b.ignore_eos, b.temperature, b.length_penalty, b.include_stop_str_in_output) == (
        False,
        0.0,
        1.0,
        False,
    )
    assert b.clone() == b


def test_output_kind() -> None:
    from pagedllm.sampling_params import RequestOutputKind

    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY
    assert SamplingParams(output_kind=1, n=2).output_kind is RequestOutputKind.DELTA
    # DELTA streams completions as they grow; beam search and best_of > n pick theirs only at the end.
    for kw in ({"n": 2, "best_of": 3}, {"use_beam_search": True, "best_of": 2, "temperature": 0.0}):
        with pytest.raises(ValueError, match="output_kind DELTA.*beam search and best_of > n.*CUMULATIVE or FINAL_ONLY"):
            SamplingParams(output_kind=RequestOutputKind.DELTA, **kw)
    for bad in (3, "final", True, None):
        with pytest.raises(ValueError, match=r"output_kind must be RequestOutputKind\.CUMULATIVE"):
            SamplingParams(output_kind=bad)
