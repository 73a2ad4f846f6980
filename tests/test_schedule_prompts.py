"""`Scheduler.schedule_prompts`: admission of waiting prompts while the running sequences advance elsewhere (the
engine's device-side speculation), in the scheduler alone (pure Python)."""
from __future__ import annotations

from tests.test_baselines import _step
from tests.test_priority_scheduling import _group, _scheduler


def test_admits_waiting_prompts_only_up_to_the_seat_limit():
    sched = _scheduler("fcfs", num_blocks=64, budget=64)
    sched.add_seq_group(_group("running", 6, 20, arrival=0.0))
    assert _step(sched) == ["running"]  # its prompt: it decodes from now on
    for i, rid in enumerate(("b", "c", "d")):
        sched.add_seq_group(_group(rid, 10, 5, arrival=1.0 + i))
    out = sched.schedule_prompts(2)
    assert sorted(item.group.request_id for item in out.scheduled) == ["b", "c"]  # not the running decode
    assert all(item.num_new_tokens == 10 and item.completes for item in out.scheduled)
    assert out.num_batched_tokens == 20 and out.num_preempted == 0
    assert [g.request_id for g in sched.waiting] == ["d"]
    assert [g.request_id for g in sched.running] == ["running", "b", "c"]
    sched.block_manager.check_invariants()


def test_respects_the_token_budget_and_max_num_seqs():
    sched = _scheduler("fcfs", num_blocks=64, max_num_seqs=2, budget=16)
    sched.add_seq_group(_group("running", 4, 20, arrival=0.0))
    _step(sched)
    sched.add_seq_group(_group("long", 40, 5, arrival=1.0))
    sched.add_seq_group(_group("next", 4, 5, arrival=2.0))
    out = sched.schedule_prompts(8)  # max_num_seqs 2: one seat left
    [item] = out.scheduled
    assert item.group.request_id == "long" and item.num_new_tokens == 16 and not item.completes  # a chunk
    assert [g.request_id for g in sched.waiting] == ["next"]


def test_admits_nothing_under_request_level_batching():
    sched = _scheduler("fcfs", num_blocks=64)
    sched.config.batching = "request"
    sched.add_seq_group(_group("a", 6, 5, arrival=0.0))
    assert sched.schedule_prompts(4).is_empty() and len(sched.waiting) == 1
