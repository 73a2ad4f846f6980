"""A group that may not sample yet (its grammar still compiles): the scheduler runs its prompt up to, not
including, the last token, keeps it in `running` without blocking the queue, and finishes it normally once
it may sample (scheduler alone, no model)."""
from __future__ import annotations

from pagedllm.core.sequence import SequenceStatus
from tests.test_baselines import _step
from tests.test_priority_scheduling import _group, _scheduler


def test_a_held_group_runs_all_but_its_last_prompt_token_and_waits():
    sched = _scheduler("fcfs", num_blocks=64, budget=8)
    held = _group("held", 21, 3, arrival=0.0)
    held.may_sample = False
    other = _group("other", 5, 4, arrival=1.0)
    sched.add_seq_group(held)
    sched.add_seq_group(other)
    seq = held.seqs[0]
    steps = [_step(sched) for _ in range(8)]
    assert seq.num_computed_tokens == 20 and not seq.output_token_ids  # 8 + 8 + 4 tokens in chunks, no sample
    assert all("held" not in s for s in steps[3:])  # idle since, in `running`, holding its blocks
    assert held in sched.running and other.is_finished()
    held.may_sample = True
    assert _step(sched) == ["held"] and seq.num_computed_tokens == 21 and len(seq.output_token_ids) == 1
    while sched.has_unfinished_seqs():
        _step(sched)
    assert seq.status is SequenceStatus.FINISHED_LENGTH_CAPPED
    assert sched.block_manager.get_num_free_gpu_blocks() == 64


def test_a_held_group_with_nothing_to_run_does_not_block_the_queue():
    """Its prompt's last token is all that is left (a one-token prompt, or a prefix-cache hit on the rest):
    admitted idle, and the requests behind it are admitted and served."""
    sched = _scheduler("fcfs", num_blocks=64)
    held = _group("held", 1, 2, arrival=0.0)
    held.may_sample = False
    sched.add_seq_group(held)
    sched.add_seq_group(_group("behind", 6, 2, arrival=1.0))
    assert _step(sched) == ["behind"]
    assert held in sched.running and held.seqs[0].num_computed_tokens == 0
    held.may_sample = True
    while sched.has_unfinished_seqs():
        _step(sched)
    assert len(held.seqs[0].output_token_ids) == 2


def test_aborting_a_held_group_frees_its_prompt_blocks():
    sched = _scheduler("fcfs", num_blocks=16)
    held = _group("held", 30, 2, arrival=0.0)
    held.may_sample = False
    sched.add_seq_group(held)
    for _ in range(3):
        _step(sched)
    assert held.seqs[0].num_computed_tokens == 29 and sched.block_manager.get_num_free_gpu_blocks() < 16
    sched.abort_seq_group("held")
    assert held.is_finished() and sched.block_manager.get_num_free_gpu_blocks() == 16
