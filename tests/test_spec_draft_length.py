"""The goodput choice of draft lengths (spec_decode/draft_length.py): the step-cost model and the choice."""
from __future__ import annotations

import pytest

from pagedllm.config import SpeculativeConfig
from pagedllm.spec_decode.draft_length import StepCostModel, choose_draft_lengths


def test_step_cost_model_interpolates_and_extrapolates():
    m = StepCostModel()
    assert m.estimate(3) is None
    m.record(4, 0.010)
    assert m.estimate(1) == m.estimate(20) == 0.010  # one row count seen: flat (optimistic)
    m.record(20, 0.026)
    assert m.estimate(12) == pytest.approx(0.018)  # between 4 and 20
    assert m.estimate(28) == pytest.approx(0.034)  # beyond: the slope of the two largest
    assert m.estimate(2) == 0.010  # below the smallest: the smallest
    m.record(20, 0.036)  # slower: an exponential average per row count
    assert m.estimate(20) == pytest.approx(0.026 + 0.2 * 0.010)
    m.record(20, 0.024)  # faster: at once (a one-off slow step does not stick)
    assert m.estimate(20) == 0.024
    m.record(30, 0.001)  # a faster larger step (noise) never gives a negative slope
    assert m.estimate(40) == pytest.approx(m.estimate(30))


def test_a_slow_first_measurement_of_the_longest_drafts_does_not_stick():
    """One slow first verification step (50 ms for 5 rows, e.g. a first-time allocation) made the goodput
    policy verify one draft token forever on the GPU; the periodic full-length step re-measures 5 rows and
    the faster time replaces the outlier, after which every draft is verified again."""
    from types import SimpleNamespace

    from pagedllm.spec_decode.spec_decoder import _EXPLORE_EVERY, SpecDecoder

    dec = SpecDecoder.__new__(SpecDecoder)
    dec.config = SpeculativeConfig(num_speculative_tokens=4)
    dec.stats = SimpleNamespace(accepted_per_pos=[50, 35, 25, 18], drafted_per_pos=[100, 50, 35, 25])
    dec.step_cost = StepCostModel({1: 0.0018, 2: 0.0023, 5: 0.050})
    dec.draft = None  # the n-gram proposer: drafts cost nothing
    dec._num_choices = 0
    seq = SimpleNamespace(extra={"spec_first": 0.5})
    item = SimpleNamespace(seq=seq, completes=True)
    sched = SimpleNamespace(num_batched_tokens=1, scheduled=[item])
    lengths = [dec._draft_lengths(sched, [(item, 4, [1, 2, 3, 4])])[0] for _ in range(_EXPLORE_EVERY)]
    assert lengths[:-1] == [1] * (_EXPLORE_EVERY - 1) and lengths[-1] == 4
    dec.step_cost.record(5, 0.0025)  # what the exploring step measured
    assert dec._draft_lengths(sched, [(item, 4, [1, 2, 3, 4])]) == [4]


def linear(a: float, b: float):
    return lambda rows: a + b * rows


def test_every_draft_when_rows_are_free_or_the_cost_is_unknown():
    assert choose_draft_lengths(4, 4, [0.1, 0.5, 0.9], [4, 3, 2], linear(0.02, 0.0)) == [4, 3, 2]
    assert choose_draft_lengths(4, 4, [0.1, 0.5, 0.9], [4, 3, 2], lambda rows: None) == [4, 3, 2]


def test_drafts_are_verified_while_expected_tokens_per_second_rise():
    # 10 ms + 2 ms per row: one sequence decoding alone (1 row, 12 ms).
    assert choose_draft_lengths(1, 1, [0.9], [4], linear(10, 2)) == [4]  # 4.10 tokens in 20 ms beats 1 in 12
    assert choose_draft_lengths(1, 1, [0.2], [4], linear(10, 2)) == [1]  # 1.2 in 14 ms; a second draft loses
    assert choose_draft_lengths(1, 1, [0.9], [4], linear(0, 10)) == [0]  # a row costs a whole step: never
    # Several sequences: the likelier tokens first, whoever proposed them.
    assert choose_draft_lengths(4, 4, [0.9, 0.5, 0.0], [4, 4, 4], linear(10, 1)) == [4, 1, 0]


def test_policy_is_validated():
    assert SpeculativeConfig().draft_length_policy == "goodput"
    with pytest.raises(ValueError, match=r"draft_length_policy must be one of \['goodput', 'fixed'\]"):
        SpeculativeConfig(draft_length_policy="greedy")


def test_bursty_acceptance_makes_deep_drafts_worth_verifying():
    # First token accepted half the time; once one is, the next ones almost surely (a copied span).
    cost = linear(10, 2)
    assert choose_draft_lengths(1, 1, [0.5], [4], cost) == [2]  # as independent tokens: 0.5, 0.25, ...
    assert choose_draft_lengths(1, 1, [0.5], [4], cost, depth=[0.95, 0.95, 0.95]) == [4]


def test_a_stale_slow_row_count_below_a_faster_larger_one_does_not_steer_the_choice():
    """Rows 13-15 measured once at a slow moment (25-29 ms) next to 16 rows at 18 ms, as a Zen 4 showed
    (BENCHMARKS.md §74.1): read through the envelope they cost at most what 16 rows cost, so 4 decodes whose drafts
    reach 15 rows (4 + 4 + 3 drafts) verify them all, where the stale times stop them at 12 rows."""
    times = {4: 0.0093, 8: 0.0123, 12: 0.0153, 13: 0.0250, 14: 0.0270, 15: 0.0290, 16: 0.0183}
    m = StepCostModel(dict(times))
    assert [m.estimate(r) for r in (13, 14, 15)] == [0.0183] * 3
    assert m.estimate(12) == 0.0153 and m.estimate(10) == pytest.approx(0.0138)
    assert all(m.estimate(r) <= m.estimate(r + 1) for r in range(1, 24))

    def raw(rows: int) -> float:  # the times as measured, interpolated between row counts
        lo, hi = max(r for r in times if r <= rows), min(r for r in times if r >= rows)
        return times[lo] if lo == hi else times[lo] + (times[hi] - times[lo]) * (rows - lo) / (hi - lo)

    rates, depth = [0.9, 0.9, 0.9], [0.95, 0.95, 0.95]
    assert choose_draft_lengths(4, 4, rates, [4, 4, 3], m.estimate, depth) == [4, 4, 3]
    assert choose_draft_lengths(4, 4, rates, [4, 4, 3], raw, depth) == [3, 3, 2]


def test_a_draft_models_passes_count_once_per_depth():
    """A draft model's pass (`draft_seconds`, in the cost's units) is paid once per draft position for every
    drafting sequence at once: it shortens a lone sequence's drafts, but four sequences share each pass."""
    cost = linear(10, 2)  # one sequence decoding: 12 per step
    assert choose_draft_lengths(1, 1, [0.9], [4], cost, None, 0) == [4]
    assert choose_draft_lengths(1, 1, [0.9], [4], cost, None, 8) == [1]  # 1.9 tokens in 22 beats 2.71 in 32
    assert choose_draft_lengths(1, 1, [0.9], [4], cost, None, 20) == [0]  # a pass costs more than a step
    assert choose_draft_lengths(4, 4, [0.9] * 4, [2] * 4, linear(10, 1), None, 6) == [2, 2, 2, 2]
