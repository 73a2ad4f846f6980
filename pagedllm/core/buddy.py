"""A binary buddy allocator over KV block ids (the memory allocator the paper assumes for Orca, §3).

The pool ``[0, num_blocks)`` starts as its maximal aligned power-of-two segments (13 blocks → 8 + 4 + 1),
so ``num_blocks`` need not be a power of two. A request for ``n`` blocks gets a region of
``2 ** ceil(log2 n)`` blocks, split off the smallest free region that holds it; a freed region merges
with its buddy (``start ^ size``) whenever that buddy is free at the same size, all the way up.
Regions never merge across initial segments: a segment's buddy lies (partly) outside the pool and is
never free at that size.

Free regions of each order are kept in a set (membership, O(1) removal) and a min-heap of starts
(lowest address first, with lazy deletion), so allocate and free cost O(log num_blocks) amortized.
"""
from __future__ import annotations

import heapq


def order_of(num_blocks: int) -> int:
    """The smallest k with 2**k >= num_blocks (num_blocks >= 1)."""
    if num_blocks < 1:
        raise ValueError(f"a region needs at least 1 block, got {num_blocks}.")
    return (num_blocks - 1).bit_length()


def initial_segments(num_blocks: int) -> list[tuple[int, int]]:
    """(start, order) of the maximal aligned power-of-two segments covering ``[0, num_blocks)``."""
    segments = []
    start = 0
    for order in range(num_blocks.bit_length() - 1, -1, -1):
        if num_blocks & (1 << order):
            segments.append((start, order))
            start += 1 << order
    return segments


class BuddyAllocator:
    """Power-of-two regions of consecutive block ids, with coalescing of buddies on free."""

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative integer, got {num_blocks!r}.")
        self.num_blocks = num_blocks
        self.max_order = max(0, num_blocks.bit_length() - 1)
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self._heaps: list[list[int]] = [[] for _ in range(self.max_order + 1)]
        self._allocated: dict[int, int] = {}  # start -> order
        self.num_free_blocks = 0
        self.segments = initial_segments(num_blocks)
        for start, order in self.segments:
            self._push(start, order)
            self.num_free_blocks += 1 << order

    # -- free-list primitives ---------------------------------------------------------------
    def _push(self, start: int, order: int) -> None:
        self._free[order].add(start)
        heap = self._heaps[order]
        heapq.heappush(heap, start)
        if len(heap) > 2 * len(self._free[order]) + 64:  # drop stale entries now and then
            self._heaps[order] = sorted(self._free[order])

    def _pop_lowest(self, order: int) -> int:
        heap, free = self._heaps[order], self._free[order]
        while True:
            start = heapq.heappop(heap)
            if start in free:
                free.remove(start)
                return start

    # -- public API -------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> int | None:
        """Start of a free region of ``2 ** ceil(log2 num_blocks)`` blocks, or None if none is free."""
        order = order_of(num_blocks)
        if order > self.max_order:
            return None
        o = order
        while o <= self.max_order and not self._free[o]:
            o += 1
        if o > self.max_order:
            return None
        start = self._pop_lowest(o)
        while o > order:  # split: keep the lower half, free the upper one
            o -= 1
            self._push(start + (1 << o), o)
        self._allocated[start] = order
        self.num_free_blocks -= 1 << order
        return start

    def free(self, start: int) -> None:
        """Give back the region that starts at ``start``; it merges with free buddies."""
        order = self._allocated.pop(start, None)
        if order is None:
            raise ValueError(f"block {start} is not the start of an allocated region.")
        self.num_free_blocks += 1 << order
        while order < self.max_order:
            buddy = start ^ (1 << order)
            if buddy not in self._free[order]:
                break
            self._free[order].remove(buddy)  # its heap entry goes stale
            start = min(start, buddy)
            order += 1
        self._push(start, order)

    def region_size(self, start: int) -> int:
        """Blocks in the allocated region starting at ``start``."""
        order = self._allocated.get(start)
        if order is None:
            raise ValueError(f"block {start} is not the start of an allocated region.")
        return 1 << order

    def largest_free_region(self) -> int:
        """Blocks in the largest free region (0 when nothing is free)."""
        for order in range(self.max_order, -1, -1):
            if self._free[order]:
                return 1 << order
        return 0

    def num_fitting(self, num_blocks: int) -> int:
        """How many regions for ``num_blocks`` blocks each could be allocated now, one after another."""
        order = order_of(num_blocks)
        return sum(len(self._free[o]) << (o - order) for o in range(order, self.max_order + 1))

    def num_fitting_when_empty(self, num_blocks: int) -> int:
        """How many such regions an empty pool holds."""
        order = order_of(num_blocks)
        return sum(1 << (o - order) for _, o in self.segments if o >= order)

    def free_regions(self) -> list[tuple[int, int]]:
        """(start, num_blocks) of every free region, by address."""
        return sorted((s, 1 << o) for o, starts in enumerate(self._free) for s in starts)

    def allocated_regions(self) -> list[tuple[int, int]]:
        """(start, num_blocks) of every allocated region, by address."""
        return sorted((s, 1 << o) for s, o in self._allocated.items())

    def check_invariants(self) -> None:
        """Raise RuntimeError unless free and allocated regions tile the pool exactly, every region is
        aligned to its size, no two free buddies are left unmerged, and the free count is right."""
        regions = [(s, n, True) for s, n in self.free_regions()]
        regions += [(s, n, False) for s, n in self.allocated_regions()]
        regions.sort()
        pos = 0
        for start, size, _ in regions:
            if start != pos:
                kind = "overlap" if start < pos else "gap"
                raise RuntimeError(f"buddy regions {kind} at block {min(start, pos)}")
            if start % size:
                raise RuntimeError(f"region at {start} of {size} blocks is not aligned")
            pos = start + size
        if pos != self.num_blocks:
            raise RuntimeError(f"regions cover {pos} blocks, the pool has {self.num_blocks}")
        free_total = sum(n for _, n, is_free in regions if is_free)
        if free_total != self.num_free_blocks:
            raise RuntimeError(f"num_free_blocks={self.num_free_blocks} but free regions hold {free_total}")
        for order, starts in enumerate(self._free):
            for s in starts:
                if order < self.max_order and (s ^ (1 << order)) in starts:
                    raise RuntimeError(f"free buddies {s} and {s ^ (1 << order)} of order {order} not merged")
