"""KV cache groups: which layers share a block table, and which pool tensor each layer's KV lives in.

A model whose layers differ in what they read (Gemma 2/3: full-attention layers among sliding-window ones) would
waste most of a sliding layer's memory under one block table per sequence, since the table must keep every block
a full-attention layer reads. vLLM's hybrid KV cache manager gives each kind of layer tables of its own: layers are
split into groups of equal size, one attention kind per group, and every group has its own block table per
sequence over ONE shared block pool. A block id then means "one page of this group's layers": pool tensor ("slot")
j holds the KV of the j-th layer of whichever group owns the block, so a block costs `num_slots` layers of
memory and a sliding group frees its blocks behind the window as the sequence moves on (BlockManager).

Example, Gemma-3-1B (26 layers, 4 full-attention, 22 with a 512-token window): groups of 4 layers, one full group
and six sliding groups (the last of 2 layers, padded), 4 pool tensors instead of 26. An 8 192-token sequence holds
512 + 6 × ~33 blocks of 4 layers instead of 512 blocks of 26: about 4.7× less KV memory.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One group: the attention window its layers share (None: full attention) and the layers, in slot order."""

    sliding_window: int | None
    layer_indices: tuple[int, ...]


@dataclass(frozen=True)
class KVCacheLayout:
    """The model's groups (the first is the full-attention group when there is one) and how many pool tensors they
    share (every group's j-th layer lives in tensor j)."""

    groups: tuple[KVCacheGroupSpec, ...]
    num_slots: int

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        return tuple(g.sliding_window for g in self.groups)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    def layer_placement(self, num_layers: int) -> list[tuple[int, int]]:
        """(group, slot) of every layer 0..num_layers-1."""
        placement: list[tuple[int, int] | None] = [None] * num_layers
        for g, group in enumerate(self.groups):
            for slot, layer in enumerate(group.layer_indices):
                placement[layer] = (g, slot)
        missing = [i for i, p in enumerate(placement) if p is None]
        if missing:
            raise ValueError(f"layers {missing[:8]} belong to no KV cache group")
        return placement  # type: ignore[return-value]


def single_group_layout(num_layers: int, sliding_window: int | None = None) -> KVCacheLayout:
    """Today's layout: one table per sequence for every layer, one pool tensor per layer."""
    return KVCacheLayout((KVCacheGroupSpec(sliding_window, tuple(range(num_layers))),), num_layers)


def plan_kv_cache_groups(layer_windows: list[int | None], enable_hybrid: bool = True) -> KVCacheLayout:
    """Group the layers by attention window (vLLM's uniform-page grouping).

    Every layer the same: one group (its window, if any, lets the block manager free blocks behind it). Mixed
    windows with `enable_hybrid`: per window kind, groups of `g` layers, g the smallest kind's layer count (the
    last group of a kind may be short; its missing slots are padding). Without `enable_hybrid` (vLLM's
    --disable-hybrid-kv-cache-manager): one group keeping every block, as a full-attention model would."""
    if not layer_windows:
        raise ValueError("a model needs at least one attention layer")
    kinds = list(dict.fromkeys(layer_windows))
    if len(kinds) == 1:
        return single_group_layout(len(layer_windows), kinds[0])
    if not enable_hybrid:
        return single_group_layout(len(layer_windows), None)
    # Full attention first (group 0 holds every block of the prefix: its table is the one the engine reports),
    # then windows from narrow to wide.
    kinds.sort(key=lambda w: (w is not None, w or 0))
    by_kind = {w: [i for i, lw in enumerate(layer_windows) if lw == w] for w in kinds}
    size = min(len(layers) for layers in by_kind.values())
    groups = []
    for w in kinds:
        layers = by_kind[w]
        for start in range(0, len(layers), size):
            groups.append(KVCacheGroupSpec(w, tuple(layers[start:start + size])))
    return KVCacheLayout(tuple(groups), size)


def blocks_for_sequence(group_windows: tuple[int | None, ...], length: int, block_size: int,
                        step_tokens: int = 1) -> int:
    """The most blocks one sequence of `length` tokens holds across the groups while steps of up to `step_tokens`
    tokens run: a full-attention group every block of the context, a sliding group at most the blocks from the first
    one its step's first query sees to the last one the step writes (BlockManager frees the rest)."""
    full = -(-length // block_size)
    return sum(full if w is None else min(full, -(-(w + step_tokens - 1) // block_size) + 1) for w in group_windows)
