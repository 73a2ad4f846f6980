"""A picture of the KV cache at one instant: every block's state, owners and fill (pure Python).

Two halves, so the thread that owns the scheduler pays as little as possible:

- `capture_kv_state(scheduler)` runs on that thread (between steps) and only copies what it needs:
  both pools' refcount lists, the prefix cache's cached-free blocks, and each queued request's
  block tables and token counts. O(blocks + sequences), no derived figures.
- `build_kv_snapshot(capture)` runs anywhere else and turns the copy into a JSON-ready dict: per
  block refcount, state, owning request ids and filled slots; the queues with each request's
  blocks; and the counts the engine's `stats()` reports (free, shared, saved by sharing, slots).

Block states (paper Figs. 6–9): ``free`` (refcount 0, nothing cached), ``cached_free`` (refcount 0
but still holding a full prefix-cache block, reusable by a lookup until evicted), ``used`` (one
reference) and ``shared`` (refcount > 1: forked sequences or requests sharing a cached prefix).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from pagedllm.core.sequence import SequenceGroup

FREE, USED, SHARED, CACHED_FREE = "free", "used", "shared", "cached_free"
QUEUES = ("running", "waiting", "swapped")


@dataclass(frozen=True)
class SeqCapture:
    seq_id: int
    status: str
    num_tokens: int
    num_computed_tokens: int
    blocks: tuple[int, ...]  # device block table
    cpu_blocks: tuple[int, ...]  # CPU block table (swapped sequences)


@dataclass(frozen=True)
class GroupCapture:
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
    """Copy the state a snapshot needs; call it on the thread that owns `scheduler`."""
    bm = scheduler.block_manager
    tables, cpu_tables = bm.block_tables, bm.cpu_block_tables
    groups = []
    for queue in QUEUES:
        for group in getattr(scheduler, queue):
            groups.append(_capture_group(group, queue, tables, cpu_tables))
    return KVCapture(
        block_size=bm.block_size,
        gpu_ref_counts=list(bm.gpu_pool.ref_counts),
        gpu_cached_free=bm.gpu_pool.cached_free_blocks(),
        cpu_ref_counts=list(bm.cpu_pool.ref_counts),
        groups=tuple(groups),
    )


def _capture_group(group: SequenceGroup, queue: str, tables: dict, cpu_tables: dict) -> GroupCapture:
    seqs = tuple(
        SeqCapture(
            seq_id=s.seq_id,
            status=s.status.name.lower(),
            num_tokens=s.get_len(),
            num_computed_tokens=s.num_computed_tokens,
            blocks=tuple(tables.get(s.seq_id, ())),
            cpu_blocks=tuple(cpu_tables.get(s.seq_id, ())),
        )
        for s in group.unfinished_seqs()
    )
    return GroupCapture(group.request_id, queue, seqs)


def block_state(ref_count: int, cached_free: bool) -> str:
    if ref_count > 1:
        return SHARED
    if ref_count == 1:
        return USED
    return CACHED_FREE if cached_free else FREE


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
            for i, block in enumerate(s.blocks):
                fill[block] = max(fill[block], max(0, min(bs, s.num_computed_tokens - i * bs)))
                _add_owner(owners, block, g.request_id)
            for block in s.cpu_blocks:
                _add_owner(cpu_owners, block, g.request_id)
        queues[g.queue].append({
            "request_id": g.request_id,
            "seqs": [{"seq_id": s.seq_id, "status": s.status, "num_tokens": s.num_tokens,
                      "num_computed_tokens": s.num_computed_tokens, "blocks": list(s.blocks),
                      "cpu_blocks": list(s.cpu_blocks)} for s in g.seqs],
        })
    cached = set(cap.gpu_cached_free)
    for block in cached:
        fill[block] = bs  # only full blocks are ever cached
    states = [block_state(c, b in cached) for b, c in enumerate(cap.gpu_ref_counts)]
    counts = _counts(states, cap.gpu_ref_counts, fill, bs)
    cpu_used = sum(1 for c in cap.cpu_ref_counts if c > 0)
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


def _counts(states: Iterable[str], ref_counts: list[int], fill: list[int], bs: int) -> dict[str, int]:
    by_state = {FREE: 0, USED: 0, SHARED: 0, CACHED_FREE: 0}
    for st in states:
        by_state[st] += 1
    allocated = by_state[USED] + by_state[SHARED]
    filled = sum(f for f, c in zip(fill, ref_counts) if c > 0)
    return {
        "kv_blocks_total": len(ref_counts),
        "kv_blocks_free": by_state[FREE] + by_state[CACHED_FREE],
        "kv_blocks_free_uncached": by_state[FREE],
        "kv_blocks_cached_free": by_state[CACHED_FREE],
        "kv_blocks_used": by_state[USED],
        "kv_blocks_shared": by_state[SHARED],
        "kv_blocks_saved_by_sharing": sum(c - 1 for c in ref_counts if c > 1),
        "kv_slots_allocated": allocated * bs,
        "kv_slots_filled": filled,
        "kv_slots_empty_in_last_blocks": allocated * bs - filled,
    }
