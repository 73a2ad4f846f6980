"""vLLM's --scheduling-policy priority: admission, service and preemption order by (priority, arrival), in the
scheduler (pure Python) and through the engine, the offline LLM and the API's error for a priority under FCFS."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import Sequence, SequenceGroup
from tests.test_baselines import _step

_ids = iter(range(10**6))


def _group(rid: str, prompt_len: int, max_tokens: int, arrival: float, priority: int = 0) -> SequenceGroup:
    seq = Sequence(next(_ids), list(range(1, prompt_len + 1)))
    g = SequenceGroup(rid, [seq], SimpleNamespace(n=1, best_of=1, max_tokens=max_tokens), arrival, priority=priority)
    g.extra["max_tokens"] = max_tokens
    return g


def _scheduler(policy: str, num_blocks: int, max_num_seqs: int = 16, budget: int = 64) -> Scheduler:
    cc = CacheConfig(block_size=4, preemption_mode="recompute")
    cc.num_gpu_blocks, cc.num_cpu_blocks = num_blocks, 0
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=256,
                         watermark=0.0, policy=policy)
    return Scheduler(sc, cc)


def _finish_order(sched: Scheduler) -> list[str]:
    """Model-free steps until every group has finished; the request ids in the order they finished."""
    groups = [*sched.waiting, *sched.running]
    order: list[str] = []
    for _ in range(500):
        if not sched.has_unfinished_seqs():
            return order
        _step(sched)
        order += [g.request_id for g in groups if g.is_finished() and g.request_id not in order]
    raise AssertionError("the scheduler made no progress")


def test_priority_admits_lowest_value_first_ties_by_arrival():
    """One sequence at a time: requests finish in (priority, arrival) order; FCFS keeps arrival order."""
    requests = [("a", 2, 0.0), ("b", 0, 1.0), ("c", 1, 2.0), ("d", 0, 3.0), ("e", -5, 4.0)]
    for policy, expected in (("priority", ["e", "b", "d", "c", "a"]), ("fcfs", ["a", "b", "c", "d", "e"])):
        sched = _scheduler(policy, num_blocks=64, max_num_seqs=1)
        for rid, prio, arrival in requests:
            sched.add_seq_group(_group(rid, 6, 3, arrival, prio if policy == "priority" else 0))
        assert _finish_order(sched) == expected, policy


def test_priority_preempts_the_last_in_its_order_and_requeues_it_in_order():
    """A pool too small for both: the group with the larger priority value is the victim even though it arrived
    first, and it runs again (recomputed) only after the other finished; no block leaks."""
    sched = _scheduler("priority", num_blocks=8)  # 32 slots
    sched.add_seq_group(_group("late-but-urgent", 8, 12, arrival=1.0, priority=0))
    sched.add_seq_group(_group("early-but-low", 8, 12, arrival=0.0, priority=3))
    order = _finish_order(sched)
    assert order == ["late-but-urgent", "early-but-low"]
    assert sched.num_recompute_preemptions >= 1
    assert sched.block_manager.get_num_free_gpu_blocks() == 8

    fcfs = _scheduler("fcfs", num_blocks=8)
    fcfs.add_seq_group(_group("late", 8, 12, arrival=1.0))
    fcfs.add_seq_group(_group("early", 8, 12, arrival=0.0))
    assert _finish_order(fcfs) == ["early", "late"]  # FCFS: the victim is the latest arrival, as before


def test_waiting_groups_with_equal_priority_keep_arrival_order_after_a_preemption():
    sched = _scheduler("priority", num_blocks=64, max_num_seqs=1)
    for i in range(4):
        sched.add_seq_group(_group(f"r{i}", 4, 2, arrival=float(i), priority=1))
    sched.add_seq_group(_group("first", 4, 2, arrival=9.0, priority=0))
    assert [g.request_id for g in sched.waiting] == ["first", "r0", "r1", "r2", "r3"]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(policy="lifo")


@pytest.fixture(scope="module")
def priority_llm():
    from pagedllm import LLM

    return LLM(scheduling_policy="priority", max_num_seqs=1, max_model_len=512, num_gpu_blocks_override=64)


def test_offline_llm_serves_prompts_by_priority_and_outputs_stay_in_input_order(priority_llm):
    from pagedllm import SamplingParams

    prompts = [{"prompt_token_ids": [1, 2, 3, 4 + i]} for i in range(4)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = priority_llm.generate(prompts, params, use_tqdm=False, priority=[3, 0, 2, 1])
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]
    finished_at = [o.metrics["first_token_time"] for o in outs]
    assert sorted(range(4), key=finished_at.__getitem__) == [1, 3, 2, 0]
    queued = priority_llm.llm_engine.scheduler.get_num_unfinished_seq_groups()
    with pytest.raises(ValueError, match="one per prompt"):
        priority_llm.generate(prompts, params, use_tqdm=False, priority=[0])
    with pytest.raises(ValueError, match="priority must be an integer"):
        priority_llm.generate(prompts[:1], params, use_tqdm=False, priority=[0.5])
    assert priority_llm.llm_engine.scheduler.get_num_unfinished_seq_groups() == queued  # nothing half-added


def test_a_priority_under_fcfs_is_refused_with_the_flag_to_use():
    from pagedllm import LLM, SamplingParams

    llm = LLM(max_model_len=256, num_gpu_blocks_override=32)
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False, priority=[1])
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0])
    assert len(out[0].outputs[0].token_ids) == 2


def test_async_front_passes_priority_to_the_engine_loop(priority_llm):
    """The server's path (AsyncLLMEngine → engine loop → LLMEngine.add_request): with one sequence at a time,
    requests queued together start in priority order, and a bad priority is refused before the loop."""
    import asyncio

    from pagedllm import SamplingParams
    from pagedllm.engine.async_engine import AsyncLLMEngine

    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def main():
        engine = AsyncLLMEngine(priority_llm.llm_engine)
        engine.start()
        try:
            with pytest.raises(ValueError, match="priority must be an integer"):
                await engine.add_request("bad", {"prompt_token_ids": [1, 2]}, params, priority="high")
            # holds the one sequence slot for 48 steps, so the others are all queued before any is admitted
            blocker = await engine.add_request("blocker", {"prompt_token_ids": [9, 9]},
                                               SamplingParams(max_tokens=48, ignore_eos=True), priority=0)
            streams = [await engine.add_request(f"p{prio}", {"prompt_token_ids": [5, 6, prio]}, params, priority=prio)
                       for prio in (4, 1, 3, 2)]
            assert len([o async for o in blocker][-1].outputs[0].token_ids) == 48

            async def first_token_time(stream):
                outs = [o async for o in stream]
                return outs[-1].metrics["first_token_time"]

            return await asyncio.gather(*[first_token_time(s) for s in streams])
        finally:
            await engine.shutdown()

    times = asyncio.run(main())
    assert sorted((4, 1, 3, 2), key=lambda p: times[(4, 1, 3, 2).index(p)]) == [1, 2, 3, 4]
