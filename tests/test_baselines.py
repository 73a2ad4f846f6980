"""Orca baselines in the engine (pure Python): reservation rules, contiguous regions, admission,
request-level batching, no leaks, and the Fig. 2 KV memory accounting on hand-made traces."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.baselines import ContiguousBlockManager, reservation_tokens
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.interfaces import AllocStatus
from pagedllm.core.kv_accounting import kv_memory_breakdown
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus

_ids = iter(range(10**6))


def _group(rid: str, prompt_len: int, max_tokens: int, arrival: float = 0.0, n: int = 1) -> SequenceGroup:
    seq = Sequence(next(_ids), list(range(1, prompt_len + 1)))
    g = SequenceGroup(rid, [seq], SimpleNamespace(n=n, best_of=n, max_tokens=max_tokens), arrival)
    g.extra["max_tokens"] = max_tokens
    return g


def _scheduler(manager: str, num_blocks: int, *, block_size: int = 4, batching: str = "iteration",
               max_num_seqs: int = 16, max_model_len: int = 256, budget: int = 64) -> Scheduler:
    cc = CacheConfig(block_size=block_size, kv_cache_manager=manager, preemption_mode="recompute")
    cc.num_gpu_blocks, cc.num_cpu_blocks = num_blocks, 0
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                         watermark=0.0, batching=batching)
    return Scheduler(sc, cc)


def _step(sched: Scheduler) -> list[str]:
    """One engine step without a model: computed chunks advance, completing ones sample a token, and a
    sequence finishes at its max_tokens. Returns the request ids scheduled this step."""
    out = sched.schedule()
    assert not out.ignored_groups
    completes = [(item.group, item.seq) for item in out.scheduled if item.completes]
    sched.mark_computed(out.scheduled)
    for group, seq in completes:
        seq.append_token(7, 0.0)
        if len(seq.output_token_ids) >= group.extra["max_tokens"]:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
            sched.free_seq(seq)
    sched.free_finished_seq_groups()
    sched.block_manager.check_invariants()
    return sorted({item.group.request_id for item in out.scheduled})


def _drain(sched: Scheduler, max_steps: int = 500) -> list[list[str]]:
    steps = []
    while sched.has_unfinished_seqs():
        steps.append(_step(sched))
        assert len(steps) < max_steps, "the scheduler made no progress"
    return steps


# -- reservation rules -----------------------------------------------------------------------
def test_reservation_rules_of_the_three_orca_variants():
    assert reservation_tokens("orca-oracle", 10, 25, 2048) == 35
    assert reservation_tokens("orca-pow2", 10, 25, 2048) == 10 + 32  # true 25 -> 32
    assert reservation_tokens("orca-pow2", 10, 32, 2048) == 42 and reservation_tokens("orca-pow2", 10, 33, 2048) == 74
    assert reservation_tokens("orca-max", 10, 25, 2048) == 2048  # the paper's maximum length
    assert reservation_tokens("orca-pow2", 1000, 1500, 2048) == 2048  # capped at max_model_len
    with pytest.raises(ValueError, match="orca-oracle"):
        reservation_tokens("orca-min", 10, 25, 2048)
    bm = ContiguousBlockManager(block_size=16, num_gpu_blocks=300, policy="orca-max", max_model_len=2048)
    assert bm.reservation_for(_group("a", 10, 25)) == (2048, 128, 128)
    bm = ContiguousBlockManager(block_size=16, num_gpu_blocks=300, policy="orca-pow2", max_model_len=2048)
    assert bm.reservation_for(_group("a", 10, 25)) == (42, 3, 4)  # 3 blocks asked, buddy region of 4


def test_orca_max_needs_a_pool_that_holds_one_max_length_region():
    with pytest.raises(ValueError, match="max_model_len=2048"):
        ContiguousBlockManager(block_size=16, num_gpu_blocks=100, policy="orca-max", max_model_len=2048)
    with pytest.raises(ValueError, match="one of"):
        CacheConfig(kv_cache_manager="orca")
    with pytest.raises(ValueError, match="enable_prefix_caching needs kv_cache_manager='paged'"):
        CacheConfig(kv_cache_manager="orca-oracle", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="preemption_mode='swap' needs kv_cache_manager='paged'"):
        CacheConfig(kv_cache_manager="orca-pow2", preemption_mode="swap")
    with pytest.raises(ValueError, match="iteration"):
        SchedulerConfig(batching="continuous")


# -- admission and regions -----------------------------------------------------------------
def test_admitted_only_when_the_whole_region_fits_and_tables_are_runs():
    bm = ContiguousBlockManager(block_size=4, num_gpu_blocks=16, policy="orca-oracle", max_model_len=256)
    a, b, c = _group("a", 8, 12), _group("b", 8, 12), _group("c", 8, 12)  # 20 tokens: 5 blocks -> region 8
    for g in (a, b):
        assert bm.can_admit(g, 0) is AllocStatus.OK
        bm.admit(g)
    assert bm.get_num_free_gpu_blocks() == 0
    assert bm.can_admit(c, 0) is AllocStatus.LATER  # 0 free: waits, although its prompt is only 2 blocks
    seq = a.seqs[0]
    for n in (8, 1, 1, 1, 1):  # prompt then decode steps grow the table inside the region
        bm.allocate_slots(seq, n)
        seq.num_computed_tokens += n
        start = bm.region_of(seq)
        assert bm.get_block_table(seq) == list(range(start, start + -(-seq.num_computed_tokens // 4)))
    with pytest.raises(RuntimeError, match="reserved 5"):
        bm.allocate_slots(seq, 9)  # beyond its reservation: the manager never grows a region
    bm.check_invariants()
    big = _group("big", 40, 40)  # 20 blocks: region 32 > pool
    assert bm.can_admit(big, 0) is AllocStatus.NEVER
    with pytest.raises(ValueError, match="orca-oracle.*80 tokens.*32 blocks.*16 blocks"):
        bm.check_admissible(big)
    bm.free(seq)
    assert bm.can_admit(c, 0) is AllocStatus.OK
    bm.free(b.seqs[0])
    assert bm.get_num_free_gpu_blocks() == 16 and bm.allocator.free_regions() == [(0, 16)]


def test_parallel_sampling_reserves_a_region_per_sequence_and_fork_copies_the_prompt():
    bm = ContiguousBlockManager(block_size=4, num_gpu_blocks=32, policy="orca-oracle", max_model_len=256)
    g = _group("p", 8, 4, n=3)  # 12 tokens: 3 blocks, region 4, three of them
    bm.admit(g)
    assert bm.get_num_free_gpu_blocks() == 32 - 12
    parent = g.seqs[0]
    bm.allocate_slots(parent, 8)
    parent.num_computed_tokens = 8
    child = parent.fork(next(_ids))
    g.seqs.append(child)
    bm.fork(parent, child)
    copies = bm.allocate_slots(child, 1)
    src, dst = bm.get_block_table(parent), bm.get_block_table(child)
    assert copies == [(src[0], dst[0]), (src[1], dst[1])] and not set(src) & set(dst)
    bm.check_invariants()
    for s in (parent, child):
        bm.free(s)
    assert bm.get_num_free_gpu_blocks() == 32 and not bm.groups


# -- whole traces through the scheduler: no leak, no preemption --------------------------
@pytest.mark.parametrize("manager", ["orca-oracle", "orca-pow2", "orca-max"])
def test_orca_trace_runs_to_completion_without_leaks_or_preemption(manager):
    sched = _scheduler(manager, 64, max_model_len=64)
    groups = [_group(f"r{i}", 3 + 5 * i % 17, 2 + 7 * i % 13, arrival=i) for i in range(12)]
    for g in groups:
        sched.block_manager.check_admissible(g)
        sched.add_seq_group(g)
    _step(sched)
    assert sched.block_manager.region_of(groups[0].seqs[0]) is not None
    free_before = sched.block_manager.get_num_free_gpu_blocks()
    sched.abort_seq_group("r0")  # an abort mid-trace gives its reservation back too
    assert sched.block_manager.get_num_free_gpu_blocks() > free_before
    _drain(sched)
    assert sched.num_preemptions == 0
    assert [len(g.seqs[0].output_token_ids) for g in groups[1:]] == [g.extra["max_tokens"] for g in groups[1:]]
    bm = sched.block_manager
    assert bm.get_num_free_gpu_blocks() == 64 and not bm.groups and not bm.block_tables


def test_orca_admits_fewer_requests_than_paged_on_the_same_pool():
    """Orca-Max holds 16 blocks per request (64 tokens): 4 fit in 64 blocks; paged runs all 8."""
    peak = {}
    for manager in ("paged", "orca-max"):
        sched = _scheduler(manager, 64, max_model_len=64)
        for i in range(8):
            sched.add_seq_group(_group(f"r{i}", 6, 6, arrival=i))
        peak[manager] = max(len(s) for s in _drain(sched))
        assert sched.block_manager.get_num_free_gpu_blocks() == 64
    assert peak == {"paged": 8, "orca-max": 4}


# -- request-level batching ---------------------------------------------------------------
def test_request_level_batching_runs_a_batch_to_the_end_before_others_join():
    sched = _scheduler("paged", 64, batching="request", max_num_seqs=2)
    for rid, max_tokens in (("a", 2), ("b", 6), ("c", 1), ("d", 3)):
        sched.add_seq_group(_group(rid, 5, max_tokens, arrival=ord(rid)))
    steps = _drain(sched)
    first = [s for s in steps if "a" in s or "b" in s]
    assert steps[0] == ["a", "b"]  # the two earliest arrivals form the batch
    assert all(set(s) <= {"a", "b"} for s in first)  # c waits while b runs alone after a finished
    assert ["b"] in steps
    rest = steps[len(first):]
    assert rest[0] == ["c", "d"] and all(set(s) <= {"c", "d"} for s in rest)
    assert sched.block_manager.get_num_free_gpu_blocks() == 64

    it = _scheduler("paged", 64, batching="iteration", max_num_seqs=2)
    for rid, max_tokens in (("a", 2), ("b", 6), ("c", 1), ("d", 3)):
        it.add_seq_group(_group(rid, 5, max_tokens, arrival=ord(rid)))
    assert ["b", "c"] in _drain(it)  # iteration-level: c joins as soon as a leaves


def test_request_level_batching_with_preemption_keeps_the_batch_and_leaks_nothing():
    """5 blocks of 4 tokens: a and b (2 blocks each) form the batch, c does not fit; a and b grow to
    5 blocks each, so one is preempted (recompute) and comes back; c never joins before both are done."""
    sched = _scheduler("paged", 5, batching="request", max_num_seqs=4)
    for rid in ("a", "b", "c"):
        sched.add_seq_group(_group(rid, 8, 12, arrival=ord(rid)))
    steps = _drain(sched)
    assert sched.num_preemptions > 0
    last_ab = max(i for i, s in enumerate(steps) if "a" in s or "b" in s)
    assert all("c" not in s for s in steps[: last_ab + 1]) and "c" in steps[last_ab + 1]
    assert steps[0] == ["a", "b"] and sched.block_manager.get_num_free_gpu_blocks() == 5


def test_request_level_batching_with_orca_max_is_fastertransformer_style():
    sched = _scheduler("orca-max", 64, batching="request", max_num_seqs=8, max_model_len=64)
    for i in range(6):
        sched.add_seq_group(_group(f"r{i}", 4, 1 + i, arrival=i))
    steps = _drain(sched)
    assert steps[0] == ["r0", "r1", "r2", "r3"]  # four 16-block reservations fill the pool
    assert all(set(s) <= {"r0", "r1", "r2", "r3"} for s in steps[:4]) and steps[4] == ["r4", "r5"]
    assert sched.block_manager.get_num_free_gpu_blocks() == 64


# -- the Fig. 2 accounting ----------------------------------------------------------------
def test_fig2_breakdown_on_hand_made_states():
    # orca-pow2: prompt 10, true output 25 -> reserves 10 + 32 = 42 tokens = 11 blocks, buddy region 16.
    bm = ContiguousBlockManager(block_size=4, num_gpu_blocks=64, policy="orca-pow2", max_model_len=256)
    g = _group("a", 10, 25)
    bm.admit(g)
    bm.allocate_slots(g.seqs[0], 10)
    g.seqs[0].num_computed_tokens = 10
    b = kv_memory_breakdown(bm, [g])
    assert (b.token_states, b.reservation, b.internal_fragmentation, b.external_fragmentation, b.free) == (
        10, 35 - 10, 44 - 35, (16 - 11) * 4, (64 - 16) * 4)
    assert b.total == 256 and sum(b.fractions().values()) == pytest.approx(1.0)

    # paged, same request: 3 blocks now, 2 slots of the last one will be filled later.
    pbm = BlockManager(block_size=4, num_gpu_blocks=64, num_cpu_blocks=0)
    p = _group("a", 10, 25)
    pbm.allocate_slots(p.seqs[0], 10)
    p.seqs[0].num_computed_tokens = 10
    b = kv_memory_breakdown(pbm, [p])
    assert (b.token_states, b.reservation, b.internal_fragmentation, b.external_fragmentation, b.free) == (
        10, 2, 0, 0, 61 * 4)

    # External fragmentation: 8 free blocks in holes of 2, the head-of-line request needs a run of 4.
    bm = ContiguousBlockManager(block_size=4, num_gpu_blocks=16, policy="orca-oracle", max_model_len=256)
    small = [_group(f"s{i}", 4, 4) for i in range(8)]  # 8 tokens = 2 blocks each
    for s in small:
        bm.admit(s)
    for s in small[::2]:
        bm.free(s.seqs[0])
    head = _group("h", 8, 8)  # 16 tokens = 4 blocks
    assert bm.can_admit(head, 0) is AllocStatus.LATER and bm.get_num_free_gpu_blocks() == 8
    b = kv_memory_breakdown(bm, [], head_of_line=head)
    assert (b.token_states, b.reservation, b.external_fragmentation, b.free) == (0, 4 * 8, 8 * 4, 0)
    assert sum(b.fractions().values()) == pytest.approx(1.0)


@pytest.mark.parametrize("manager", ["paged", "orca-oracle", "orca-pow2", "orca-max"])
def test_fig2_parts_sum_to_the_pool_at_every_step_of_a_trace(manager):
    sched = _scheduler(manager, 64, max_model_len=64)
    for i in range(10):
        sched.add_seq_group(_group(f"r{i}", 2 + 7 * i % 19, 1 + 5 * i % 11, arrival=i))
    seen = 0.0
    while sched.has_unfinished_seqs():
        b = kv_memory_breakdown(sched.block_manager, sched.running, max_model_len=64,
                                head_of_line=sched.waiting[0] if sched.waiting else None)
        parts = (b.token_states, b.reservation, b.internal_fragmentation, b.external_fragmentation, b.free)
        assert min(parts) >= 0 and sum(parts) == b.total == 64 * 4
        assert b.token_states == sum(s.num_computed_tokens for g in sched.running for s in g.unfinished_seqs())
        if manager == "paged":
            # Paged wastes at most the tail of each sequence's last block and has no external fragmentation.
            assert b.external_fragmentation == 0 and b.internal_fragmentation <= 3 * len(sched.running)
        seen += b.token_states
        _step(sched)
    assert seen > 0


def test_core_stays_free_of_torch():
    code = ("import sys, pagedllm.core.scheduler, pagedllm.core.baselines, pagedllm.core.buddy, "
            "pagedllm.core.kv_accounting; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cli_flags_document_and_check_the_choices(capsys):
    import argparse

    from pagedllm.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    text = " ".join(parser.format_help().split())
    assert "--kv-cache-manager {paged,orca-oracle,orca-pow2,orca-max}" in text
    assert "--batching {iteration,request}" in text and "ignore_eos" in text
    args = EngineArgs.from_cli_args(parser.parse_args(["--kv-cache-manager", "orca-max", "--batching", "request"]))
    config = args.create_engine_config(2048)
    assert config.cache_config.kv_cache_manager == "orca-max" and config.scheduler_config.batching == "request"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-manager", "orca"])
    assert "invalid choice" in capsys.readouterr().err
