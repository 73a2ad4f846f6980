"""The worker's persistent block-table rows (worker/block_table_rows.py) against the block manager's tables, through
every way a table changes: growth, sliding-window frees, fork, copy-on-write, truncation, swap and free."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pagedllm.core.block_manager import NULL_BLOCK, BlockManager
from pagedllm.core.sequence import Sequence, SequenceGroup
from pagedllm.worker.block_table_rows import PersistentBlockTables
from pagedllm.worker.model_input import SequenceChunk


def _chunk(bm: BlockManager, seq: Sequence) -> SequenceChunk:
    tables = [list(t) for t in bm.get_block_tables(seq)]
    return SequenceChunk(seq.seq_id, [0], seq.num_computed_tokens, tables[0], sample=True,
                         group_block_tables=tables[1:] or None, table_version=bm.table_version(seq))


def _assert_rows_match(bm: BlockManager, rows: PersistentBlockTables, seqs: list[Sequence]) -> None:
    """Each group's gathered row holds the table's live entries; a freed entry holds some valid block id."""
    chunks = [_chunk(bm, s) for s in seqs]
    idx = rows.row_indices(chunks)
    width = max(len(c.block_table) for c in chunks)
    for g in range(bm.num_groups):
        got = rows.gather(g, idx, width)
        for i, seq in enumerate(seqs):
            table = bm.get_block_tables(seq)[g]
            for j, block in enumerate(table):
                if block == NULL_BLOCK:
                    assert 0 <= got[i, j] < bm.num_gpu_blocks
                else:
                    assert got[i, j] == block, (g, i, j)


def _grow(bm: BlockManager, seq: Sequence, n: int) -> None:
    bm.num_blocks_to_grow(seq, n)  # as the scheduler does first (it may leave allocate_slots nothing to do)
    bm.allocate_slots(seq, n)
    seq.num_computed_tokens += n


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["grow", "fork", "truncate", "swap", "free", "new"]),
                              st.integers(0, 7), st.integers(1, 9)), min_size=1, max_size=40),
       windows=st.sampled_from([(None,), (6,), (None, 5), (None, 5, 5, 9)]))
def test_rows_follow_every_table_change(ops, windows) -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=400, num_cpu_blocks=400, group_windows=windows)
    rows = PersistentBlockTables(bm.num_groups, width=2, capacity=2, check=False)  # grows in both directions
    seqs: list[Sequence] = []
    groups: dict[int, SequenceGroup] = {}
    next_id = 0

    def new_seq() -> Sequence:
        nonlocal next_id
        seq = Sequence(next_id, list(range(40)))
        groups[next_id] = SequenceGroup(f"r{next_id}", [seq], None, 0.0)
        next_id += 1
        seqs.append(seq)
        _grow(bm, seq, 3)
        return seq

    new_seq()
    for op, pick, n in ops:
        live = [s for s in seqs if s.seq_id in bm.block_tables]
        if not live:
            new_seq()
            continue
        seq = live[pick % len(live)]
        if op == "grow":
            _grow(bm, seq, n)
        elif op == "fork":
            child = Sequence(next_id, list(range(40)))
            child.num_computed_tokens = seq.num_computed_tokens
            groups[next_id] = SequenceGroup(f"r{next_id}", [child], None, 0.0)
            next_id += 1
            bm.fork(seq, child)
            seqs.append(child)
            _grow(bm, child, 1)  # writes into the shared last block: copy-on-write (if it is partly filled)
        elif op == "truncate":
            keep = max(1, len(bm.get_block_table(seq)) - n % 3)
            bm.truncate(seq, keep)
            seq.num_computed_tokens = min(seq.num_computed_tokens, keep * bm.block_size)
            _grow(bm, seq, n)  # the truncated indices get other blocks: the rows must not keep the old ones
        elif op == "swap":
            bm.swap_out(groups[seq.seq_id])
            bm.swap_in(groups[seq.seq_id])
        elif op == "free":
            bm.free(seq)
            seq.num_computed_tokens = 0
            if n % 2:
                _grow(bm, seq, n)  # recomputed under the same id with new blocks
        else:
            new_seq()
        bm.check_invariants()
        live = [s for s in seqs if s.seq_id in bm.block_tables]
        if live:
            _assert_rows_match(bm, rows, live[:: 1 + pick % 2])  # steps that leave some sequences out


def test_only_new_entries_are_copied_while_the_version_holds() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=64, group_windows=(None,))
    seq = Sequence(0, list(range(40)))
    _grow(bm, seq, 8)
    rows = PersistentBlockTables(1, check=False)
    chunk = _chunk(bm, seq)
    (i,) = rows.row_indices([chunk])
    version = bm.table_version(seq)
    _grow(bm, seq, 4)
    assert bm.table_version(seq) == version  # appending keeps the version
    stale = _chunk(bm, seq)
    stale.block_table[0] = 63  # an in-place change without a new version is not read (only entries 2.. are)
    rows.row_indices([stale])
    assert rows.rows[0, i, :3].tolist() == [*bm.get_block_table(seq)[:2], bm.get_block_table(seq)[2]]
    with pytest.raises(RuntimeError, match="differs from its table"):
        rows.verify([stale], np.array([i]))


def test_copy_on_write_truncation_and_swap_give_new_versions() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=64, num_cpu_blocks=64, group_windows=(None, 4))
    parent = Sequence(0, list(range(40)))
    group = SequenceGroup("r", [parent], None, 0.0)
    _grow(bm, parent, 6)
    seen = {bm.table_version(parent)}
    child = Sequence(1, list(range(40)))
    child.num_computed_tokens = 6
    bm.fork(parent, child)
    seen.add(bm.table_version(child))
    _grow(bm, parent, 1)  # block 1 is shared and partly filled: copied
    seen.add(bm.table_version(parent))
    bm.truncate(parent, 1)
    seen.add(bm.table_version(parent))
    bm.swap_out(group)
    assert bm.table_version(parent) is None
    bm.swap_in(group)
    seen.add(bm.table_version(parent))
    assert len(seen) == 5


def test_room_is_made_from_sequences_left_out_of_the_step() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=256, group_windows=(None,))
    seqs = [Sequence(i, list(range(8))) for i in range(12)]
    for seq in seqs:
        _grow(bm, seq, 5)
    rows = PersistentBlockTables(1, capacity=4, check=True)
    for start in range(0, 12, 4):  # three steps of four sequences each: rows are reused, not grown
        rows.row_indices([_chunk(bm, s) for s in seqs[start:start + 4]])
    assert rows.rows.shape[1] == 4
    rows.row_indices([_chunk(bm, s) for s in seqs])  # twelve at once: the capacity grows
    assert rows.rows.shape[1] >= 12
    _assert_rows_match(bm, rows, seqs)


def test_chunks_without_a_version_leave_the_rows_alone() -> None:
    rows = PersistentBlockTables(2, check=True)
    chunk = SequenceChunk(-1, [1], 0, [0, 0], sample=True)  # a warm-up chunk
    assert rows.row_indices([chunk]) is None


def test_a_fork_between_the_estimate_and_the_allocation_still_copies() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=64, group_windows=(None,))
    parent = Sequence(0, list(range(40)))
    _grow(bm, parent, 6)
    assert bm.num_blocks_to_grow(parent, 1) == 0  # block 1 has room and is the parent's alone: nothing to do
    child = Sequence(1, list(range(40)))
    child.num_computed_tokens = 6
    bm.fork(parent, child)  # now block 1 is shared
    before = bm.get_block_table(parent)[1]
    assert len(bm.allocate_slots(parent, 1)) == 1  # copied before the write, not skipped on the stale estimate
    assert bm.get_block_table(parent)[1] != before == bm.get_block_table(child)[1]
    bm.check_invariants()


@settings(max_examples=30, deadline=None)
@given(steps=st.lists(st.integers(1, 6), min_size=1, max_size=25), fork_at=st.integers(0, 25),
       truncate_at=st.integers(0, 25))
def test_prefix_caching_registers_every_full_block_looking_only_at_new_ones(steps, fork_at, truncate_at) -> None:
    """cache_computed_blocks skips the blocks it registered under the same table version; every full block of the
    sequence is still found after each step, through copy-on-write and truncation."""
    bm = BlockManager(block_size=4, num_gpu_blocks=400, enable_caching=True, group_windows=(None, 9))
    seq = Sequence(0, list(range(200)))
    for k, n in enumerate(steps):
        if k == fork_at:
            child = Sequence(1, list(range(200)))
            child.num_computed_tokens = seq.num_computed_tokens
            bm.fork(seq, child)
        if k == truncate_at and seq.num_computed_tokens:
            keep = (seq.num_computed_tokens - 1) // 4
            bm.truncate(seq, keep)
            seq.num_computed_tokens = keep * 4
        _grow(bm, seq, n)
        bm.cache_computed_blocks(seq)
        # a new sequence of the same tokens finds every full block (in this block or, after a truncation, under the
        # copy registered first: the first writer of a hash keeps it)
        probe = Sequence(99, list(range(seq.num_computed_tokens + 1)))
        assert bm.num_cached_prefix_blocks(probe) == seq.num_computed_tokens // 4, k
