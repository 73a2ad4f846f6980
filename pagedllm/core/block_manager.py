"""Block tables: logical → physical block maps per sequence, on the device pool or the CPU pool.

The three primitives every decoding algorithm is built from (paper §5.2):
``fork`` (copy a table, bump refcounts), ``allocate_slots`` (grow a table; copy-on-write a shared
block before writing into it) and ``free``. Swapping moves whole sequence groups between pools.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from pagedllm.core.block_pool import BlockPool, hash_block_tokens, hash_cache_salt
from pagedllm.core.interfaces import AllocStatus
from pagedllm.core.sequence import Sequence, SequenceGroup


#: A table entry whose block was freed because no query can see it any more (sliding-window attention): the
#: position keeps its index in the table, the block goes back to the pool. The worker reads it as block 0, whose
#: keys every window masks out.
NULL_BLOCK = -1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _mm_extra_keys(seq: Sequence, start: int, end: int) -> tuple[str, ...]:
    """Content hashes of the images whose placeholders lie (partly) in positions [start, end) of `seq`."""
    return tuple(h for offset, length, h in seq.mm_placeholders if offset < end and start < offset + length)


def leading_null_blocks(table: list[int]) -> int:
    """How many of the table's first entries were freed behind a sliding window (they are always a leading run)."""
    return bisect.bisect_left(table, True, key=lambda block: block != NULL_BLOCK)


@dataclass
class BlockManagerStats:
    num_cow_copies: int = 0
    num_swap_outs: int = 0  # groups swapped out
    num_swap_ins: int = 0
    num_swapped_out_blocks: int = 0  # blocks moved to CPU, cumulative
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # prompt tokens found cached


