"""Sliding-window block freeing: a sequence of a model whose every layer sees only its last W keys holds about W
tokens of KV blocks however long it grows; the freed entries stay in its table as NULL_BLOCK (pure Python)."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from pagedllm.core.block_manager import NULL_BLOCK, BlockManager, cdiv, leading_null_blocks
from pagedllm.core.kv_accounting import kv_memory_breakdown
from pagedllm.core.kv_snapshot import build_kv_snapshot, capture_kv_state
from pagedllm.core.sequence import Sequence, SequenceGroup


def _grow(bm: BlockManager, seq: Sequence, n: int) -> list[tuple[int, int]]:
    copies = bm.allocate_slots(seq, n)
    seq.num_computed_tokens += n
    return copies


def _live(table: list[int]) -> list[int]:
    return [b for b in table if b != NULL_BLOCK]


def test_a_growing_sequence_keeps_only_the_blocks_its_next_query_can_see() -> None:
    bs, window = 4, 10
    bm = BlockManager(block_size=bs, num_gpu_blocks=8, sliding_window=window)
    seq = Sequence(0, list(range(7)))
    _grow(bm, seq, 7)
    for step in range(60):  # 67 tokens: 17 blocks without freeing, in a pool of 8
        seq.append_token(step, 0.0)
        _grow(bm, seq, 1)
        table = bm.get_block_table(seq)
        assert len(table) == cdiv(seq.num_computed_tokens, bs)  # positions keep their table index
        first_seen = max(0, seq.num_computed_tokens - 1 - window + 1) // bs  # the step's query was the last token
        assert table[:first_seen] == [NULL_BLOCK] * first_seen
        assert NULL_BLOCK not in table[first_seen:]
        assert leading_null_blocks(table) == first_seen
        assert len(_live(table)) <= cdiv(window, bs) + 1
        bm.check_invariants()
    bm.free(seq)
    assert bm.get_num_free_gpu_blocks() == 8
    bm.check_invariants()


def test_a_long_prompt_chunk_frees_only_what_its_first_query_cannot_see() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=16, sliding_window=6)
    seq = Sequence(0, list(range(40)))
    _grow(bm, seq, 20)  # chunk 1: positions 0-19, the first query (0) sees everything before it
    assert NULL_BLOCK not in bm.get_block_table(seq)
    _grow(bm, seq, 20)  # chunk 2: its first query (20) sees 15.. -> blocks 0-2 (positions 0-11) go
    table = bm.get_block_table(seq)
    assert table[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in table[3:]
    bm.check_invariants()


def test_fork_swap_and_free_skip_freed_entries() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=12, num_cpu_blocks=12, sliding_window=5)
    parent = Sequence(0, list(range(20)))
    group = SequenceGroup("r", [parent], None, 0.0)
    _grow(bm, parent, 20)
    parent.append_token(1, 0.0)
    _grow(bm, parent, 1)
    child = parent.fork(1)
    group.seqs.append(child)
    bm.fork(parent, child)
    assert bm.get_block_table(child) == bm.get_block_table(parent)
    assert leading_null_blocks(bm.get_block_table(child)) > 0
    bm.check_invariants()
    used = bm.num_gpu_blocks - bm.get_num_free_gpu_blocks()
    assert bm.can_swap_out(group)
    mapping = bm.swap_out(group)
    assert len(mapping) == used  # only held blocks move, each once
    assert bm.get_num_free_gpu_blocks() == 12
    bm.check_invariants()
    bm.swap_in(group)
    assert leading_null_blocks(bm.get_block_table(parent)) == leading_null_blocks(bm.get_block_table(child)) > 0
    bm.check_invariants()
    for s in (parent, child):
        bm.free(s)
    assert bm.get_num_free_gpu_blocks() == 12 and bm.get_num_free_cpu_blocks() == 12
    bm.check_invariants()


def test_freed_blocks_stay_in_the_prefix_cache() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=16, enable_caching=True, sliding_window=4)
    first = Sequence(0, list(range(24)))
    _grow(bm, first, 16)
    bm.cache_computed_blocks(first)
    _grow(bm, first, 8)  # its first query (16) sees 13..: blocks 0-2 freed, still cached
    bm.cache_computed_blocks(first)
    assert leading_null_blocks(bm.get_block_table(first)) == 3
    bm.check_invariants()
    again = Sequence(1, list(range(24)))
    assert bm.allocate_cached_prefix(again) == 20  # every full block before the last token, the freed ones too
    again.num_computed_tokens = 20  # as the scheduler does with a hit
    bm.check_invariants()
    _grow(bm, again, 4)  # resumes at 20: blocks before position 17 go again
    assert leading_null_blocks(bm.get_block_table(again)) == 4
    bm.check_invariants()


def test_accounting_and_snapshot_count_held_blocks_only() -> None:
    from pagedllm.config import CacheConfig, SchedulerConfig
    from pagedllm.core.scheduler import Scheduler

    cache = CacheConfig(block_size=4)
    cache.num_gpu_blocks, cache.num_cpu_blocks = 16, 0
    cache.sliding_window = 8
    scheduler = Scheduler(SchedulerConfig(max_model_len=256), cache)
    bm = scheduler.block_manager
    assert bm.sliding_window == 8
    seq = Sequence(0, list(range(30)))
    group = SequenceGroup("r", [seq], None, 0.0)
    _grow(bm, seq, 30)
    seq.append_token(1, 0.0)
    _grow(bm, seq, 1)
    held = len(_live(bm.get_block_table(seq)))
    breakdown = kv_memory_breakdown(bm, [group], max_model_len=64)
    total = breakdown.token_states + breakdown.reservation + breakdown.internal_fragmentation
    assert total == held * 4
    scheduler.running.append(group)
    snapshot = build_kv_snapshot(capture_kv_state(scheduler))
    blocks = snapshot["queues"]["running"][0]["seqs"][0]["blocks"]
    assert blocks == _live(bm.get_block_table(seq))


@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 24), bs=st.sampled_from([1, 2, 4, 16]),
       chunks=st.lists(st.integers(1, 9), min_size=1, max_size=30))
def test_every_position_a_query_can_see_stays_held(window: int, bs: int, chunks: list[int]) -> None:
    bm = BlockManager(block_size=bs, num_gpu_blocks=4096, sliding_window=window)
    seq = Sequence(0, list(range(sum(chunks))))
    for n in chunks:
        start = seq.num_computed_tokens
        _grow(bm, seq, n)
        table = bm.get_block_table(seq)
        for pos in range(max(0, start - window + 1), start + n):  # every key this step's queries read
            assert table[pos // bs] != NULL_BLOCK
        bm.check_invariants()
    bm.free(seq)
    assert bm.get_num_free_gpu_blocks() == 4096


def test_a_request_may_outgrow_the_pool_when_every_layer_slides() -> None:
    from pagedllm.engine.request_checker import RequestChecker

    def checker(window: int | None, blocks: int) -> RequestChecker:
        return RequestChecker(vocab_size=100, max_model_len=4096, num_gpu_blocks=blocks, block_size=16,
                              max_num_seqs=8, max_num_batched_tokens=256, sliding_window=window)

    assert checker(None, 40).max_seq_len == 640  # full attention: the pool bounds a sequence
    assert checker(256, 40).max_seq_len == 4096  # 640 slots hold a window (256) + a chunk (256) + 2 blocks
    assert checker(512, 40).max_seq_len == 640  # they do not hold 512 + 256 + 32
