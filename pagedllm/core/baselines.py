"""Contiguous-reservation KV managers: the paper's Orca baselines (§6.1), in the same engine.

Orca-style systems reserve, when a request is admitted, one contiguous chunk of KV memory per
sequence for the longest it might grow (§3, Fig. 3). ``ContiguousBlockManager`` does exactly that on
the same block pool the paged ``BlockManager`` uses, so the scheduler loop, the model and the attention
kernels stay the same and only memory management differs:

* a sequence's reservation is ONE region of consecutive block ids placed by a buddy allocator
  (``core/buddy.py``: ``2 ** ceil(log2 n)`` blocks for a request of ``n``); its block table is the run
  ``[start, start + 1, ...]`` of that region, grown as tokens are computed, so the kernels keep reading
  through block tables;
* how much is reserved is the policy (``reservation_tokens``), capped at ``max_model_len``:

  - ``orca-oracle``: prompt + the request's true output length. The engine stores the request's
    ``max_tokens`` in ``group.extra["max_tokens"]``; the benchmarks send ``max_tokens`` together with
    ``ignore_eos=True``, which makes it the exact output length: that is how the Oracle knows it.
    Without ``ignore_eos`` it is an upper bound (a request may stop earlier at EOS);
  - ``orca-pow2``: prompt + the output length rounded up to a power of two (25 → 32);
  - ``orca-max``: ``max_model_len`` (the paper: 2048);

* a request is admitted only when a region for every sequence it may run (``best_of`` / the beam width)
  fits at once; nothing is shared, paged, swapped or cached, and growth happens inside the region, so
  these managers never preempt;
* parallel sampling and beam search: the group's spare regions are reserved at admission; a fork takes
  one and copies the parent's filled blocks into it (``blocks_to_copy``: the KV bytes really move, which
  is the baseline's cost), a sequence that finishes or a beam that dies gives its region back to the
  group, and the group's regions return to the pool when its last sequence is freed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.block_manager import BlockManagerStats, cdiv
from pagedllm.core.buddy import BuddyAllocator
from pagedllm.core.interfaces import AllocStatus
from pagedllm.core.sequence import Sequence, SequenceGroup

CONTIGUOUS_POLICIES = ("orca-oracle", "orca-pow2", "orca-max")


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << max(0, n - 1).bit_length()


def output_len(group: SequenceGroup, max_model_len: int) -> int:
    """The request's output length as the engine knows it: ``max_tokens`` (see the module docstring)."""
    max_tokens = group.extra.get("max_tokens")
    if max_tokens is None:
        max_tokens = getattr(group.sampling_params, "max_tokens", None)
    if max_tokens is None:
        max_tokens = max_model_len - len(group.prompt_token_ids)
    return max(1, int(max_tokens))


def final_len(group: SequenceGroup, max_model_len: int) -> int:
    """Token slots a sequence of the group fills by its end: prompt + true output length, capped."""
    return min(len(group.prompt_token_ids) + output_len(group, max_model_len), max_model_len)


def reservation_tokens(policy: str, prompt_len: int, out_len: int, max_model_len: int) -> int:
    """Tokens one sequence reserves at admission under `policy` (capped at max_model_len)."""
    if policy == "orca-oracle":
        tokens = prompt_len + out_len
    elif policy == "orca-pow2":
        tokens = prompt_len + next_power_of_two(out_len)
    elif policy == "orca-max":
        tokens = max_model_len
    else:
        raise ValueError(f"kv_cache_manager must be one of {list(CONTIGUOUS_POLICIES)}, got {policy!r}.")
    return min(tokens, max_model_len)


@dataclass
class GroupReservation:
    """The regions one admitted request holds: one per sequence, plus spares for later forks."""

    request_id: str
    reserved_tokens: int  # per sequence, as the policy asked
    requested_blocks: int  # cdiv(reserved_tokens, block_size)
    region_blocks: int  # what the buddy allocator gave: the next power of two
    final_len: int  # prompt + true output length (for the Fig. 2 accounting)
    holders: dict[int, Sequence] = field(default_factory=dict)  # seq_id -> sequence with a region
    spares: list[int] = field(default_factory=list)  # region starts not held by a sequence

    @property
    def num_regions(self) -> int:
        return len(self.holders) + len(self.spares)