@dataclass
class BlockManager:
    """Owns the device pool, the CPU swap pool, and every sequence's block table."""

    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int = 0
    enable_caching: bool = False
    watermark: float = 0.01
    # Every attention layer sees only its last `sliding_window` keys: blocks wholly before the window of a
    # sequence's next query are freed (their entries become NULL_BLOCK), so a sequence holds about W tokens of
    # blocks however long it grows (vLLM's SlidingWindowManager). None: full attention, nothing freed early.
    sliding_window: int | None = None
    gpu_pool: BlockPool = field(init=False)
    cpu_pool: BlockPool = field(init=False)
    block_tables: dict[int, list[int]] = field(init=False, default_factory=dict)
    cpu_block_tables: dict[int, list[int]] = field(init=False, default_factory=dict)
    # Hashes of each sequence's full blocks, in order (prefix caching).
    _seq_block_hashes: dict[int, list[int]] = field(init=False, default_factory=dict)
    stats: BlockManagerStats = field(init=False, default_factory=BlockManagerStats)

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens or None, got {self.sliding_window}")
        self.gpu_pool = BlockPool(self.num_gpu_blocks, enable_caching=self.enable_caching)
        self.cpu_pool = BlockPool(self.num_cpu_blocks)
        self.watermark_blocks = int(self.watermark * self.num_gpu_blocks)

    # -- queries ----------------------------------------------------------------------------
    def get_num_free_gpu_blocks(self) -> int:
        return self.gpu_pool.get_num_free_blocks()

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.get_num_free_blocks()

    def get_block_table(self, seq: Sequence) -> list[int]:
        return self.block_tables.get(seq.seq_id, [])

    def num_blocks_to_grow(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `allocate_slots(seq, num_new_tokens)` would take, counting copy-on-write."""
        bs = self.block_size
        computed = seq.num_computed_tokens
        needed = (computed + num_new_tokens + bs - 1) // bs
        table = self.block_tables.get(seq.seq_id)
        if not table:
            return needed
        have = len(table)
        refs = self.gpu_pool.ref_counts
        cow = 0
        for i in range(computed // bs, have if have < needed else needed):  # the blocks written into
            if refs[table[i]] > 1:
                cow += 1
        return (needed - have if needed > have else 0) + cow

    def can_allocate(self, num_blocks: int, for_new_request: bool) -> bool:
        """Whether `num_blocks` can be taken now; new requests must leave the watermark free."""
        reserve = self.watermark_blocks if for_new_request else 0
        return self.get_num_free_gpu_blocks() - num_blocks >= reserve

    def can_admit(self, group: SequenceGroup, num_blocks: int) -> AllocStatus:
        """Whether a waiting group whose first step needs `num_blocks` blocks can start now."""
        if self.can_allocate(num_blocks, for_new_request=True):
            return AllocStatus.OK
        if num_blocks > self.num_gpu_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        return AllocStatus.LATER

    def check_admissible(self, group: SequenceGroup) -> None:
        """Paged memory admits any request whose prompt fits max_model_len (checked by the engine)."""

    def admit(self, group: SequenceGroup) -> None:
        """Paged memory reserves nothing at admission: blocks come as tokens are computed."""

    # -- allocate / append with copy-on-write -----------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for `num_new_tokens` KV entries after the computed ones.

        Returns the copy-on-write copies (src, dst) the worker must do before the step.
        """
        table = self.block_tables.setdefault(seq.seq_id, [])
        bs = self.block_size
        needed = (seq.num_computed_tokens + num_new_tokens + bs - 1) // bs
        pool = self.gpu_pool
        refs = pool.ref_counts
        copies: list[tuple[int, int]] = []
        for i in range(seq.num_computed_tokens // bs, min(len(table), needed)):
            old = table[i]
            if refs[old] > 1:
                new = pool.allocate()
                pool.decref(old)
                table[i] = new
                copies.append((old, new))
        if copies:
            self.stats.num_cow_copies += len(copies)
        if self.sliding_window is not None:
            self._free_outside_window(seq, table)
        while len(table) < needed:
            table.append(pool.allocate())
        return copies

    def _free_outside_window(self, seq: Sequence, table: list[int]) -> None:
        """Free the blocks that the step's first query (position num_computed_tokens) and every later one can no
        longer see: it reads keys after position - W, so block i goes once its last slot is before that."""
        first_seen = max(0, seq.num_computed_tokens - self.sliding_window + 1) // self.block_size
        i = min(first_seen, len(table)) - 1
        while i >= 0 and table[i] != NULL_BLOCK:  # entries before the first NULL_BLOCK went in earlier steps
            self.gpu_pool.decref(table[i])
            table[i] = NULL_BLOCK
            i -= 1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (no KV bytes move)."""
        table = self.block_tables.get(parent.seq_id, [])
        for block in table:
            if block != NULL_BLOCK:
                self.gpu_pool.incref(block)
        self.block_tables[child.seq_id] = list(table)
        if parent.seq_id in self._seq_block_hashes:
            self._seq_block_hashes[child.seq_id] = list(self._seq_block_hashes[parent.seq_id])

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references on whichever pool holds it."""
        table = self.block_tables.pop(seq.seq_id, None)
        if table is not None:
            # Free tail first so that, under LRU eviction, a prefix outlives its suffix.
            for block in reversed(table):
                if block != NULL_BLOCK:
                    self.gpu_pool.decref(block)
        cpu_table = self.cpu_block_tables.pop(seq.seq_id, None)
        if cpu_table is not None:
            for block in cpu_table:
                if block != NULL_BLOCK:
                    self.cpu_pool.decref(block)
        self._seq_block_hashes.pop(seq.seq_id, None)

    # -- prefix caching ---------------------------------------------------------------------
    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Point a fresh sequence's table at its longest cached prefix; returns tokens reused.

        Only full blocks strictly before the last token count, so at least one token is
        computed and the step has a query to sample from.
        """
        if not self.enable_caching or seq.seq_id in self.block_tables:
            return 0
        max_blocks = (seq.get_len() - 1) // self.block_size
        hashes = self._block_hashes_upto(seq, max_blocks)
        table: list[int] = []
        for i, block_hash in enumerate(hashes):
            tokens = tuple(seq.tokens_slice(i * self.block_size, (i + 1) * self.block_size))
            block = self.gpu_pool.lookup(block_hash, tokens)
            if block is None:
                break
            self.gpu_pool.incref(block)
            table.append(block)
        self.block_tables[seq.seq_id] = table
        return len(table) * self.block_size

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, as vLLM's ``reset_prefix_cache``: only while no device block is in use (a
        running sequence's full blocks would be cached again by its next step); False, changing nothing, otherwise."""
        if self.get_num_free_gpu_blocks() != self.num_gpu_blocks:
            return False
        self.gpu_pool.reset_prefix_cache()
        return True

    def record_prefix_lookup(self, seq: Sequence, hit_tokens: int) -> None:
        """Count one admitted lookup (a request that waits and retries is counted once)."""
        if self.enable_caching:
            self.stats.prefix_cache_queries += seq.get_len()
            self.stats.prefix_cache_hits += hit_tokens

    def num_cached_prefix_blocks(self, seq: Sequence) -> int:
        """How many leading blocks of `seq` are in the prefix cache now (no side effects)."""
        if not self.enable_caching:
            return 0
        max_blocks = (seq.get_len() - 1) // self.block_size
        hashes = self._block_hashes_upto(seq, max_blocks)
        n = 0
        for i, block_hash in enumerate(hashes):
            tokens = tuple(seq.tokens_slice(i * self.block_size, (i + 1) * self.block_size))
            if self.gpu_pool.lookup(block_hash, tokens) is None:
                break
            n += 1
        return n

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly completed full blocks in the prefix cache."""
        if not self.enable_caching:
            return
        table = self.block_tables.get(seq.seq_id)
        if not table:
            return
        n_full = min(seq.num_computed_tokens // self.block_size, len(table))
        hashes = self._block_hashes_upto(seq, n_full)
        for i in range(n_full):
            if table[i] != NULL_BLOCK and self.gpu_pool.block_hash(table[i]) is None:
                tokens = tuple(seq.tokens_slice(i * self.block_size, (i + 1) * self.block_size))
                self.gpu_pool.cache_block(table[i], hashes[i], tokens)

    def _block_hashes_upto(self, seq: Sequence, n_blocks: int) -> list[int]:
        hashes = self._seq_block_hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        while len(hashes) < n_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else (None if seq.cache_salt is None else hash_cache_salt(seq.cache_salt))
            extra = _mm_extra_keys(seq, i * bs, (i + 1) * bs) if seq.mm_placeholders else ()
            hashes.append(hash_block_tokens(parent, tuple(seq.tokens_slice(i * bs, (i + 1) * bs)), extra))
        return hashes[:n_blocks]

    # -- swapping ---------------------------------------------------------------------------
    def _group_blocks(self, tables: dict[int, list[int]], group: SequenceGroup) -> set[int]:
        return {b for s in group.unfinished_seqs() for b in tables.get(s.seq_id, []) if b != NULL_BLOCK}

    def can_swap_out(self, group: SequenceGroup) -> bool:
        return len(self._group_blocks(self.block_tables, group)) <= self.get_num_free_cpu_blocks()

    def can_swap_in(self, group: SequenceGroup, num_extra_blocks: int = 0) -> bool:
        needed = len(self._group_blocks(self.cpu_block_tables, group)) + num_extra_blocks
        return self.can_allocate(needed, for_new_request=False)

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's blocks to the CPU pool; shared blocks move once."""
        mapping = self._move(group, self.block_tables, self.cpu_block_tables, self.gpu_pool, self.cpu_pool)
        self.stats.num_swap_outs += 1
        self.stats.num_swapped_out_blocks += len(mapping)
        return mapping

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        mapping = self._move(group, self.cpu_block_tables, self.block_tables, self.cpu_pool, self.gpu_pool)
        self.stats.num_swap_ins += 1
        return mapping

    @staticmethod
    def _move(
        group: SequenceGroup,
        src_tables: dict[int, list[int]],
        dst_tables: dict[int, list[int]],
        src_pool: BlockPool,
        dst_pool: BlockPool,
    ) -> list[tuple[int, int]]:
        mapping: dict[int, int] = {}
        for seq in group.unfinished_seqs():
            src_table = src_tables.pop(seq.seq_id, [])
            dst_table = []
            for block in src_table:
                if block == NULL_BLOCK:
                    dst_table.append(NULL_BLOCK)
                    continue
                if block in mapping:
                    dst_pool.incref(mapping[block])
                else:
                    mapping[block] = dst_pool.allocate()
                dst_table.append(mapping[block])
                src_pool.decref(block)
            dst_tables[seq.seq_id] = dst_table
        return list(mapping.items())

    # -- introspection ----------------------------------------------------------------------
    def num_shared_blocks(self) -> int:
        return sum(1 for c in self.gpu_pool.ref_counts if c > 1)

    def num_blocks_saved_by_sharing(self) -> int:
        return sum(c - 1 for c in self.gpu_pool.ref_counts if c > 1)

    def check_invariants(self) -> None:
        """Refcounts equal the number of tables pointing at each block, on both pools."""
        for pool, tables in ((self.gpu_pool, self.block_tables), (self.cpu_pool, self.cpu_block_tables)):
            pool.check_invariants()
            counts = [0] * pool.num_blocks
            for table in tables.values():
                for block in table:
                    if block != NULL_BLOCK:
                        counts[block] += 1
            if counts != pool.ref_counts:
                bad = [b for b in range(pool.num_blocks) if counts[b] != pool.ref_counts[b]]
                raise RuntimeError(f"refcount mismatch on blocks {bad[:10]}")
