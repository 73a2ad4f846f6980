"""A CPU tier under the prefix cache (vLLM's native KV offloading, ``kv_offloading_size``).

A cached device block that the pool takes back for reuse (LRU eviction) is first copied into a CPU block of this
tier, kept under the same content hash; a prefix lookup that misses on the device but finds the block here
allocates a device block and copies it back instead of recomputing its tokens. The tier is a second BlockPool
whose blocks are all free and cached (LRU) except those a pending copy still reads or writes.

The copies ride on the step's block moves, which the worker runs before the forward pass in the order swap-outs,
swap-ins, copy-on-write copies: so a device block saved and then reused by the same step is saved before it is
overwritten, and a CPU block written and read back by the same step is written first. The rules that keep each
copy's source intact until it runs: a CPU block with a pending copy (either way) is pinned (referenced) until
the moves are handed to a step; a device block being loaded is not saved again if it is evicted before its load
ran (its content is the pinned CPU block's).

CPU block ids are offset by ``base`` (the CPU swap pool's blocks come first in the worker's CPU cache).
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.block_pool import BlockPool


@dataclass
class OffloadStats:
    num_stored_blocks: int = 0  # device blocks copied to the CPU tier, cumulative
    num_loaded_blocks: int = 0  # CPU blocks copied back to the device for a prefix hit, cumulative
    num_hit_tokens: int = 0  # prompt tokens found in the CPU tier (also counted as prefix cache hits)


class OffloadTier:
    def __init__(self, num_blocks: int, base: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV offloading tier needs at least one block, got {num_blocks}")
        self.pool = BlockPool(num_blocks, enable_caching=True)
        self.base = base
        self.stats = OffloadStats()
        self._stores: list[tuple[int, int]] = []  # (device block, tier block), pending
        self._loads: list[tuple[int, int]] = []  # (tier block, device block), pending
        self._pinned: list[int] = []  # tier blocks referenced until the moves are taken
        self._loading: set[int] = set()  # device blocks with a pending load

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def store(self, device_block: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """The device pool is reusing a cached block: keep its KV here (BlockPool.on_evict)."""
        if device_block in self._loading:  # its bytes have not arrived yet: the pinned source still holds them
            return
        held = self.pool.lookup(block_hash, token_ids)
        if held is not None:
            self.pool.touch(held)
            return
        if self.pool.get_num_free_blocks() == 0:  # every tier block has a copy pending this step
            return
        block = self.pool.allocate()  # evicts the tier's least recently used block
        self.pool.cache_block(block, block_hash, token_ids)
        self._pinned.append(block)
        self._stores.append((device_block, block))
        self.stats.num_stored_blocks += 1

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The tier block holding this content, if any (no side effects)."""
        return self.pool.lookup(block_hash, token_ids)

    def load(self, tier_block: int, device_block: int) -> None:
        """Copy `tier_block` into the freshly allocated `device_block` before the next forward pass."""
        self.pool.incref(tier_block)
        self._pinned.append(tier_block)
        self._loads.append((tier_block, device_block))
        self._loading.add(device_block)
        self.stats.num_loaded_blocks += 1

    def take_moves(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The pending copies as the step's (swap-outs (device, cpu), swap-ins (cpu, device)); the tier's blocks
        are unpinned (the step runs the copies before anything can reuse them)."""
        outs = [(d, self.base + c) for d, c in self._stores]
        ins = [(self.base + c, d) for c, d in self._loads]
        for block in self._pinned:
            self.pool.decref(block)
        self._stores, self._loads, self._pinned = [], [], []
        self._loading.clear()
        return outs, ins

    def has_moves(self) -> bool:
        return bool(self._stores or self._loads)

    def reset(self) -> int:
        """Forget every cached block not pinned by a pending copy; returns how many were dropped."""
        return self.pool.reset_prefix_cache()
