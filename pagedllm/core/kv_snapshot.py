"""A picture of the KV cache at one instant: every block's state, owners and fill (pure Python).

Two halves, so the thread that owns the scheduler pays as little as possible:

- `capture_kv_state(scheduler)` runs on that thread (between steps) and only copies what it needs:
  both pools' refcount lists, the prefix cache's cached-free blocks, and each queued request's
  block tables and token counts. O(blocks + sequences), no derived figures.
- `build_kv_snapshot(capture)` runs anywhere else and turns the copy into a JSON-ready dict: per
  block refcount, owning request ids and filled slots, the cached-free block ids; the queues with
  each request's blocks; and the counts the engine's `stats()` reports (free, shared, saved by
  sharing, slots).

Block states (paper Figs. 6–9), which a reader derives from the refcount and the cached-free set:
``free`` (refcount 0, nothing cached), ``cached_free`` (refcount 0 but still holding a full
prefix-cache block, reusable by a lookup until evicted), ``used`` (one reference) and ``shared``
(refcount > 1: forked sequences or requests sharing a cached prefix).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from pagedllm.core.block_manager import NULL_BLOCK
from pagedllm.core.sequence import SequenceStatus

QUEUES = ("running", "waiting", "swapped")


class SeqCapture(NamedTuple):
    seq_id: int
    status: SequenceStatus
    num_tokens: int
    num_computed_tokens: int
    blocks: tuple[int, ...]  # device block table (a hybrid model's: every KV cache group's, one after the other)
    cpu_blocks: tuple[int, ...]  # CPU block table (swapped sequences)
    num_kv_cache_groups: int = 1  # the tables in `blocks`, of equal length


class GroupCapture(NamedTuple):
    request_id: str
    queue: str  # one of QUEUES
    seqs: tuple[SeqCapture, ...]


@dataclass(frozen=True)
class KVCapture:
    """Raw copies of the block manager's and scheduler's state, taken at a step boundary."""

    block_size: int
    gpu_ref_counts: list[int]
    gpu_cached_free: list[int]
    cpu_ref_counts: list[int]
    groups: tuple[GroupCapture, ...]


def capture_kv_state(scheduler: Any) -> KVCapture:
    """Copy the state a snapshot needs; call it on the thread that owns `scheduler` (tuples only: cheap)."""
    bm = scheduler.block_manager
    tables = getattr(bm, "tables", [bm.block_tables])  # one per KV cache group
    cpu_tables = getattr(bm, "cpu_tables", [bm.cpu_block_tables])
    groups = []
    for queue in QUEUES:
        for group in getattr(scheduler, queue):
            seqs = tuple(
                SeqCapture(s.seq_id, s.status, s.get_len(), s.num_computed_tokens,
                           tuple(b for t in tables for b in t.get(s.seq_id, ())),
                           tuple(b for t in cpu_tables for b in t.get(s.seq_id, ())), len(tables))
                for s in group.seqs if not s.status.is_finished
            )
            groups.append(GroupCapture(group.request_id, queue, seqs))
    return KVCapture(
        block_size=bm.block_size,
        gpu_ref_counts=list(bm.gpu_pool.ref_counts),
        gpu_cached_free=bm.gpu_pool.cached_free_blocks(),
        cpu_ref_counts=list(bm.cpu_pool.ref_counts),
        groups=tuple(groups),
    )


def build_kv_snapshot(cap: KVCapture) -> dict[str, Any]:
    """The JSON-ready snapshot of one capture (see the module docstring for the fields)."""
    bs = cap.block_size
    n_gpu, n_cpu = len(cap.gpu_ref_counts), len(cap.cpu_ref_counts)
    fill = [0] * n_gpu
    owners: dict[int, list[str]] = {}
    cpu_owners: dict[int, list[str]] = {}
    queues: dict[str, list[dict[str, Any]]] = {q: [] for q in QUEUES}
    for g in cap.groups:
        for s in g.seqs:
            per_table = len(s.blocks) // s.num_kv_cache_groups or 1
            for i, block in enumerate(s.blocks):
                if block == NULL_BLOCK:  # freed behind a sliding window
                    continue
                f = s.num_computed_tokens - i % per_table * bs
                if f > fill[block]:
                    fill[block] = f if f < bs else bs
                _add_owner(owners, block, g.request_id)
            for block in s.cpu_blocks:
                if block != NULL_BLOCK:
                    _add_owner(cpu_owners, block, g.request_id)
        queues[g.queue].append({
            "request_id": g.request_id,
            "seqs": [{"seq_id": s.seq_id, "status": s.status.name.lower(), "num_tokens": s.num_tokens,
                      "num_computed_tokens": s.num_computed_tokens,
                      "blocks": [b for b in s.blocks if b != NULL_BLOCK],
                      "cpu_blocks": [b for b in s.cpu_blocks if b != NULL_BLOCK]} for s in g.seqs],
        })
    cached = cap.gpu_cached_free
    for block in cached:
        fill[block] = bs  # only full blocks are ever cached
    counts = _counts(cap.gpu_ref_counts, len(cached), sum(fill) - bs * len(cached), bs)
    cpu_used = n_cpu - cap.cpu_ref_counts.count(0)
    counts.update(cpu_blocks_total=n_cpu, cpu_blocks_used=cpu_used, cpu_blocks_free=n_cpu - cpu_used,
                  num_running=len(queues["running"]), num_waiting=len(queues["waiting"]),
                  num_swapped=len(queues["swapped"]))
    return {
        "block_size": bs,
        "gpu": {"num_blocks": n_gpu, "ref_counts": list(cap.gpu_ref_counts), "fill": fill,
                "cached_free": sorted(cached), "owners": {str(b): o for b, o in owners.items()}},
        "cpu": {"num_blocks": n_cpu, "ref_counts": list(cap.cpu_ref_counts),
                "owners": {str(b): o for b, o in cpu_owners.items()}},
        "queues": queues,
        "counts": counts,
    }


def _add_owner(owners: dict[int, list[str]], block: int, request_id: str) -> None:
    lst = owners.setdefault(block, [])
    if request_id not in lst:
        lst.append(request_id)


def _counts(ref_counts: list[int], num_cached_free: int, filled: int, bs: int) -> dict[str, int]:
    """Counts by state, with list.count / sum (C loops): this runs at ~4 Hz on large pools."""
    total, zeros, ones = len(ref_counts), ref_counts.count(0), ref_counts.count(1)
    shared = total - zeros - ones
    allocated = ones + shared
    return {
        "kv_blocks_total": total,
        "kv_blocks_free": zeros,
        "kv_blocks_free_uncached": zeros - num_cached_free,
        "kv_blocks_cached_free": num_cached_free,
        "kv_blocks_used": ones,
        "kv_blocks_shared": shared,
        "kv_blocks_saved_by_sharing": sum(ref_counts) - allocated,
        "kv_slots_allocated": allocated * bs,
        "kv_slots_filled": filled,
        "kv_slots_empty_in_last_blocks": allocated * bs - filled,
    }
