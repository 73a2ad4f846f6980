"""Where the KV pool's memory goes (the paper's Fig. 2), for the paged and the contiguous managers.

Every quantity is in token slots (one block = ``block_size`` slots) of the device pool, at one instant.
For a sequence holding memory let ``c`` be its computed tokens (KV written) and ``F`` its final length:
prompt + the request's true output length (``group.extra["max_tokens"]``, exact when the request set
``ignore_eos``, as the benchmarks do), capped at ``max_model_len``. Its memory is ``A`` slots: for
paged, its table's blocks; for a contiguous manager, the blocks its policy asked for
(``cdiv(reservation, block_size)``), not the buddy padding. Then:

* ``token_states`` = ``min(c, A)``: slots holding computed KV;
* ``reservation`` = ``min(A, F) - token_states``: slots held now for tokens the request will produce
  later (the final token's slot counts here although an engine never computes its KV);
* ``internal_fragmentation`` = ``A - min(A, F)``: slots reserved beyond the final length, never filled.
  Paged: at most the tail of the last block (< one block per sequence). Orca-Oracle: the same
  rounding to blocks. Orca-Pow2 / Orca-Max: the over-reservation;
* ``external_fragmentation`` (contiguous managers only; 0 for paged, where any free block serves any
  request) = the buddy padding of every region (``region - requested`` blocks) plus, when the head-of-line
  waiting request cannot be admitted although the free blocks outnumber the blocks it asks for (no free
  buddy region is big enough), every free slot: under FCFS none of it can be used;
* ``free`` = the rest of the pool (free blocks, including paged blocks kept only for the prefix cache).

A paged block shared by several sequences (forks, prefix caching) is counted once, with the largest
``c`` and ``F`` of its holders. A contiguous group's spare regions (reserved at admission for sequences
it will fork: parallel sampling, beam search) count with ``c = 0``, as do regions of forked sequences
whose copy has not run yet. The five parts sum to ``total``; fractions are of ``total``.
Cost: O(sequences) for unshared paged sequences, O(blocks) for shared ones, O(regions) contiguous.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from pagedllm.core.baselines import ContiguousBlockManager, final_len
from pagedllm.core.block_manager import BlockManager, leading_null_blocks
from pagedllm.core.interfaces import AllocStatus
from pagedllm.core.sequence import SequenceGroup

FRACTION_KEYS = ("token_states", "reservation", "internal_fragmentation", "external_fragmentation", "free")


@dataclass
class KVMemoryBreakdown:
    """Token slots of the device KV pool by use (see the module docstring for the definitions)."""

    token_states: int = 0
    reservation: int = 0
    internal_fragmentation: int = 0
    external_fragmentation: int = 0
    free: int = 0
    total: int = 0

    def fractions(self) -> dict[str, float]:
        """Each part as a fraction of the pool (keys: FRACTION_KEYS)."""
        t = self.total or 1
        return {k: getattr(self, k) / t for k in FRACTION_KEYS}

    def add_allocation(self, computed: int, allocated: int, final: int) -> None:
        """One sequence's (or spare region's) `allocated` slots, `computed` of them filled."""
        ts = min(computed, allocated)
        fillable = max(ts, min(allocated, final))
        self.token_states += ts
        self.reservation += fillable - ts
        self.internal_fragmentation += allocated - fillable


def kv_memory_breakdown(
    manager: BlockManager | ContiguousBlockManager,
    running_groups: Iterable[SequenceGroup],
    *,
    max_model_len: int | None = None,
    head_of_line: SequenceGroup | None = None,
) -> KVMemoryBreakdown:
    """The pool's breakdown now. `running_groups`: the groups holding device memory (paged);
    `head_of_line`: the first waiting group (for external fragmentation); `max_model_len` caps the
    final lengths (default: the contiguous manager's, or no cap)."""
    bs = manager.block_size
    out = KVMemoryBreakdown(total=manager.num_gpu_blocks * bs)
    free = manager.get_num_free_gpu_blocks() * bs
    if isinstance(manager, ContiguousBlockManager):
        _contiguous(manager, out)
        if head_of_line is not None and manager.can_admit(head_of_line, 0) is AllocStatus.LATER and (
            manager.get_num_free_gpu_blocks() >= manager.group_demand_blocks(head_of_line)
        ):
            out.external_fragmentation += free
            free = 0
    else:
        cap = max_model_len if max_model_len is not None else 1 << 62
        _paged(manager, running_groups, cap, out)
    out.free = free
    return out


def _contiguous(manager: ContiguousBlockManager, out: KVMemoryBreakdown) -> None:
    bs = manager.block_size
    for res in manager.groups.values():
        allocated = res.requested_blocks * bs
        padding = (res.region_blocks - res.requested_blocks) * bs
        num_regions = len(res.spares)
        for seq in res.holders.values():
            if manager.region_of(seq) is not None:
                out.add_allocation(seq.num_computed_tokens, allocated, res.final_len)
                num_regions += 1
        for _ in range(len(res.spares)):
            out.add_allocation(0, allocated, res.final_len)
        out.external_fragmentation += padding * num_regions


def _paged(manager: BlockManager, groups: Iterable[SequenceGroup], cap: int, out: KVMemoryBreakdown) -> None:
    bs = manager.block_size
    shared: dict[int, list[int]] = {}  # block -> [filled, fillable]
    for group in groups:
        final = final_len(group, cap)
        seqs = group.unfinished_seqs()
        may_share = manager.enable_caching or len(seqs) > 1
        for seq, table in ((s, t.get(s.seq_id)) for t in manager.tables for s in seqs):  # every KV cache group's
            if not table:
                continue
            c = seq.num_computed_tokens
            freed = leading_null_blocks(table)  # behind a sliding window: neither held nor counted
            if not may_share:
                out.add_allocation(c - freed * bs, (len(table) - freed) * bs, final - freed * bs)
                continue
            for i, block in enumerate(table[freed:], freed):
                lo = i * bs
                filled = min(bs, max(0, c - lo))
                fillable = max(filled, min(bs, max(0, final - lo)))
                entry = shared.get(block)
                if entry is None:
                    shared[block] = [filled, fillable]
                else:
                    entry[0] = max(entry[0], filled)
                    entry[1] = max(entry[1], fillable)
    for filled, fillable in shared.values():
        out.add_allocation(filled, bs, fillable)
