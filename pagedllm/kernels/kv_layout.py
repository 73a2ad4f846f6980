"""Physical layouts of a KV pool.

Every pool has the logical shape ``[num_blocks, block_size, num_kv_heads, head_dim]``: the Triton kernels
index it through its strides and the torch reference reads it by shape. How it is stored differs:

* slot-major (``SLOT_MAJOR``): a contiguous tensor of that shape. The CPU pools, whose native kernels walk
  raw pointers, use it.
* head-major (``HEAD_MAJOR``): stored ``[num_blocks, num_kv_heads, block_size, head_dim]`` and viewed through
  a permute, so one (block, KV head) is one contiguous run (2 KiB of FP8 at block 16, head_dim 128) instead of
  block_size runs of head_dim elements, heads·head_dim apart. CUDA pools use it: the decode kernel reading an
  FP8 pool streams 5–6 % more of the copy bandwidth (BENCHMARKS.md §36); bf16 reads are unchanged.

Either way a block is one dense run of ``block_size · num_kv_heads · head_dim`` elements, so block copies
(copy-on-write, swaps) move whole blocks as bytes.
"""
from __future__ import annotations

import torch

SLOT_MAJOR = "slot_major"
HEAD_MAJOR = "head_major"
KV_LAYOUTS = (SLOT_MAJOR, HEAD_MAJOR)

# Logical [blocks, slots, heads, dim] ↔ storage order; each permutation is its own inverse.
_ORDER = {SLOT_MAJOR: (0, 1, 2, 3), HEAD_MAJOR: (0, 2, 1, 3)}


def _order(layout: str) -> tuple[int, int, int, int]:
    if layout not in _ORDER:
        raise ValueError(f"KV layout must be one of {KV_LAYOUTS}, got {layout!r}.")
    return _ORDER[layout]


def default_layout(device: torch.device) -> str:
    """The layout a pool on `device` is allocated in."""
    return HEAD_MAJOR if device.type == "cuda" else SLOT_MAJOR


def physical_shape(shape: tuple[int, int, int, int], layout: str) -> tuple[int, int, int, int]:
    """The storage shape of a pool of logical `shape` in `layout`."""
    return tuple(shape[i] for i in _order(layout))


def logical_view(storage: torch.Tensor, layout: str) -> torch.Tensor:
    """The [num_blocks, block_size, num_kv_heads, head_dim] view of a contiguous pool stored in `layout`."""
    return storage.permute(*_order(layout))


def layout_of(cache: torch.Tensor) -> str:
    """Which layout a logical-shape pool tensor is stored in (slot-major when both fit, e.g. one KV head);
    ValueError for any other strides."""
    if cache.dim() == 4:
        for layout in KV_LAYOUTS:
            if cache.permute(*_ORDER[layout]).is_contiguous():
                return layout
    raise ValueError(f"a KV pool must be a 4-d slot-major or head-major tensor; got shape {tuple(cache.shape)}, "
                     f"strides {cache.stride()}.")


def storage_of(cache: torch.Tensor) -> torch.Tensor:
    """The contiguous tensor in storage order behind a pool view: block i is ``storage_of(cache)[i]``, dense."""
    return logical_view(cache, layout_of(cache))


def to_layout(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """A copy of a logical-shape pool stored in `layout` (benchmarks and tests build inputs like the engine's)."""
    return logical_view(logical_view(cache, layout).contiguous(), layout)