@dataclass
class _PendingFork:
    group_key: str
    parent_table: list[int]  # the parent's block ids at fork time
    num_filled_blocks: int  # blocks of the parent that hold computed KV


@dataclass
class ContiguousBlockManager:
    """Orca-style reservation on a buddy allocator; the Scheduler's `BlockManager` interface."""

    block_size: int
    num_gpu_blocks: int
    policy: str
    max_model_len: int
    num_cpu_blocks: int = 0  # no swap pool: these managers never preempt
    block_tables: dict[int, list[int]] = field(init=False, default_factory=dict)
    num_groups: int = field(init=False, default=1)  # one region serves every layer
    stats: BlockManagerStats = field(init=False, default_factory=BlockManagerStats)
    allocator: BuddyAllocator = field(init=False)
    groups: dict[str, GroupReservation] = field(init=False, default_factory=dict)
    num_fork_block_copies: int = field(init=False, default=0)  # KV blocks copied for forks, cumulative

    def __post_init__(self) -> None:
        if self.policy not in CONTIGUOUS_POLICIES:
            raise ValueError(f"kv_cache_manager must be one of {list(CONTIGUOUS_POLICIES)}, got {self.policy!r}.")
        self.allocator = BuddyAllocator(self.num_gpu_blocks)
        self.num_cpu_blocks = 0
        self._seq_group: dict[int, str] = {}
        self._seq_region: dict[int, int] = {}  # seq_id -> region start
        self._pending: dict[int, _PendingFork] = {}  # forked children without a region yet
        if self.policy == "orca-max":
            blocks = cdiv(self.max_model_len, self.block_size)
            if self.allocator.num_fitting_when_empty(blocks) < 1:
                raise ValueError(
                    f"kv_cache_manager='orca-max' reserves max_model_len={self.max_model_len} tokens per "
                    f"sequence: a region of {1 << (blocks - 1).bit_length()} blocks, but the KV pool has "
                    f"{self.num_gpu_blocks} blocks of {self.block_size} tokens; lower max_model_len or "
                    "enlarge the pool."
                )

    # -- reservation sizes ------------------------------------------------------------------
    def reservation_for(self, group: SequenceGroup) -> tuple[int, int, int]:
        """(reserved tokens, requested blocks, region blocks) for one sequence of `group`."""
        prompt_len = len(group.prompt_token_ids)
        tokens = reservation_tokens(self.policy, prompt_len, output_len(group, self.max_model_len),
                                    self.max_model_len)
        blocks = cdiv(tokens, self.block_size)
        return tokens, blocks, next_power_of_two(blocks)

    # -- queries ----------------------------------------------------------------------------
    def get_num_free_gpu_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def get_num_free_cpu_blocks(self) -> int:
        return 0

    def get_block_table(self, seq: Sequence) -> list[int]:
        return self.block_tables.get(seq.seq_id, [])

    def get_block_tables(self, seq: Sequence) -> list[list[int]]:
        """One KV cache group: a contiguous region serves every layer."""
        return [self.get_block_table(seq)]

    def table_version(self, seq: Sequence) -> int | None:
        """None: the worker rebuilds this manager's tables every step (they grow inside a reserved region)."""
        return None

    def num_blocks_to_grow(self, seq: Sequence, num_new_tokens: int) -> int:
        """Always 0: memory is reserved at admission (`can_admit`), growth stays inside the region."""
        return 0

    def can_allocate(self, num_blocks: int, for_new_request: bool) -> bool:
        return num_blocks <= self.allocator.num_free_blocks

    def can_admit(self, group: SequenceGroup, num_blocks: int) -> AllocStatus:
        """OK when a region for each sequence the group may run fits now; NEVER if not even in an
        empty pool. `num_blocks` (the paged first-step demand) plays no part."""
        _, blocks, _ = self.reservation_for(group)
        k = max(1, group.max_num_running_seqs())
        if self.allocator.num_fitting(blocks) >= k:
            return AllocStatus.OK
        if self.allocator.num_fitting_when_empty(blocks) < k:
            return AllocStatus.NEVER
        return AllocStatus.LATER

    def check_admissible(self, group: SequenceGroup) -> None:
        """Raise ValueError when the group's reservation cannot fit even in an empty pool."""
        tokens, blocks, region = self.reservation_for(group)
        k = max(1, group.max_num_running_seqs())
        if self.allocator.num_fitting_when_empty(blocks) < k:
            raise ValueError(
                f"kv_cache_manager={self.policy!r} reserves {tokens} tokens per sequence for this request "
                f"(a buddy region of {region} blocks of {self.block_size} tokens) for each of its {k} "
                f"sequences (n / best_of / beam width), but the KV pool of {self.num_gpu_blocks} blocks holds "
                f"{self.allocator.num_fitting_when_empty(blocks)} such regions; lower max_tokens, n or "
                "best_of, or enlarge the pool."
            )

    def group_demand_blocks(self, group: SequenceGroup) -> int:
        """Blocks the group asks for (before buddy rounding), all its sequences together."""
        _, blocks, _ = self.reservation_for(group)
        return blocks * max(1, group.max_num_running_seqs())

    # -- admission / growth / fork / free ---------------------------------------------------
    def admit(self, group: SequenceGroup) -> None:
        """Reserve every region of the group (call only after `can_admit` said OK)."""
        if group.request_id in self.groups:
            raise RuntimeError(f"request {group.request_id!r} already holds a reservation")
        tokens, blocks, region = self.reservation_for(group)
        seqs = group.unfinished_seqs()
        k = max(len(seqs), group.max_num_running_seqs())
        starts = []
        for _ in range(k):
            start = self.allocator.allocate(blocks)
            if start is None:
                for s in starts:
                    self.allocator.free(s)
                raise RuntimeError(f"request {group.request_id!r} was admitted but its {k} regions do not fit")
            starts.append(start)
        res = GroupReservation(group.request_id, tokens, blocks, region, final_len(group, self.max_model_len))
        for seq, start in zip(seqs, starts):
            res.holders[seq.seq_id] = seq
            self._seq_region[seq.seq_id] = start
            self._seq_group[seq.seq_id] = group.request_id
            self.block_tables[seq.seq_id] = []
        res.spares = starts[len(seqs):]
        self.groups[group.request_id] = res

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Extend the table inside the region; a forked child first gets its region and the copies
        (src, dst) of its parent's filled blocks, which the worker does before the step."""
        copies: list[tuple[int, int]] = []
        pending = self._pending.pop(seq.seq_id, None)
        if pending is not None:
            copies = self._place_child(seq, pending)
        if seq.seq_id not in self._seq_region:
            raise RuntimeError(f"sequence {seq.seq_id} was never admitted by the contiguous KV manager")
        res = self.groups[self._seq_group[seq.seq_id]]
        need = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        if need > res.requested_blocks:
            raise RuntimeError(
                f"sequence {seq.seq_id} needs {need} blocks but reserved {res.requested_blocks} "
                f"({self.policy}, {res.reserved_tokens} tokens)"
            )
        table = self.block_tables[seq.seq_id]
        start = self._seq_region[seq.seq_id]
        table.extend(range(start + len(table), start + need))
        return copies

    def _place_child(self, child: Sequence, pending: _PendingFork) -> list[tuple[int, int]]:
        res = self.groups[pending.group_key]
        if res.spares:
            start = res.spares.pop(0)
        else:
            start = self.allocator.allocate(res.requested_blocks)
            if start is None:
                raise RuntimeError("a forked sequence found no spare region in its group nor in the pool")
        self._seq_region[child.seq_id] = start
        table = list(range(start, start + len(pending.parent_table)))
        self.block_tables[child.seq_id] = table
        copies = [(pending.parent_table[i], table[i]) for i in range(pending.num_filled_blocks)
                  if pending.parent_table[i] != table[i]]
        self.num_fork_block_copies += len(copies)
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child gets its own region when it is next scheduled (by then beams that died this step
        have returned theirs); the parent's filled blocks are copied into it then."""
        key = self._seq_group.get(parent.seq_id)
        if key is None:
            raise RuntimeError(f"cannot fork sequence {parent.seq_id}: it holds no reservation")
        if parent.seq_id in self._pending:  # parent not placed yet: copy from its own source
            src = self._pending[parent.seq_id]
            fork = _PendingFork(key, list(src.parent_table), src.num_filled_blocks)
        else:
            fork = _PendingFork(key, list(self.block_tables[parent.seq_id]),
                                cdiv(parent.num_computed_tokens, self.block_size))
        self._pending[child.seq_id] = fork
        self._seq_group[child.seq_id] = key
        self.groups[key].holders[child.seq_id] = child
        self.block_tables[child.seq_id] = []

    def free(self, seq: Sequence) -> None:
        """Give the sequence's region back to its group; the last one out returns them all."""
        key = self._seq_group.pop(seq.seq_id, None)
        if key is None:
            return
        self.block_tables.pop(seq.seq_id, None)
        self._pending.pop(seq.seq_id, None)
        res = self.groups[key]
        res.holders.pop(seq.seq_id, None)
        start = self._seq_region.pop(seq.seq_id, None)
        if start is not None:
            res.spares.append(start)
        if not res.holders:
            for s in res.spares:
                self.allocator.free(s)
            del self.groups[key]

    # -- what contiguous reservation does not offer -----------------------------------------
    def allocate_cached_prefix(self, seq: Sequence) -> int:
        return 0

    def record_prefix_lookup(self, seq: Sequence, hit_tokens: int) -> None:
        return None

    def reset_prefix_cache(self) -> bool:
        return True  # nothing is cached

    def take_offload_moves(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        return [], []  # no KV offloading tier

    def take_state_copies(self) -> list[tuple[int, int]]:
        return []  # no recurrent-state slots (state-space models need the paged manager)

    def state_slot(self, seq: Sequence) -> int | None:
        return None

    def plan_state_snapshots(self, seq: Sequence, num_new_tokens: int, num_known: int) -> list[tuple[int, int]]:
        return []  # no prefix caching

    def cache_computed_blocks(self, seq: Sequence) -> None:
        return None

    def can_swap_out(self, group: SequenceGroup) -> bool:
        return False

    def can_swap_in(self, group: SequenceGroup, num_extra_blocks: int = 0) -> bool:
        return False

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        raise RuntimeError("contiguous KV managers do not swap")

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        raise RuntimeError("contiguous KV managers do not swap")

    def num_shared_blocks(self) -> int:
        return 0

    def num_blocks_saved_by_sharing(self) -> int:
        return 0

    # -- introspection ----------------------------------------------------------------------
    def region_of(self, seq: Sequence) -> int | None:
        """Start of the sequence's region (None before a forked child is placed)."""
        return self._seq_region.get(seq.seq_id)

    def check_invariants(self) -> None:
        """The buddy allocator is sound, every region it holds belongs to exactly one group (as a
        sequence's region or a spare), and every table is a run at its region's start."""
        self.allocator.check_invariants()
        owned: list[int] = []
        for key, res in self.groups.items():
            if not res.holders:
                raise RuntimeError(f"group {key!r} holds regions but no sequence")
            owned.extend(res.spares)
            for seq_id in res.holders:
                if self._seq_group.get(seq_id) != key:
                    raise RuntimeError(f"sequence {seq_id} is held by {key!r} but mapped elsewhere")
                start = self._seq_region.get(seq_id)
                table = self.block_tables.get(seq_id, [])
                if start is None:
                    if seq_id not in self._pending or table:
                        raise RuntimeError(f"sequence {seq_id} has no region and is not a pending fork")
                    continue
                owned.append(start)
                if self.allocator.region_size(start) != res.region_blocks:
                    raise RuntimeError(f"region at {start} has the wrong size")
                if table != list(range(start, start + len(table))) or len(table) > res.requested_blocks:
                    raise RuntimeError(f"sequence {seq_id} table is not a run inside its reservation")
        allocated = sorted(s for s, _ in self.allocator.allocated_regions())
        if sorted(owned) != allocated:
            raise RuntimeError(f"allocated regions {allocated[:10]} differ from the groups' {sorted(owned)[:10]}")
