"""Prefix caching's recurrent-state snapshots in the block manager (core/state_snapshots.py; pure Python).

The engine-level behaviour (a prefix hit resumes from the snapshot and keeps transformers' tokens) is in
test_mamba_engine.py; here: which points a step plans, that a planned snapshot is invisible until its step has run,
least-recently-used eviction, what freeing a sequence gives back, and the state copy a hit queues.
"""
from __future__ import annotations

import pytest

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.sequence import Sequence


def _manager(num_snapshots: int = 2, interval: int = 8) -> BlockManager:
    return BlockManager(block_size=4, num_gpu_blocks=64, enable_caching=True, num_state_slots=3,
                        num_state_snapshots=num_snapshots, state_snapshot_interval=interval)


def _step(bm: BlockManager, seq: Sequence, n: int) -> list[tuple[int, int]]:
    """Schedule `n` tokens of `seq` (the snapshots the step must write), then mark them computed."""
    bm.allocate_slots(seq, n)
    planned = bm.plan_state_snapshots(seq, n, n)
    seq.num_computed_tokens += n
    bm.cache_computed_blocks(seq)
    return planned


def test_points_crossed_by_each_step_and_published_after_it() -> None:
    bm = _manager(num_snapshots=4)
    seq = Sequence(0, list(range(30)))
    assert _step(bm, seq, 7) == []  # no point reached
    assert _step(bm, seq, 12) == [(1, 3), (9, 4)]  # 8 and 16: offsets in the step's chunk, slots after the 3 seqs'
    assert _step(bm, seq, 5) == [(0 + 5, 5)]  # 24 ends this chunk (the worker copies the slot's end state)
    other = Sequence(1, list(range(17)) + [99] * 8)
    assert bm.allocate_cached_prefix(other) == 16  # cached through block 3; the snapshot at 16 holds the state
    bm.allocate_slots(other, other.get_len() - 16)
    assert bm.take_state_copies() == [(4, bm.state_slot(other))]
    assert bm.snapshots.stats.num_hits == 1
    bm.check_invariants()


def test_a_planned_snapshot_is_not_a_hit_until_its_step_has_run() -> None:
    bm = _manager()
    seq = Sequence(0, list(range(12)))
    bm.allocate_slots(seq, 12)
    assert bm.plan_state_snapshots(seq, 12, 12) == [(8, 3)]
    # the blocks are not computed yet either; once they are, the snapshot is published with them
    seq.num_computed_tokens = 12
    bm.cache_computed_blocks(seq)
    other = Sequence(1, list(range(12)) + [7])
    assert bm.allocate_cached_prefix(other) == 8
    bm.free(other)
    bm.free(seq)
    bm.check_invariants()


def test_tokens_still_on_the_device_are_not_hashed() -> None:
    bm = _manager()
    seq = Sequence(0, list(range(7)))
    bm.allocate_slots(seq, 7)
    seq.num_computed_tokens = 7
    assert bm.plan_state_snapshots(seq, 1, 0) == []  # the step's one token (position 7) is unknown on the host
    assert bm.plan_state_snapshots(seq, 1, 1) == [(1, 3)]


def test_least_recently_used_snapshot_is_overwritten() -> None:
    bm = _manager(num_snapshots=2)
    seqs = [Sequence(i, [i] * 9) for i in range(3)]
    for seq in seqs[:2]:
        assert len(_step(bm, seq, 9)) == 1
        bm.free(seq)
    probe = Sequence(10, [0] * 9)  # the first sequence's prefix: its snapshot becomes the most recently used
    assert bm.allocate_cached_prefix(probe) == 8
    bm.free(probe)
    assert _step(bm, seqs[2], 9) == [(8, 4)]  # the second's slot (least recently used) is overwritten
    assert bm.snapshots.stats.num_evicted == 1
    bm.free(seqs[2])
    assert bm.allocate_cached_prefix(Sequence(11, [1] * 9)) == 0  # its KV blocks are cached, its state is gone
    bm.check_invariants()


def test_freeing_a_sequence_gives_back_its_unwritten_snapshots() -> None:
    bm = _manager(num_snapshots=2)
    seq = Sequence(0, list(range(20)))
    bm.allocate_slots(seq, 20)
    assert len(bm.plan_state_snapshots(seq, 20, 20)) == 2
    assert bm.plan_state_snapshots(Sequence(1, [5] * 9), 9, 9) == []  # every slot planned, none evictable
    bm.free(seq)
    bm.check_invariants()
    assert bm.snapshots.stats.num_planned == 2 and not bm.snapshots.has(0)


def test_reset_prefix_cache_forgets_snapshots() -> None:
    bm = _manager()
    seq = Sequence(0, list(range(9)))
    _step(bm, seq, 9)
    bm.free(seq)
    assert bm.reset_prefix_cache()
    assert bm.allocate_cached_prefix(Sequence(1, list(range(9)))) == 0
    bm.check_invariants()


def test_snapshots_need_prefix_caching_and_whole_blocks() -> None:
    with pytest.raises(ValueError, match="enable_caching"):
        BlockManager(block_size=4, num_gpu_blocks=8, num_state_slots=2, num_state_snapshots=2,
                     state_snapshot_interval=8)
    with pytest.raises(ValueError, match="multiple of block_size 4"):
        BlockManager(block_size=4, num_gpu_blocks=8, enable_caching=True, num_state_slots=2, num_state_snapshots=2,
                     state_snapshot_interval=6)
