"""Buddy allocator (core/buddy.py): splitting, coalescing, tiling of the pool, external fragmentation."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from pagedllm.core.buddy import BuddyAllocator, initial_segments, order_of


def test_pool_starts_as_aligned_power_of_two_segments():
    assert initial_segments(13) == [(0, 3), (8, 2), (12, 0)]
    b = BuddyAllocator(13)
    assert b.free_regions() == [(0, 8), (8, 4), (12, 1)] and b.num_free_blocks == 13
    assert [order_of(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]


def test_split_takes_lowest_address_and_free_merges_all_the_way_up():
    b = BuddyAllocator(16)
    a = b.allocate(1)
    assert a == 0 and b.region_size(a) == 1
    assert b.free_regions() == [(1, 1), (2, 2), (4, 4), (8, 8)]  # 16 split into 8+4+2+1+1
    c = b.allocate(3)  # rounds up to 4: the free 4-block region at 4
    assert c == 4 and b.region_size(c) == 4 and b.num_free_blocks == 11
    b.check_invariants()
    b.free(a)
    assert b.free_regions() == [(0, 4), (8, 8)]  # 0 and 1 merged, then with 2..3
    b.free(c)
    assert b.free_regions() == [(0, 16)] and b.num_free_blocks == 16
    b.check_invariants()


def test_regions_never_merge_across_initial_segments():
    b = BuddyAllocator(12)  # 8 + 4
    assert b.allocate(8) == 0 and b.allocate(4) == 8 and b.allocate(1) is None
    b.free(8)
    b.free(0)
    assert b.free_regions() == [(0, 8), (8, 4)]
    assert b.allocate(16) is None and b.largest_free_region() == 8


def test_external_fragmentation_free_blocks_that_no_request_can_use():
    """Half the pool free in holes of 2: a 4-block request fails although 8 blocks are free."""
    b = BuddyAllocator(16)
    starts = [b.allocate(2) for _ in range(8)]
    assert starts == list(range(0, 16, 2)) and b.allocate(1) is None
    for s in starts[::2]:
        b.free(s)
    assert b.num_free_blocks == 8 and b.largest_free_region() == 2
    assert b.allocate(4) is None  # external fragmentation: 8 free, 0 usable for 4
    assert b.num_fitting(4) == 0 and b.num_fitting(2) == 4 and b.num_fitting_when_empty(4) == 4
    b.free(starts[1])  # 0..1 and 2..3 merge; 0..3 stays apart from 4..7 (6..7 is taken)
    assert b.largest_free_region() == 4 and b.allocate(4) == 0
    b.check_invariants()


def test_bad_calls_are_clear_errors():
    b = BuddyAllocator(8)
    with pytest.raises(ValueError, match="at least 1 block"):
        b.allocate(0)
    s = b.allocate(2)
    b.free(s)
    with pytest.raises(ValueError, match="not the start of an allocated region"):
        b.free(s)
    with pytest.raises(ValueError, match="non-negative integer"):
        BuddyAllocator(-1)
    assert b.allocate(9) is None


@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(1, 70),
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 1000)), max_size=60),
)
def test_random_operations_tile_the_pool_and_coalesce_back(num_blocks, ops):
    b = BuddyAllocator(num_blocks)
    live: dict[int, int] = {}  # start -> size
    for is_alloc, n, pick in ops:
        if is_alloc or not live:
            fits = b.num_fitting(n)
            start = b.allocate(n)
            assert (start is None) == (fits == 0)
            if start is not None:
                size = b.region_size(start)
                assert size >= n and size < 2 * n and start % size == 0
                assert all(start + size <= s or s + z <= start for s, z in live.items())  # no overlap
                live[start] = size
        else:
            start = sorted(live)[pick % len(live)]
            b.free(start)
            del live[start]
        b.check_invariants()  # free + allocated regions tile [0, num_blocks) exactly
        assert b.num_free_blocks == num_blocks - sum(live.values())
    for start in list(live):
        b.free(start)
    assert b.free_regions() == [(s, 1 << o) for s, o in initial_segments(num_blocks)]
