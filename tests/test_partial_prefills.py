"""vLLM's chunked-prefill knobs: long_prefill_token_threshold caps one prompt's chunk per step, and
max_num_partial_prefills / max_long_partial_prefills limit the prompts that prefill in one step so short ones go
ahead of long ones. In the scheduler (pure Python, model-free steps), the config's checks, and through the engine
(greedy outputs unchanged, no block leaked)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import Sequence, SequenceGroup
from tests.test_baselines import _drain, _step

_ids = iter(range(10**6))


def _group(rid: str, prompt_len: int, max_tokens: int = 2) -> SequenceGroup:
    seq = Sequence(next(_ids), list(range(1, prompt_len + 1)))
    g = SequenceGroup(rid, [seq], SimpleNamespace(n=1, best_of=1, max_tokens=max_tokens), float(next(_ids)))
    g.extra["max_tokens"] = max_tokens
    return g


def _scheduler(budget: int = 256, **knobs) -> Scheduler:
    cc = CacheConfig(block_size=4, preemption_mode="recompute")
    cc.num_gpu_blocks, cc.num_cpu_blocks = 512, 0
    sc = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget, max_model_len=1024, watermark=0.0, **knobs)
    return Scheduler(sc, cc)


def _chunks(sched: Scheduler) -> dict[str, int]:
    """One model-free step → request id: tokens it ran."""
    out = sched.schedule()
    ran = {item.group.request_id: item.num_new_tokens for item in out.scheduled}
    completes = [item.seq for item in out.scheduled if item.completes]
    sched.mark_computed(out.scheduled)
    for seq in completes:
        seq.append_token(7, 0.0)
    return ran


def test_long_prefill_token_threshold_caps_each_prompts_chunk():
    """A 200-token prompt runs in chunks of at most 48 tokens though the budget holds it whole, and a prompt
    behind it runs in the same steps; without the cap the first takes 200 tokens at once."""
    sched = _scheduler(long_prefill_token_threshold=48)
    sched.add_seq_group(_group("long", 200))
    sched.add_seq_group(_group("short", 20))
    assert _chunks(sched) == {"long": 48, "short": 20}
    assert [_chunks(sched)["long"] for _ in range(3)] == [48, 48, 48]
    assert _chunks(sched)["long"] == 8  # the last 8 of 200
    plain = _scheduler()
    plain.add_seq_group(_group("long", 200))
    assert _chunks(plain) == {"long": 200}


def test_short_prompts_go_ahead_of_long_ones_within_the_partial_prefill_slots():
    """Two prompts may prefill per step, one of them long: of [long A, long B, short C, short D], the first step
    runs A and C (C passes B, which keeps its place ahead of D); B starts once A's prompt is done."""
    sched = _scheduler(max_num_partial_prefills=2, max_long_partial_prefills=1, long_prefill_token_threshold=32)
    for rid, n in (("A", 100), ("B", 100), ("C", 10), ("D", 10)):
        sched.add_seq_group(_group(rid, n, max_tokens=8))
    assert _chunks(sched) == {"A": 32, "C": 10}
    assert [g.request_id for g in sched.waiting] == ["B", "D"]
    assert _chunks(sched) == {"A": 32, "C": 1, "D": 10}  # C decodes; D takes the second prompt slot
    assert _chunks(sched) == {"A": 32, "C": 1, "D": 1}
    assert _chunks(sched) == {"A": 4, "B": 32, "C": 1, "D": 1}  # A's last 4 are no longer long
    steps = _drain(sched)
    assert steps and all(s for s in steps)
    sched.block_manager.check_invariants()


def test_partial_prefill_slots_bound_the_prompts_of_a_step():
    """Three short prompts with two slots: two run in the first step, the third in the next; every request
    finishes and no block is leaked."""
    sched = _scheduler(max_num_partial_prefills=2)
    for rid in ("a", "b", "c"):
        sched.add_seq_group(_group(rid, 12, max_tokens=3))
    assert _step(sched) == ["a", "b"]
    assert _step(sched) == ["a", "b", "c"]
    _drain(sched)
    assert sched.block_manager.get_num_free_gpu_blocks() == 512


@pytest.mark.parametrize("knobs, message", [
    (dict(max_num_partial_prefills=2, max_long_partial_prefills=3), "max_long_partial_prefills \\(3\\) must be <="),
    (dict(max_num_partial_prefills=0), "max_num_partial_prefills must be a positive integer"),
    (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold must be an integer >= 0"),
    (dict(long_prefill_token_threshold=4096), "long_prefill_token_threshold \\(4096\\) must be <= max_model_len"),
    (dict(max_num_partial_prefills=2, enable_chunked_prefill=False), "need chunked prefill"),
    (dict(long_prefill_token_threshold=64, enable_chunked_prefill=False), "need chunked prefill"),
])
def test_bad_partial_prefill_settings_are_clear_errors(knobs, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(max_num_batched_tokens=2048, max_model_len=1024, **knobs)


def test_threshold_defaults_to_four_percent_of_max_model_len_with_partial_prefills():
    assert SchedulerConfig(max_model_len=1024, max_num_partial_prefills=2).long_prefill_token_threshold == 40
    assert SchedulerConfig(max_model_len=1024).long_prefill_token_threshold == 0


def test_engine_outputs_are_unchanged_under_partial_prefill_limits():
    """The bundled model, greedy, prompts of mixed lengths: capped, concurrency-limited prefills give the default
    engine's tokens, and every block comes back."""
    prompts = ["The capital of France is " * n for n in (1, 30, 2, 25, 3)]
    params = SamplingParams(temperature=0, max_tokens=12)
    kw = dict(num_gpu_blocks_override=256, max_model_len=512, max_num_batched_tokens=512)
    plain = LLM(**kw)
    plain_steps = _record_prompt_chunks(plain)
    want = plain.generate(prompts, params, use_tqdm=False)
    llm = LLM(**kw, long_prefill_token_threshold=24, max_num_partial_prefills=2, max_long_partial_prefills=1)
    steps = _record_prompt_chunks(llm)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    # The limits were in force: chunks of at most 24 tokens, at most two prompts a step (the default ran them whole).
    assert max(max(s, default=0) for s in plain_steps) > 100
    assert max(max(s, default=0) for s in steps) == 24 and max(len(s) for s in steps) == 2
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def _record_prompt_chunks(llm: LLM) -> list[list[int]]:
    """Each step's prompt chunk sizes (chunks of more than one token) as the engine's scheduler returns them."""
    scheduler = llm.llm_engine.scheduler
    schedule, steps = scheduler.schedule, []

    def recording():
        out = schedule()
        steps.append([item.num_new_tokens for item in out.scheduled if item.num_new_tokens > 1])
        return out

    scheduler.schedule = recording
    return steps

