"""Speculation vs plain asynchronous steps, chosen by measured tokens per second (spec_decode/mode.py)."""
from __future__ import annotations

import pytest

from pagedllm.spec_decode.mode import SpecModeChooser


def _window(m: SpecModeChooser, speculated: bool, tokens_per_step: int, seconds_per_step: float) -> None:
    for _ in range(m.window):
        m.record(speculated, tokens_per_step, seconds_per_step)


def test_measures_both_modes_then_runs_the_faster_and_looks_back_now_and_then():
    m = SpecModeChooser(window=4, explore_every=3)
    assert m.speculate()  # speculation first
    _window(m, True, 3, 0.003)  # 1000 tok/s
    assert not m.speculate()  # the plain mode was never measured: measure it
    _window(m, False, 1, 0.0005)  # 2000 tok/s: faster
    assert not m.speculate() and m.rates == {True: 1000.0, False: 2000.0}
    _window(m, False, 1, 0.0005)
    assert not m.speculate()
    _window(m, False, 1, 0.0005)  # the leader for explore_every windows: one window of the other
    assert m.speculate()
    _window(m, True, 6, 0.003)  # 2000 → EMA 1500: still slower, so the next look comes after 2 × 3 windows
    assert not m.speculate() and m.rates[True] == pytest.approx(1500.0)
    for _ in range(5):
        _window(m, False, 1, 0.0005)
        assert not m.speculate()
    _window(m, False, 1, 0.0005)
    assert m.speculate()
    _window(m, True, 12, 0.003)  # 4000 → EMA 2750: faster now, so it stays (and looks start over)
    assert m.speculate()
    _window(m, True, 12, 0.003)
    assert m.speculate()


def test_looks_at_a_mode_that_keeps_losing_get_rarer_up_to_a_cap():
    m = SpecModeChooser(window=1, explore_every=2, max_explore_every=8)
    m.record(True, 0, 0.001)  # speculation that proposes nothing: 0 tok/s
    gaps, since = [], 0
    for _ in range(60):
        if m.speculate():
            gaps.append(since)
            since = 0
            m.record(True, 0, 0.001)
        else:
            since += 1
            m.record(False, 1, 0.001)
    assert gaps[:5] == [2, 4, 8, 8, 8] and set(gaps[5:]) == {8}


def test_steps_of_the_other_mode_are_not_counted():
    m = SpecModeChooser(window=2)
    m.record(False, 100, 0.001)  # a plain step while speculation is the mode (e.g. the switch's first)
    assert m.rates == {} and m.speculate()
    m.record(True, 2, 0.001)
    m.record(True, 2, 0.001)
    assert m.rates == {True: 2000.0}


def test_async_engine_with_speculation_measures_both_modes_and_keeps_greedy_outputs(tokenizer, monkeypatch):
    """CPU engine with asynchronous scheduling forced on and two-step windows: speculation and plain
    asynchronous steps both run (both rates measured) and greedy outputs equal the engine without speculation."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.spec_decode import spec_decoder

    monkeypatch.setattr(spec_decoder, "SpecModeChooser", lambda: SpecModeChooser(window=2, explore_every=1))
    prompts = [tokenizer.encode(t) for t in (
        "Copy the list exactly: apples, pears, plums, figs, dates, limes, kiwis. Copy: apples, pears,",
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n")]
    params = SamplingParams(temperature=0, max_tokens=24)
    kw = dict(max_model_len=256, dtype="float32", num_gpu_blocks_override=64, async_scheduling=True)
    ref = [o.outputs[0].token_ids for o in LLM(**kw).generate([{"prompt_token_ids": p} for p in prompts], params,
                                                               use_tqdm=False)]
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}, **kw)
    outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    assert outs == ref
    dec = llm.llm_engine.spec_decoder
    assert set(dec.mode.rates) == {True, False}
    st = llm.llm_engine.stats()
    assert st["spec_decode_num_draft_tokens"] > 0 and "spec_decode_num_steps_off_by_rate" in st
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_gpu_blocks


def test_worth_syncing_only_for_a_sequence_whose_host_tokens_already_match():
    """With asynchronous steps, speculation mode waits for the step in flight only when an n-gram draft is
    likely: a running sequence that may speculate matches earlier text in the tokens the host already has."""
    from types import SimpleNamespace

    from pagedllm.config import SpeculativeConfig
    from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
    from pagedllm.spec_decode.spec_decoder import SpecDecoder

    from pagedllm import SamplingParams

    def group(prompt: list[int], output: list[int], **extra) -> SequenceGroup:
        seq = Sequence(0, prompt, list(output), status=SequenceStatus.RUNNING)
        return SequenceGroup("r", [seq], SamplingParams(), 0.0, extra=dict(extra))

    running: list[SequenceGroup] = []
    dec = SpecDecoder(SpeculativeConfig(prompt_lookup_min=2), SimpleNamespace(running=running), None, 1024,
                      async_steps=True)
    assert not dec.worth_syncing()  # nothing running
    running.append(group([1, 2, 3, 4, 5, 6], [7, 8]))  # no bigram recurs
    assert not dec.worth_syncing()
    copying = group([1, 2, 3, 4, 5, 6], [9, 3, 4])  # "3 4" recurs: a draft (5, 6, ...) is on offer
    running.append(copying)
    assert dec.worth_syncing()
    copying.seqs[0].extra["spec_resume_at"] = 5  # low acceptance: cooling down until 5 output tokens
    assert not dec.worth_syncing()
    copying.seqs[0].output_token_ids += [5, 6]
    assert dec.worth_syncing()
    copying.sampling_params = SamplingParams(logit_bias={5: -100.0})  # nor do those with logit adjustments
    assert not dec.worth_syncing()
    copying.sampling_params = SamplingParams()
    assert dec.worth_syncing()
    copying.extra["structured_output"] = object()  # constrained sequences never speculate
    assert not dec.worth_syncing()


@pytest.mark.parametrize("async_steps,policy,cools_down", [(False, "goodput", False), (False, "fixed", True),
                                                           (True, "goodput", True)])
def test_the_acceptance_cooldown_holds_where_speculating_costs_more_than_its_rows(async_steps, policy, cools_down):
    """A synchronous engine's goodput rule already weighs a sequence's acceptance every step, so there a
    cooled-down sequence may still speculate; asynchronous engines and the fixed policy keep the cooldown."""
    from types import SimpleNamespace

    from pagedllm.config import SpeculativeConfig
    from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
    from pagedllm.spec_decode.spec_decoder import SpecDecoder

    from pagedllm import SamplingParams

    seq = Sequence(0, [1, 2, 3], [4], status=SequenceStatus.RUNNING)
    group = SequenceGroup("r", [seq], SamplingParams(), 0.0, extra={})
    dec = SpecDecoder(SpeculativeConfig(draft_length_policy=policy), SimpleNamespace(running=[group]), None, 1024,
                      async_steps=async_steps)
    assert dec._may_speculate(seq, group)
    seq.extra["spec_resume_at"] = 10  # low acceptance: cooling down until 10 output tokens
    assert dec._may_speculate(seq, group) is not cools_down
    group.extra["beam"] = object()  # beam search never speculates, cooldown or not
    assert not dec._may_speculate(seq, group)
