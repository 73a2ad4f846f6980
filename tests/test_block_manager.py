"""Block pool / block manager: refcounts, free lists, CoW, fork, swap, prefix cache (pure Python)."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.sequence import Sequence, SequenceGroup


def _seq(seq_id: int, n_prompt: int, start: int = 0) -> Sequence:
    return Sequence(seq_id, list(range(start, start + n_prompt)))


def _grow(bm: BlockManager, seq: Sequence, n: int) -> list[tuple[int, int]]:
    copies = bm.allocate_slots(seq, n)
    seq.num_computed_tokens += n
    return copies


def test_allocate_on_demand_and_free():
    bm = BlockManager(block_size=4, num_gpu_blocks=8)
    s = _seq(0, 7)
    _grow(bm, s, 7)
    assert len(bm.get_block_table(s)) == 2  # 7 tokens → 2 blocks, one slot spare
    s.append_token(1, 0.0)
    _grow(bm, s, 1)
    assert len(bm.get_block_table(s)) == 2  # the spare slot is used, no new block
    s.append_token(1, 0.0)
    _grow(bm, s, 1)
    assert len(bm.get_block_table(s)) == 3  # a new block only when the last one is full
    bm.free(s)
    assert bm.get_num_free_gpu_blocks() == 8
    bm.check_invariants()


def test_fork_shares_blocks_and_cow_copies_last_block():
    bm = BlockManager(block_size=4, num_gpu_blocks=8)
    parent = _seq(0, 6)
    _grow(bm, parent, 6)
    child = parent.fork(1)
    bm.fork(parent, child)
    assert bm.get_block_table(child) == bm.get_block_table(parent)
    assert bm.num_blocks_saved_by_sharing() == 2
    # Both write position 6, inside shared block 1: the first writer copies, the second writes in place.
    parent.append_token(5, 0.0)
    assert bm.num_blocks_to_grow(parent, 1) == 1
    copies = _grow(bm, parent, 1)
    assert len(copies) == 1 and copies[0][0] == bm.get_block_table(child)[1]
    child.append_token(6, 0.0)
    assert _grow(bm, child, 1) == []
    assert bm.get_block_table(parent)[0] == bm.get_block_table(child)[0]
    assert bm.get_block_table(parent)[1] != bm.get_block_table(child)[1]
    bm.check_invariants()
    bm.free(parent)
    bm.free(child)
    assert bm.get_num_free_gpu_blocks() == 8


def test_swap_out_and_in_moves_shared_blocks_once():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8)
    a = _seq(0, 8)
    _grow(bm, a, 8)
    b = a.fork(1)
    bm.fork(a, b)
    group = SequenceGroup("r", [a, b], None, 0.0)
    mapping = bm.swap_out(group)
    assert len(mapping) == 2  # two distinct blocks, though four table entries
    assert bm.get_num_free_gpu_blocks() == 8 and bm.get_num_free_cpu_blocks() == 6
    bm.check_invariants()
    back = bm.swap_in(group)
    assert len(back) == 2
    assert bm.get_block_table(a) == bm.get_block_table(b)
    assert bm.get_num_free_cpu_blocks() == 8
    bm.check_invariants()


def test_prefix_cache_reuses_full_blocks_and_verifies_tokens():
    bm = BlockManager(block_size=4, num_gpu_blocks=16, enable_caching=True)
    a = _seq(0, 10)
    _grow(bm, a, 10)
    bm.cache_computed_blocks(a)
    b = _seq(1, 10)  # identical prompt
    assert bm.allocate_cached_prefix(b) == 8  # two full blocks; the tail is recomputed
    assert bm.get_block_table(b) == bm.get_block_table(a)[:2]
    c = Sequence(2, list(range(4)) + [99, 98, 97, 96, 1, 2])  # diverges in block 1
    assert bm.allocate_cached_prefix(c) == 4
    for s in (a, b, c):
        bm.free(s)
    bm.check_invariants()
    # Freed cached blocks stay findable until evicted.
    d = _seq(3, 10)
    assert bm.allocate_cached_prefix(d) == 8
    bm.free(d)
    assert bm.get_num_free_gpu_blocks() == 16


def test_cache_salt_separates_prefix_caches():
    """vLLM's cache_salt: blocks are found only by requests with the same salt (and forks keep it); an unsalted
    request and a differently salted one compute the same prompt afresh."""
    bm = BlockManager(block_size=4, num_gpu_blocks=32, enable_caching=True)
    salted = Sequence(0, list(range(10)), cache_salt="tenant-a")
    _grow(bm, salted, 10)
    bm.cache_computed_blocks(salted)
    same = Sequence(1, list(range(10)), cache_salt="tenant-a")
    assert bm.allocate_cached_prefix(same) == 8
    assert bm.get_block_table(same) == bm.get_block_table(salted)[:2]
    assert salted.fork(2).cache_salt == "tenant-a"
    unsalted, other_salt = Sequence(3, list(range(10))), Sequence(4, list(range(10)), cache_salt="tenant-b")
    for other in (unsalted, other_salt):
        assert bm.allocate_cached_prefix(other) == 0
        _grow(bm, other, 10)
        bm.cache_computed_blocks(other)
        assert not set(bm.get_block_table(other)) & set(bm.get_block_table(salted))
    plain = _seq(5, 10)  # finds the unsalted copy, not a salted one
    assert bm.allocate_cached_prefix(plain) == 8
    assert bm.get_block_table(plain) == bm.get_block_table(unsalted)[:2]
    for seq in (salted, same, unsalted, other_salt, plain):
        bm.free(seq)
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == 32


def test_reset_prefix_cache_only_while_no_block_is_in_use():
    bm = BlockManager(block_size=4, num_gpu_blocks=16, enable_caching=True)
    a = _seq(0, 10)
    _grow(bm, a, 10)
    bm.cache_computed_blocks(a)
    assert not bm.reset_prefix_cache()  # a holds its blocks: nothing changes
    b = _seq(1, 10)
    assert bm.allocate_cached_prefix(b) == 8
    bm.free(a)
    bm.free(b)
    assert bm.reset_prefix_cache()
    assert bm.gpu_pool.num_cached_blocks() == 0 and bm.get_num_free_gpu_blocks() == 16
    c = _seq(2, 10)
    assert bm.allocate_cached_prefix(c) == 0
    bm.free(c)
    bm.check_invariants()


def test_prefix_cache_evicts_lru_when_full():
    bm = BlockManager(block_size=2, num_gpu_blocks=4, enable_caching=True)
    a = _seq(0, 5)
    _grow(bm, a, 5)
    bm.cache_computed_blocks(a)
    bm.free(a)
    b = _seq(1, 8, start=100)
    _grow(bm, b, 8)  # needs all 4 blocks → evicts the cached ones
    assert bm.gpu_pool.num_evictions >= 2
    bm.free(b)
    c = _seq(2, 5)
    assert bm.allocate_cached_prefix(c) == 0
    bm.free(c)
    bm.check_invariants()


ops = st.lists(
    st.tuples(st.sampled_from(["new", "append", "fork", "free", "swap"]), st.integers(0, 10**6)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4]), caching=st.booleans())
def test_random_operations_keep_refcounts_consistent(ops, block_size, caching):
    bm = BlockManager(block_size=block_size, num_gpu_blocks=24, num_cpu_blocks=24, enable_caching=caching)
    live: list[Sequence] = []
    swapped: list[SequenceGroup] = []
    next_id = 0
    for op, r in ops:
        if op == "new" or not live:
            s = Sequence(next_id, [r % 7 + i % 3 for i in range(1 + r % 9)])
            next_id += 1
            cached = bm.allocate_cached_prefix(s)
            s.num_computed_tokens = cached
            n = s.get_len() - cached
            if bm.num_blocks_to_grow(s, n) <= bm.get_num_free_gpu_blocks():
                _grow(bm, s, n)
                bm.cache_computed_blocks(s)
                live.append(s)
            else:
                bm.free(s)
        elif op == "append":
            s = live[r % len(live)]
            s.append_token(r % 5, 0.0)
            if bm.num_blocks_to_grow(s, 1) <= bm.get_num_free_gpu_blocks():
                table_before = list(bm.get_block_table(s))
                copies = _grow(bm, s, 1)
                # CoW: the slot written now belongs to this sequence alone.
                pos = s.num_computed_tokens - 1
                block = bm.get_block_table(s)[pos // block_size]
                assert bm.gpu_pool.ref_counts[block] == 1
                for src, dst in copies:
                    assert src in table_before and dst not in table_before
                bm.cache_computed_blocks(s)
            else:
                s.output_token_ids.pop()
        elif op == "fork":
            s = live[r % len(live)]
            child = s.fork(next_id)
            next_id += 1
            bm.fork(s, child)
            live.append(child)
        elif op == "free":
            s = live.pop(r % len(live))
            bm.free(s)
        elif op == "swap":
            if swapped and r % 2:
                g = swapped.pop()
                if bm.can_swap_in(g):
                    bm.swap_in(g)
                    live.extend(g.seqs)
                else:
                    swapped.append(g)
            else:
                s = live[r % len(live)]
                group_seqs = [x for x in live if bm.get_block_table(x) and set(bm.get_block_table(x)) & set(bm.get_block_table(s))] or [s]
                g = SequenceGroup(f"g{next_id}", group_seqs, None, 0.0)
                # Only whole sharing-closed groups may be swapped.
                closed = all(
                    not (set(bm.get_block_table(x)) & set(bm.get_block_table(y)))
                    for x in live if x not in group_seqs for y in group_seqs
                )
                if closed and bm.can_swap_out(g):
                    bm.swap_out(g)
                    for x in group_seqs:
                        live.remove(x)
                    swapped.append(g)
        bm.check_invariants()
    for s in live:
        bm.free(s)
    for g in swapped:
        for s in g.seqs:
            bm.free(s)
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == 24
    assert bm.get_num_free_cpu_blocks() == 24
    assert all(c == 0 for c in bm.gpu_pool.ref_counts)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grow", "fork", "free"]), st.integers(0, 5), st.integers(1, 9)),
                min_size=1, max_size=40))
def test_num_blocks_to_grow_is_what_allocate_slots_takes(ops):
    """The scheduler plans with num_blocks_to_grow; allocate_slots must take exactly that many blocks (new
    blocks plus copy-on-write copies of shared ones), across forks and frees."""
    bm = BlockManager(block_size=4, num_gpu_blocks=64)
    seqs = [_seq(0, 5)]
    next_id = 1
    for op, pick, n in ops:
        s = seqs[pick % len(seqs)] if seqs else None
        if op == "grow" and s is not None:
            planned = bm.num_blocks_to_grow(s, n)
            if planned > bm.get_num_free_gpu_blocks():
                continue
            free = bm.get_num_free_gpu_blocks()
            copies = bm.allocate_slots(s, n)
            assert free - bm.get_num_free_gpu_blocks() == planned
            assert len(copies) <= planned
            s.num_computed_tokens += n
            s.output_token_ids.extend([0] * n)
        elif op == "fork" and s is not None:
            child = Sequence(next_id, s.prompt_token_ids, list(s.output_token_ids), num_computed_tokens=s.num_computed_tokens)
            next_id += 1
            bm.fork(s, child)
            seqs.append(child)
        elif op == "free" and len(seqs) > 1:
            bm.free(seqs.pop(pick % len(seqs)))
    bm.check_invariants()


def test_sequence_status_is_finished_exactly_for_finished_statuses():
    """SequenceStatus numbers the finished statuses last so that is_finished is one comparison."""
    from pagedllm.core.sequence import SequenceStatus

    for status in SequenceStatus:
        assert status.is_finished == status.name.startswith("FINISHED_"), status
        seq = _seq(0, 3)
        seq.status = status
        group = SequenceGroup("r", [seq], None, 0.0)
        assert seq.is_finished() == group.is_finished() == status.is_finished
        assert group.unfinished_seqs() == ([] if status.is_finished else [seq])
