"""The bitmask fill's thread count follows the measured cost per row (serial for cheap masks)."""
from __future__ import annotations

import sys

import pytest

from pagedllm.structured_output.fill_policy import FillThreadPolicy


def test_policy_measures_each_choice_then_keeps_the_cheaper_and_re_explores():
    policy = FillThreadPolicy((1, 8), explore_every=10)
    first, second = policy.pick(), policy.pick()
    assert (first, second) == (1, 1)  # nothing recorded yet: measure the first choice
    policy.record(1, 64 * 20e-6, 64)  # 20 µs per row serially
    assert policy.pick() == 8  # then the other one
    policy.record(8, 64 * 5e-6, 64)  # 5 µs per row on threads: an expensive grammar
    picks = [policy.pick() for _ in range(30)]
    assert picks.count(8) >= 27 and 1 in picks  # the cheaper one, with a periodic re-measurement of serial
    for _ in range(20):  # the grammars got cheap: serial now costs 1.5 µs per row
        policy.record(1, 64 * 1.5e-6, 64)
    assert policy.cost_per_row[1] < policy.cost_per_row[8]
    assert [policy.pick() for _ in range(9)].count(1) >= 8


def test_single_choice_and_empty_fills():
    policy = FillThreadPolicy((1,))
    policy.record(1, 0.5, 0)  # no rows: ignored
    assert policy.cost_per_row == {} and all(policy.pick() == 1 for _ in range(200))


def test_cheap_fills_run_inline_and_expensive_ones_on_the_mask_thread():
    import threading
    from types import SimpleNamespace

    from pagedllm.structured_output.manager import (
        FILL_SWITCH_INTERVAL_S,
        MIN_OVERLAPPED_FILL_S,
        SeqGrammar,
        StructuredOutputManager,
    )

    class CountingBackend:  # records the thread each native fill ran on
        def __init__(self) -> None:
            self.fill_policy = FillThreadPolicy((1,))
            self.threads: list[str] = []

        def fill_bitmask(self, matchers, bitmask, rows) -> None:
            self.threads.append(threading.current_thread().name)
            bitmask[rows] = 7

    mgr = StructuredOutputManager("xgrammar", None, 64, (0,), num_threads=1)
    mgr._backend = backend = CountingBackend()
    seqs = [SimpleNamespace(extra={"grammar": SeqGrammar(object())}, output_token_ids=[], seq_id=i,
                            is_finished=lambda: False) for i in range(4)]
    pairs = [(s, None) for s in seqs]
    seqs[2].extra["grammar"].terminated = True  # its grammar ended: the row allows everything, no fill
    mask = mgr.start_fill(pairs, overlap=True).result()  # no cost measured yet: inline
    assert mask[:, 0].tolist() == [7, 7, -1, 7] and backend.threads == [threading.current_thread().name]
    backend.fill_policy.cost_per_row[1] = 2 * MIN_OVERLAPPED_FILL_S  # an expensive grammar: overlap the step
    before = sys.getswitchinterval()
    job = mgr.start_fill(pairs, overlap=True)
    # While the mask thread works, the GIL changes hands quickly; reading the result restores the interpreter's.
    assert sys.getswitchinterval() == pytest.approx(FILL_SWITCH_INTERVAL_S)
    mgr.mask_result(job)
    assert sys.getswitchinterval() == before
    assert backend.threads[-1].startswith("pagedllm-grammar-mask")
    mgr.start_fill(pairs, overlap=False).result()  # the caller asked for inline (e.g. on a CPU device)
    assert backend.threads[-1] == threading.current_thread().name
    mgr.shutdown()
