"""Physical KV blocks of one device: refcounts, a free list, and the prefix-cache index.

A block whose refcount drops to zero is free. If it holds a full, hashed block of tokens it
stays findable by its hash (its KV bytes are still valid) and is evicted least-recently-used
first, only when the pool has no never-cached free block left.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import xxhash


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...], extra_keys: tuple[str, ...] = ()) -> int:
    """Content hash of one full block, chained on the previous block's hash. `extra_keys` (vLLM's): what else
    the block's KV depends on, e.g. the content hashes of the images whose placeholders it holds."""
    h = xxhash.xxh64()
    h.update((parent_hash if parent_hash is not None else 0).to_bytes(8, "little", signed=False))
    h.update(len(token_ids).to_bytes(4, "little"))
    for t in token_ids:
        h.update(t.to_bytes(4, "little", signed=True))
    for key in extra_keys:
        h.update(b"\0extra\0" + key.encode("utf-8"))
    return h.intdigest()


def hash_cache_salt(salt: str) -> int:
    """The chain's start for a salted request (vLLM's `cache_salt`): its first block's parent hash, so every
    block of the chain hashes differently from an unsalted or otherwise salted one with the same tokens."""
    return xxhash.xxh64(b"cache_salt\0" + salt.encode("utf-8")).intdigest()


class BlockPool:
    """Allocator for `num_blocks` physical blocks identified by ints 0..num_blocks-1."""

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        # Stack of free blocks holding nothing worth keeping (popped from the end).
        self._free_uncached: list[int] = list(range(num_blocks - 1, -1, -1))
        # Free blocks that still hold a cached prefix, in LRU order (oldest first).
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Prefix-cache index: hash -> block, and per cached block its hash and token ids.
        self._hash_to_block: dict[int, int] = {}
        self._block_hash: dict[int, int] = {}
        self._block_tokens: dict[int, tuple[int, ...]] = {}
        self.num_evictions = 0
        self.num_increfs = 0  # ever: a block gaining a reference may need copying before a write
        # Called as on_evict(block, hash, token ids) when a cached block is taken for reuse, before its KV bytes
        # are overwritten (the block manager's CPU offloading tier keeps a copy).
        self.on_evict: Callable[[int, int, tuple[int, ...]], None] | None = None

    # -- allocation -------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._evictable)

    def allocate(self) -> int:
        """Take one free block (refcount becomes 1); evicts the LRU cached block if needed."""
        if self._free_uncached:
            block = self._free_uncached.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(block, self._block_hash[block], self._block_tokens[block])
            self._uncache(block)
            self.num_evictions += 1
        else:
            raise MemoryError("BlockPool is out of free blocks; the scheduler should have preempted.")
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        self.num_increfs += 1
        if self.ref_counts[block] == 0:
            # Revived from the prefix cache.
            self._evictable.pop(block, None)
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        count = self.ref_counts[block]
        if count <= 0:
            raise RuntimeError(f"block {block} freed more times than it was allocated")
        self.ref_counts[block] = count - 1
        if count == 1:
            if block in self._block_hash:
                self._evictable[block] = None
            else:
                self._free_uncached.append(block)

    # -- prefix cache -----------------------------------------------------------------------
    def cache_block(self, block: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Register a full, computed block under its content hash (first writer wins)."""
        if not self.enable_caching or block in self._block_hash:
            return
        if block_hash in self._hash_to_block:
            return
        self._hash_to_block[block_hash] = block
        self._block_hash[block] = block_hash
        self._block_tokens[block] = token_ids

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The cached block holding exactly these tokens after this chain, if any."""
        block = self._hash_to_block.get(block_hash)
        if block is None or self._block_tokens.get(block) != token_ids:
            return None
        return block

    def block_hash(self, block: int) -> int | None:
        return self._block_hash.get(block)

    def touch(self, block: int) -> None:
        """A free cached block was used again: it becomes the last to be evicted."""
        if block in self._evictable:
            self._evictable.move_to_end(block)

    def _uncache(self, block: int) -> None:
        block_hash = self._block_hash.pop(block, None)
        self._block_tokens.pop(block, None)
        if block_hash is not None and self._hash_to_block.get(block_hash) == block:
            del self._hash_to_block[block_hash]

    def reset_prefix_cache(self) -> int:
        """Drop every cached-but-free block from the index; returns how many were dropped."""
        dropped = 0
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
            self._free_uncached.append(block)
            dropped += 1
        return dropped

    # -- introspection ----------------------------------------------------------------------
    def num_cached_blocks(self) -> int:
        return len(self._block_hash)

    def cached_free_blocks(self) -> list[int]:
        """Free blocks still holding a cached prefix (reusable by a lookup), LRU order."""
        return list(self._evictable)

    def check_invariants(self) -> None:
        """Raise if the free lists and refcounts disagree (used by tests)."""
        free = set(self._free_uncached) | set(self._evictable)
        if len(free) != len(self._free_uncached) + len(self._evictable):
            raise RuntimeError("a block is on a free list twice")
        for block, count in enumerate(self.ref_counts):
            if count < 0:
                raise RuntimeError(f"block {block} has negative refcount {count}")
            if (count == 0) != (block in free):
                raise RuntimeError(f"block {block}: refcount {count} but free={block in free}")
        for block in self._evictable:
            if block not in self._block_hash:
                raise RuntimeError(f"evictable block {block} has no hash")
