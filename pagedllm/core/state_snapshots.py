"""Prefix caching for models with state-space (Mamba) layers: recurrent-state snapshots keyed by block hash.

A state-space layer's state after token t summarises every token before it and cannot be rebuilt from cached KV
blocks, so a prefix-cache hit is only usable where the state at its end was kept. Every `interval` tokens (vLLM's
``mamba_block_size``) a sequence's state is copied into a snapshot slot, keyed by the hash of the block that ends
there (which names the whole prefix before it). A later sequence whose cached prefix reaches such a point starts
from a copy of that snapshot instead of zeros.

Snapshot slots are a fixed set of recurrent-state slots after the running sequences' ones. A snapshot is *planned*
when a step that crosses its point is scheduled (the step writes it) and *published* once that step has run, so no
sequence copies one that is not written yet; the least recently used published snapshot is overwritten when no slot
is free. No torch here: the worker does the copies.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class StateSnapshotStats:
    num_planned: int = 0  # snapshots written by steps
    num_hits: int = 0  # sequences that started from a snapshot
    num_evicted: int = 0  # published snapshots overwritten to make room


@dataclass
class StateSnapshotStore:
    """Snapshot slots `first_slot` .. `first_slot + num_slots - 1`, one state every `interval` tokens."""

    first_slot: int
    num_slots: int
    interval: int
    # block hash → slot, least recently used first
    _published: OrderedDict[int, int] = field(init=False, default_factory=OrderedDict)
    # seq_id → [(position, block hash, slot)] planned by a scheduled step, published after it runs
    _pending: dict[int, list[tuple[int, int, int]]] = field(init=False, default_factory=dict)
    _pending_hashes: set[int] = field(init=False, default_factory=set)
    _free: list[int] = field(init=False)
    stats: StateSnapshotStats = field(init=False, default_factory=StateSnapshotStats)

    def __post_init__(self) -> None:
        if self.num_slots < 1 or self.interval < 1:
            raise ValueError(f"a state snapshot store needs slots and an interval >= 1, got {self.num_slots} slots "
                             f"every {self.interval} tokens")
        self._free = list(range(self.first_slot + self.num_slots - 1, self.first_slot - 1, -1))

    def has(self, block_hash: int) -> bool:
        """Whether a written snapshot ends at the block of this hash (no side effects)."""
        return block_hash in self._published

    def take(self, block_hash: int) -> int:
        """The slot of the published snapshot for this hash, marked recently used (a sequence starts from it)."""
        self._published.move_to_end(block_hash)
        self.stats.num_hits += 1
        return self._published[block_hash]

    def plan(self, seq_id: int, points: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """For the (position, block hash) points a scheduled step crosses: the (position, slot) snapshots it must
        write. Points already published or planned are skipped, and so are all once no slot is free or evictable."""
        out: list[tuple[int, int]] = []
        for position, block_hash in points:
            if block_hash in self._published or block_hash in self._pending_hashes:
                continue
            if self._free:
                slot = self._free.pop()
            elif self._published:
                _, slot = self._published.popitem(last=False)
                self.stats.num_evicted += 1
            else:
                break
            self._pending.setdefault(seq_id, []).append((position, block_hash, slot))
            self._pending_hashes.add(block_hash)
            self.stats.num_planned += 1
            out.append((position, slot))
        return out

    def publish(self, seq_id: int, num_computed_tokens: int) -> None:
        """The sequence's steps have run up to `num_computed_tokens`: its planned snapshots up to there are written."""
        pending = self._pending.get(seq_id)
        if not pending:
            return
        keep = []
        for position, block_hash, slot in pending:
            if position > num_computed_tokens:
                keep.append((position, block_hash, slot))
                continue
            self._pending_hashes.discard(block_hash)
            self._published[block_hash] = slot
        if keep:
            self._pending[seq_id] = keep
        else:
            del self._pending[seq_id]

    def drop(self, seq_id: int) -> None:
        """The sequence is freed: the snapshots it had planned and not published go back (a step already queued
        may still write one; nothing reads it before a later owner's step rewrites it)."""
        for _, block_hash, slot in self._pending.pop(seq_id, ()):
            self._pending_hashes.discard(block_hash)
            self._free.append(slot)

    def reset(self) -> None:
        """Forget every published snapshot (vLLM's reset_prefix_cache)."""
        self._free.extend(self._published.values())
        self._published.clear()

    def check_invariants(self) -> None:
        pending = [slot for items in self._pending.values() for _, _, slot in items]
        slots = [*self._published.values(), *pending, *self._free]
        if sorted(slots) != list(range(self.first_slot, self.first_slot + self.num_slots)):
            raise RuntimeError(f"state snapshot slots leaked or shared: {len(self._published)} published, "
                               f"{len(pending)} planned, {len(self._free)} free of {self.num_slots}")
