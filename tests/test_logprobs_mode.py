"""vLLM's logprobs_mode on the bundled model: raw_logprobs (the default), raw_logits, processed_logprobs and
processed_logits, checked against the raw log-probs of an engine in the default mode (the processed distribution
at temperature T under top-k is log_softmax(raw / T) over the top k: computable from the raw top-k log-probs)."""
from __future__ import annotations

import math

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs

KW = dict(max_model_len=256, num_gpu_blocks_override=64)
PROMPT = "The three primary colors are"
T, K = 0.5, 5


def _first_position(mode: str, prompt_logprobs: int | None = None):
    llm = LLM(logprobs_mode=mode, **KW)
    params = SamplingParams(temperature=T, top_k=K, seed=3, max_tokens=3, logprobs=K,
                            prompt_logprobs=prompt_logprobs)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    return out, out.outputs[0].logprobs[0], out.outputs[0].token_ids[0]


@pytest.fixture(scope="module")
def raw():
    return _first_position("raw_logprobs", prompt_logprobs=2)


def _top(d: dict) -> dict[int, float]:
    return {t: lp.logprob for t, lp in d.items() if lp.rank is not None and lp.rank <= K}


def test_processed_logprobs_are_the_sampled_distribution(raw):
    _, raw_first, _ = raw
    raw_top = _top(raw_first)
    norm = math.log(sum(math.exp(v / T) for v in raw_top.values()))
    _, first, token = _first_position("processed_logprobs")
    assert token in raw_top
    want = {t: v / T - norm for t, v in raw_top.items()}
    got = _top(first)
    assert got.keys() == want.keys()
    assert all(abs(got[t] - want[t]) < 2e-3 for t in want)
    assert abs(first[token].logprob - want[token]) < 2e-3
    assert abs(sum(math.exp(v) for v in got.values()) - 1.0) < 1e-3  # the top k carry all of it


def test_logits_modes_report_logits(raw):
    _, raw_first, _ = raw
    raw_top = _top(raw_first)
    for mode, scale in (("raw_logits", 1.0), ("processed_logits", 1.0 / T)):
        _, first, _ = _first_position(mode)
        got = _top(first)
        assert got.keys() == raw_top.keys()
        # logit = (log-prob + the row's logsumexp), divided by T once processed: one shift for every token,
        # and not zero (these are logits, not log-probs)
        shifts = [got[t] - scale * raw_top[t] for t in raw_top]
        assert max(shifts) - min(shifts) < 2e-3
        assert abs(shifts[0]) > 0.1


def test_prompt_logprobs_follow_the_mode(raw):
    raw_out = raw[0]
    out, _, _ = _first_position("raw_logits", prompt_logprobs=2)
    for a, b in zip(raw_out.prompt_logprobs[1:], out.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        shift = {t: b[t].logprob - a[t].logprob for t in a}
        assert max(shift.values()) - min(shift.values()) < 2e-3  # logits = log-probs + the position's logsumexp
        assert all(a[t].rank == b[t].rank for t in a)


def test_configuration():
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        EngineArgs(logprobs_mode="softmax").create_engine_config(256)
    with pytest.raises(ValueError, match="not supported with speculative decoding"):
        EngineArgs(logprobs_mode="processed_logprobs",
                   speculative_config={"method": "ngram"}).create_engine_config(256)
    import argparse

    args = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(["--logprobs-mode", "processed_logits"])
    assert EngineArgs.from_cli_args(args).create_engine_config(256).model_config.logprobs_mode == "processed_logits"
