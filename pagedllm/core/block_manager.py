"""Block tables: logical → physical block maps per sequence, on the device pool or the CPU pool.

The three primitives every decoding algorithm is built from (paper §5.2):
``fork`` (copy a table, bump refcounts), ``allocate_slots`` (grow a table; copy-on-write a shared
block before writing into it) and ``free``. Swapping moves whole sequence groups between pools.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from pagedllm.core.block_pool import BlockPool, hash_block_tokens, hash_cache_salt
from pagedllm.core.interfaces import AllocStatus
from pagedllm.core.kv_offload import OffloadTier
from pagedllm.core.sequence import Sequence, SequenceGroup
from pagedllm.core.state_snapshots import StateSnapshotStore


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
    """Owns the device pool, the CPU swap pool, and every sequence's block tables (one per KV cache group)."""

    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int = 0
    enable_caching: bool = False
    watermark: float = 0.01
    # Every attention layer sees only its last `sliding_window` keys: blocks wholly before the window of a
    # sequence's next query are freed (their entries become NULL_BLOCK), so a sequence holds about W tokens of
    # blocks however long it grows (vLLM's SlidingWindowManager). None: full attention, nothing freed early.
    sliding_window: int | None = None
    # Hybrid models (core/kv_cache_groups.py): the window of each KV cache group (None: full attention). Every
    # group has a table per sequence over the one shared pool; a sliding group frees its blocks behind its window.
    # None: one group with `sliding_window`.
    group_windows: tuple[int | None, ...] | None = None
    # Blocks of the CPU tier under the prefix cache (core/kv_offload.py; vLLM's kv_offloading_size): evicted cached
    # blocks are kept there and copied back on a prefix hit. 0: no tier.
    num_offload_blocks: int = 0
    # Models with state-space (Mamba) layers: one recurrent-state slot per running sequence, taken when the sequence
    # first gets slots and given back when it is freed (a fork starts from a copy of its parent's state: see
    # `take_state_copies`). 0: the model keeps no such state.
    num_state_slots: int = 0
    # Prefix caching for such models (core/state_snapshots.py): snapshot slots after the sequences' slots, one
    # snapshot every `state_snapshot_interval` tokens (a multiple of block_size). 0: prefix hits need no state.
    num_state_snapshots: int = 0
    state_snapshot_interval: int = 0
    gpu_pool: BlockPool = field(init=False)
    cpu_pool: BlockPool = field(init=False)
    # tables[g][seq_id]: group g's table; block_tables / cpu_block_tables are group 0's (the full-attention
    # group of a hybrid model: the one holding every block of the context).
    tables: list[dict[int, list[int]]] = field(init=False)
    cpu_tables: list[dict[int, list[int]]] = field(init=False)
    # Hashes of each sequence's full blocks, in order (prefix caching).
    _seq_block_hashes: dict[int, list[int]] = field(init=False, default_factory=dict)
    # A number per sequence that changes whenever its device tables change other than by blocks appended at the end
    # or entries freed behind a sliding window (a new table, copy-on-write, truncation, swap): the worker keeps each
    # sequence's tables as persistent rows and copies only new entries while the version holds
    # (worker/block_table_rows.py). A freed entry may stay as its old block id there: no query reads it again.
    table_versions: dict[int, int] = field(init=False, default_factory=dict)
    # Prefix caching: (table version, leading blocks registered) per sequence (cache_computed_blocks).
    _cached_upto: dict[int, tuple[int, int]] = field(init=False, default_factory=dict)
    # num_blocks_to_grow found nothing for allocate_slots to do: seq_id → (computed tokens, new tokens, version,
    # table length, the pool's incref count) it saw. allocate_slots with the same returns at once (the scheduler asks
    # both for every running sequence every step, and most decode steps change no table).
    _unchanged: dict[int, tuple[int, int, int | None, int, int]] = field(init=False, default_factory=dict)
    _versions: itertools.count = field(init=False, default_factory=lambda: itertools.count(1))
    stats: BlockManagerStats = field(init=False, default_factory=BlockManagerStats)

    def __post_init__(self) -> None:
        if self.group_windows is None:
            self.group_windows = (self.sliding_window,)
        elif self.sliding_window is not None:
            raise ValueError("give sliding_window (one group) or group_windows (a hybrid model's), not both")
        self.group_windows = tuple(self.group_windows)
        if not self.group_windows:
            raise ValueError("group_windows needs at least one KV cache group")
        for window in self.group_windows:
            if window is not None and window < 1:
                raise ValueError(f"sliding_window must be a positive number of tokens or None, got {window}")
        self.num_groups = len(self.group_windows)
        self.gpu_pool = BlockPool(self.num_gpu_blocks, enable_caching=self.enable_caching)
        self.cpu_pool = BlockPool(self.num_cpu_blocks)
        self.watermark_blocks = int(self.watermark * self.num_gpu_blocks)
        self.tables = [{} for _ in self.group_windows]
        self.cpu_tables = [{} for _ in self.group_windows]
        self._free_state_slots = list(range(self.num_state_slots - 1, -1, -1))
        self.state_slots: dict[int, int] = {}
        self._state_copies: list[tuple[int, int]] = []
        self.snapshots: StateSnapshotStore | None = None
        self._snapshot_source: dict[int, int] = {}  # seq_id → the snapshot its slot starts from (a prefix hit)
        # seq_id → a shared-prefix point: where its cached blocks end but no snapshot holds the state. The sequence
        # recomputes up to there anyway; a snapshot written as it passes lets the next one with that prefix resume.
        self._branch_points: dict[int, int] = {}
        if self.num_state_snapshots:
            if not (self.enable_caching and self.num_state_slots):
                raise ValueError("state snapshots serve prefix caching of a model with recurrent-state slots: they "
                                 "need enable_caching and num_state_slots")
            if self.state_snapshot_interval < 1 or self.state_snapshot_interval % self.block_size:
                raise ValueError(f"state_snapshot_interval must be a positive multiple of block_size "
                                 f"{self.block_size}, got {self.state_snapshot_interval}")
            self.snapshots = StateSnapshotStore(self.num_state_slots, self.num_state_snapshots,
                                                self.state_snapshot_interval)
        self.offload: OffloadTier | None = None
        if self.num_offload_blocks:
            if not self.enable_caching:
                raise ValueError("KV offloading keeps evicted prefix-cache blocks on the CPU: it needs "
                                 "enable_prefix_caching=True")
            if self.group_windows != (None,):
                raise ValueError("KV offloading serves models whose layers all attend to the whole context; this "
                                 f"one has sliding windows {self.group_windows}")
            self.offload = OffloadTier(self.num_offload_blocks, base=self.num_cpu_blocks)
            self.gpu_pool.on_evict = self.offload.store

    @property
    def block_tables(self) -> dict[int, list[int]]:
        return self.tables[0]

    @property
    def cpu_block_tables(self) -> dict[int, list[int]]:
        return self.cpu_tables[0]

    # -- queries ----------------------------------------------------------------------------
    def get_num_free_gpu_blocks(self) -> int:
        return self.gpu_pool.get_num_free_blocks()

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.get_num_free_blocks()

    def get_block_table(self, seq: Sequence) -> list[int]:
        return self.block_tables.get(seq.seq_id, [])

    def get_block_tables(self, seq: Sequence) -> list[list[int]]:
        """The sequence's table in every KV cache group, in group order."""
        return [tables.get(seq.seq_id, []) for tables in self.tables]

    def table_version(self, seq: Sequence) -> int | None:
        """The version of the sequence's device tables (see `table_versions`); None while it has none."""
        return self.table_versions.get(seq.seq_id)

    def _new_table_version(self, seq_id: int) -> None:
        self.table_versions[seq_id] = next(self._versions)

    def num_blocks_to_grow(self, seq: Sequence, num_new_tokens: int) -> int:
        """Net blocks `allocate_slots(seq, num_new_tokens)` would take from the pool in all groups: new blocks and
        copy-on-write copies, less the blocks it frees behind a sliding window."""
        # (Runs for every scheduled sequence every step, in every group: the window's loop is inlined.)
        bs = self.block_size
        computed = seq.num_computed_tokens
        needed = (computed + num_new_tokens + bs - 1) // bs
        refs = self.gpu_pool.ref_counts
        sid = seq.seq_id
        total = 0
        changes = False
        for window, tables in zip(self.group_windows, self.tables):
            table = tables.get(sid)
            if not table:
                total += needed
                changes = True
                continue
            have = len(table)
            if needed > have:
                total += needed - have
                changes = True
            for i in range(computed // bs, have if have < needed else needed):  # the blocks written into
                if refs[table[i]] > 1:
                    total += 1
                    changes = True
            if window is not None:  # the live blocks allocate_slots frees behind the window
                i = min((computed - window + 1) // bs if computed >= window else 0, have) - 1  # _first_seen_block
                while i >= 0 and table[i] != NULL_BLOCK:
                    changes = True
                    if refs[table[i]] == 1:
                        total -= 1
                    i -= 1
        if changes:
            self._unchanged.pop(sid, None)
        else:
            self._unchanged[sid] = (computed, num_new_tokens, self.table_versions.get(sid), len(self.tables[0][sid]),
                                    self.gpu_pool.num_increfs)
        return total

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
        bs = self.block_size
        computed = seq.num_computed_tokens
        needed = (computed + num_new_tokens + bs - 1) // bs
        pool = self.gpu_pool
        refs = pool.ref_counts
        sid = seq.seq_id
        if self.num_state_slots and sid not in self.state_slots:
            self.state_slots[sid] = slot = self._take_state_slot()
            source = self._snapshot_source.pop(sid, None)
            if source is not None:
                self._state_copies.append((source, slot))
        seen = self._unchanged.pop(sid, None)
        version = self.table_versions.get(sid)
        if seen is not None and seen == (computed, num_new_tokens, version, len(self.tables[0].get(sid, ())),
                                         pool.num_increfs):
            return []  # nothing to copy, free or append (only references may have gone since: no copy needed)
        copies: list[tuple[int, int]] = []
        if version is None:
            self._new_table_version(sid)
        for window, tables in zip(self.group_windows, self.tables):
            table = tables.get(sid)
            if table is None:
                table = tables[sid] = []
            have = len(table)
            for i in range(computed // bs, have if have < needed else needed):
                old = table[i]
                if refs[old] > 1:
                    new = pool.allocate()
                    pool.decref(old)
                    table[i] = new
                    copies.append((old, new))
            if window is not None:
                # Blocks wholly before the window of the step's first query (position `computed`) and every later
                # one: it reads keys after position - W. Entries before the first NULL_BLOCK went in earlier steps.
                i = min((computed - window + 1) // bs if computed >= window else 0, have) - 1  # _first_seen_block
                while i >= 0 and table[i] != NULL_BLOCK:
                    pool.decref(table[i])
                    table[i] = NULL_BLOCK
                    i -= 1
            while len(table) < needed:
                table.append(pool.allocate())
        if copies:
            self.stats.num_cow_copies += len(copies)
            self._new_table_version(sid)
        return copies

    def truncate(self, seq: Sequence, num_blocks: int) -> None:
        """Keep the first `num_blocks` entries of every group's table (speculative decoding gives back the blocks
        that held only rejected drafts)."""
        for tables in self.tables:
            table = tables.get(seq.seq_id)
            if table is not None and len(table) > num_blocks:
                self._new_table_version(seq.seq_id)
            while table is not None and len(table) > num_blocks:
                block = table.pop()
                if block != NULL_BLOCK:
                    self.gpu_pool.decref(block)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (no KV bytes move)."""
        for tables in self.tables:
            table = tables.get(parent.seq_id, [])
            for block in table:
                if block != NULL_BLOCK:
                    self.gpu_pool.incref(block)
            tables[child.seq_id] = list(table)
        self._new_table_version(child.seq_id)
        parent_slot = self.state_slots.get(parent.seq_id)
        if parent_slot is not None:
            self.state_slots[child.seq_id] = child_slot = self._take_state_slot()
            self._state_copies.append((parent_slot, child_slot))
        if parent.seq_id in self._seq_block_hashes:
            self._seq_block_hashes[child.seq_id] = list(self._seq_block_hashes[parent.seq_id])

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references on whichever pool holds it."""
        for tables in self.tables:
            table = tables.pop(seq.seq_id, None)
            if table is not None:
                # Free tail first so that, under LRU eviction, a prefix outlives its suffix.
                for block in reversed(table):
                    if block != NULL_BLOCK:
                        self.gpu_pool.decref(block)
        for tables in self.cpu_tables:
            cpu_table = tables.pop(seq.seq_id, None)
            if cpu_table is not None:
                for block in cpu_table:
                    if block != NULL_BLOCK:
                        self.cpu_pool.decref(block)
        slot = self.state_slots.pop(seq.seq_id, None)
        if slot is not None:
            self._free_state_slots.append(slot)
        if self.snapshots is not None:
            self.snapshots.drop(seq.seq_id)
            self._snapshot_source.pop(seq.seq_id, None)
            self._branch_points.pop(seq.seq_id, None)
        self._seq_block_hashes.pop(seq.seq_id, None)
        self.table_versions.pop(seq.seq_id, None)
        self._cached_upto.pop(seq.seq_id, None)
        self._unchanged.pop(seq.seq_id, None)

    # -- recurrent state slots (state-space layers) -----------------------------------------
    def _take_state_slot(self) -> int:
        if not self._free_state_slots:
            # The scheduler runs at most max_num_seqs sequences and preempts by recompute (which frees the slot),
            # so the pool of max_num_seqs slots cannot run dry unless that invariant broke.
            raise RuntimeError(f"all {self.num_state_slots} recurrent-state slots are taken: more sequences are "
                               "running than max_num_seqs allows")
        return self._free_state_slots.pop()

    def state_slot(self, seq: Sequence) -> int | None:
        """The recurrent-state slot the sequence owns (None: the model has no state-space layers, or none yet)."""
        return self.state_slots.get(seq.seq_id)

    def take_state_copies(self) -> list[tuple[int, int]]:
        """(parent slot, child slot) of every fork since the last call: the worker copies these states before the
        next step runs, so a child continues from its parent's state."""
        copies, self._state_copies = self._state_copies, []
        return copies

    def plan_state_snapshots(self, seq: Sequence, num_new_tokens: int, num_known: int) -> list[tuple[int, int]]:
        """The state snapshots the step scheduling `num_new_tokens` of `seq` must write: (offset in the step's chunk,
        snapshot slot) for each snapshot point it crosses, where the tokens before the point are known on the host
        (`num_known` of the chunk's; a token still on the device cannot be hashed). [] without snapshots."""
        if self.snapshots is None:
            return []
        computed, step = seq.num_computed_tokens, self.state_snapshot_interval
        last = computed + min(num_new_tokens, num_known)
        points = list(range((computed // step + 1) * step, last + 1, step))
        branch = self._branch_points.get(seq.seq_id)
        if branch is not None and computed < branch <= last:
            del self._branch_points[seq.seq_id]
            if branch not in points:
                points = sorted([*points, branch])
        if not points:
            return []
        hashes = self._block_hashes_upto(seq, points[-1] // self.block_size)
        planned = self.snapshots.plan(seq.seq_id, [(p, hashes[p // self.block_size - 1]) for p in points])
        return [(position - computed, slot) for position, slot in planned]

    # -- prefix caching ---------------------------------------------------------------------
    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Point a fresh sequence's tables at its longest cached prefix; returns tokens reused.

        Only full blocks strictly before the last token count, so at least one token is
        computed and the step has a query to sample from.
        """
        if not self.enable_caching or seq.seq_id in self.block_tables:
            return 0
        n, hits = self._find_cached_blocks(seq)
        if self.snapshots is not None:
            cached = n
            n = self._state_resume_blocks(seq, cached)
            if n:
                self._snapshot_source[seq.seq_id] = self.snapshots.take(self._seq_block_hashes[seq.seq_id][n - 1])
            if cached > n:
                self._branch_points[seq.seq_id] = cached * self.block_size
        for window, tables, found in zip(self.group_windows, self.tables, hits):
            first = 0 if window is None else self._first_seen_block(n * self.block_size, window)
            table = [NULL_BLOCK] * first
            for i in range(first, n):
                block = found[i]
                self.gpu_pool.incref(block)
                table.append(block)
            tables[seq.seq_id] = table
        if self.offload is not None:
            n = self._load_offloaded_prefix(seq, self.tables[0][seq.seq_id], n)
        self._new_table_version(seq.seq_id)
        return n * self.block_size

    def _load_offloaded_prefix(self, seq: Sequence, table: list[int], n: int) -> int:
        """Extend a prefix of `n` device-cached blocks with the blocks that follow it in the CPU tier, each copied
        into a new device block (cached under its hash at once, so later lookups share it), while blocks are free
        beyond the watermark → the new prefix length in blocks."""
        max_blocks = (seq.get_len() - 1) // self.block_size
        if n >= max_blocks:
            return n
        hashes = self._block_hashes_upto(seq, max_blocks)
        bs, tier = self.block_size, self.offload
        start = n
        while n < max_blocks and self.can_allocate(1, for_new_request=True):
            tokens = tuple(seq.tokens_slice(n * bs, (n + 1) * bs))
            source = tier.lookup(hashes[n], tokens)
            if source is None:
                break
            tier.pool.incref(source)  # held while the device block is taken: that may store an evicted block
            block = self.gpu_pool.allocate()
            tier.load(source, block)
            tier.pool.decref(source)
            self.gpu_pool.cache_block(block, hashes[n], tokens)
            table.append(block)
            n += 1
        tier.stats.num_hit_tokens += (n - start) * bs
        return n

    def take_offload_moves(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The CPU tier's pending copies (swap-outs, swap-ins; CPU ids in the worker's CPU cache) for the next step
        to run before its forward pass; ([], []) without a tier."""
        if self.offload is None or not self.offload.has_moves():
            return [], []
        return self.offload.take_moves()

    def _first_seen_block(self, position: int, window: int) -> int:
        """The first block a query at `position` reads under a `window`-token window."""
        return max(0, position - window + 1) // self.block_size

    def _find_cached_prefix(self, seq: Sequence) -> tuple[int, list[dict[int, int]]]:
        """`_find_cached_blocks`, limited for a state-space model to where a snapshot holds the state. No side
        effects."""
        n, found = self._find_cached_blocks(seq)
        return (n if self.snapshots is None else self._state_resume_blocks(seq, n)), found

    def _state_resume_blocks(self, seq: Sequence, n: int) -> int:
        """The most leading blocks, at most `n`, after which a state snapshot is kept (on the interval's grid, or at
        a shared-prefix point): where a state-space model can resume."""
        hashes = self._block_hashes_upto(seq, n)
        return next((k for k in range(n, 0, -1) if self.snapshots.has(hashes[k - 1])), 0)

    def _find_cached_blocks(self, seq: Sequence) -> tuple[int, list[dict[int, int]]]:
        """(n, per group {block index: cached block}): the most leading full blocks n such that every group has
        cached what a query right after them reads: blocks 0..n-1 in a full-attention group, those within the
        window of position n * block_size in a sliding group (the ones before it were freed, or may have been
        evicted since). No side effects."""
        max_blocks = (seq.get_len() - 1) // self.block_size
        hashes = self._block_hashes_upto(seq, max_blocks)
        bs = self.block_size
        found: list[dict[int, int]] = [{} for _ in self.group_windows]
        missing: list[set[int]] = [set() for _ in self.group_windows]

        def cached(g: int, i: int) -> bool:
            if i in found[g]:
                return True
            if i in missing[g]:
                return False
            block = self.gpu_pool.lookup(self._group_hash(g, hashes[i]), tuple(seq.tokens_slice(i * bs, (i + 1) * bs)))
            if block is None:
                missing[g].add(i)
                return False
            found[g][i] = block
            return True

        n = max_blocks
        settled = False
        while n > 0 and not settled:
            settled = True
            for g, window in enumerate(self.group_windows):
                first = 0 if window is None else self._first_seen_block(n * bs, window)
                # Checking from the end: a miss at block j rules out every n' in (j, n] (their ranges hold j).
                j = next((i for i in range(n - 1, first - 1, -1) if not cached(g, i)), None)
                if j is not None:
                    n, settled = j, False
                    break
        return n, found

    def _group_hash(self, group: int, block_hash: int) -> int:
        """Group `group`'s key for a block of content `block_hash`: each group caches its own copy of a block."""
        return block_hash if group == 0 else hash_block_tokens(block_hash, (), (f"kv-cache-group {group}",))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, as vLLM's ``reset_prefix_cache``: only while no device block is in use (a
        running sequence's full blocks would be cached again by its next step); False, changing nothing, otherwise."""
        if self.get_num_free_gpu_blocks() != self.num_gpu_blocks:
            return False
        self.gpu_pool.reset_prefix_cache()
        if self.offload is not None:
            self.offload.reset()
        if self.snapshots is not None:
            self.snapshots.reset()
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
        return self._find_cached_prefix(seq)[0]

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly completed full blocks in the prefix cache."""
        if not self.enable_caching:
            return
        # Blocks before `done` were registered by an earlier call under the same table version (a registered block
        # keeps its hash while a table holds it): each step looks at its new full blocks only.
        version = self.table_versions.get(seq.seq_id)
        seen_version, done = self._cached_upto.get(seq.seq_id, (None, 0))
        if seen_version != version:
            done = 0
        n_full = seq.num_computed_tokens // self.block_size
        for g, tables in enumerate(self.tables):
            table = tables.get(seq.seq_id)
            if not table:
                continue
            n = min(n_full, len(table))
            if n <= done:
                continue
            hashes = self._block_hashes_upto(seq, n)
            for i in range(done, n):
                if table[i] != NULL_BLOCK and self.gpu_pool.block_hash(table[i]) is None:
                    tokens = tuple(seq.tokens_slice(i * self.block_size, (i + 1) * self.block_size))
                    self.gpu_pool.cache_block(table[i], self._group_hash(g, hashes[i]), tokens)
        if version is not None:
            lengths = [len(t.get(seq.seq_id, ())) for t in self.tables]
            self._cached_upto[seq.seq_id] = (version, min(n_full, *lengths))
        if self.snapshots is not None:
            self.snapshots.publish(seq.seq_id, seq.num_computed_tokens)

    def _block_hashes_upto(self, seq: Sequence, n_blocks: int) -> list[int]:
        """The sequence's block hashes, at least its first `n_blocks` (the list itself: read, do not change it)."""
        hashes = self._seq_block_hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        while len(hashes) < n_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else (None if seq.cache_salt is None else hash_cache_salt(seq.cache_salt))
            extra = _mm_extra_keys(seq, i * bs, (i + 1) * bs) if seq.mm_placeholders else ()
            hashes.append(hash_block_tokens(parent, tuple(seq.tokens_slice(i * bs, (i + 1) * bs)), extra))
        return hashes

    # -- swapping ---------------------------------------------------------------------------
    def _group_blocks(self, tables: list[dict[int, list[int]]], group: SequenceGroup) -> set[int]:
        return {b for t in tables for s in group.unfinished_seqs() for b in t.get(s.seq_id, []) if b != NULL_BLOCK}

    def can_swap_out(self, group: SequenceGroup) -> bool:
        return len(self._group_blocks(self.tables, group)) <= self.get_num_free_cpu_blocks()

    def can_swap_in(self, group: SequenceGroup, num_extra_blocks: int = 0) -> bool:
        needed = len(self._group_blocks(self.cpu_tables, group)) + num_extra_blocks
        return self.can_allocate(needed, for_new_request=False)

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's blocks to the CPU pool; shared blocks move once."""
        mapping = self._move(group, self.tables, self.cpu_tables, self.gpu_pool, self.cpu_pool)
        for seq in group.unfinished_seqs():
            self.table_versions.pop(seq.seq_id, None)
        self.stats.num_swap_outs += 1
        self.stats.num_swapped_out_blocks += len(mapping)
        return mapping

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        mapping = self._move(group, self.cpu_tables, self.tables, self.cpu_pool, self.gpu_pool)
        for seq in group.unfinished_seqs():
            self._new_table_version(seq.seq_id)
        self.stats.num_swap_ins += 1
        return mapping

    @staticmethod
    def _move(
        group: SequenceGroup,
        src_tables: list[dict[int, list[int]]],
        dst_tables: list[dict[int, list[int]]],
        src_pool: BlockPool,
        dst_pool: BlockPool,
    ) -> list[tuple[int, int]]:
        mapping: dict[int, int] = {}
        for src, dst in zip(src_tables, dst_tables):
            for seq in group.unfinished_seqs():
                src_table = src.pop(seq.seq_id, [])
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
                dst[seq.seq_id] = dst_table
        return list(mapping.items())

    # -- introspection ----------------------------------------------------------------------
    def num_shared_blocks(self) -> int:
        return sum(1 for c in self.gpu_pool.ref_counts if c > 1)

    def num_blocks_saved_by_sharing(self) -> int:
        return sum(c - 1 for c in self.gpu_pool.ref_counts if c > 1)

    def check_invariants(self) -> None:
        """Refcounts equal the number of tables pointing at each block, on both pools (the CPU tier's: no block
        referenced once its copies were handed to a step)."""
        if self.offload is not None:
            self.offload.pool.check_invariants()
            if not self.offload.has_moves() and any(self.offload.pool.ref_counts):
                raise RuntimeError("a KV offloading tier block is still pinned with no copy pending")
        for pool, group_tables in ((self.gpu_pool, self.tables), (self.cpu_pool, self.cpu_tables)):
            pool.check_invariants()
            counts = [0] * pool.num_blocks
            for table in (t for tables in group_tables for t in tables.values()):
                for block in table:
                    if block != NULL_BLOCK:
                        counts[block] += 1
            if counts != pool.ref_counts:
                bad = [b for b in range(pool.num_blocks) if counts[b] != pool.ref_counts[b]]
                raise RuntimeError(f"refcount mismatch on blocks {bad[:10]}")
        slots = list(self.state_slots.values())
        if len(set(slots)) != len(slots) or len(slots) + len(self._free_state_slots) != self.num_state_slots:
            raise RuntimeError(f"recurrent-state slots leaked or shared: {len(slots)} owned, "
                               f"{len(self._free_state_slots)} free of {self.num_state_slots}")
        if self.snapshots is not None:
            self.snapshots.check_invariants()
