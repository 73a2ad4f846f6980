"""What a Mamba (state-space) layer reads and writes each step: its recurrent state slots, and which slot each
sequence of the step owns.

A state-space layer keeps no per-token KV. Each running sequence owns one *state slot* (core's block manager hands it
out when the sequence starts and takes it back when it finishes or is preempted), and each Mamba layer holds, per
slot, the last ``d_conv - 1`` inputs of its causal convolution and its SSM state. A step reads the state of every
sequence it runs, advances it over that sequence's query tokens and writes it back in place, so chunked prefill and
decode continue where the previous step stopped. A sequence whose chunk starts at position 0 starts from zeros.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.device_utils import async_tensor_h2d


@dataclass
class MambaLayerCache:
    """One Mamba layer's state for every slot."""

    conv_state: torch.Tensor  # [num_slots, conv_dim, d_conv - 1], the model's dtype: the last inputs of the conv
    ssm_state: torch.Tensor  # [num_slots, num_heads, head_dim, d_state] (--mamba-ssm-cache-dtype; updates in float32)


@dataclass
class MambaStateMetadata:
    """The step's state slots, in the batch order of its AttentionMetadata (decodes first, then prefill chunks)."""

    state_indices: torch.Tensor  # [num_seqs] int64 on the model's device: each sequence's slot
    state_indices_cpu: list[int]
    has_initial_state: list[bool]  # per sequence: False where its chunk starts at position 0 (its state is zeros)
    layer_caches: list[MambaLayerCache]  # one per Mamba layer, in layer order
    # Prefix caching's state snapshots inside prefill chunks: (batch row, offset, slot): slot gets the row's state
    # after the first `offset` tokens of its chunk (0 < offset < the chunk's length; a chunk's end state is copied
    # from its slot after the step instead).
    cuts: list[tuple[int, int, int]] = field(default_factory=list)
    # Derived once per step (every layer reads it): the batch rows whose state starts from zeros, usually none.
    fresh_rows: list[int] = field(init=False)
    # Values that every layer of the step would otherwise rebuild (index tensors sent to the device once), by key.
    _per_step: dict[Hashable, Any] = field(init=False, default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.fresh_rows = [i for i, has in enumerate(self.has_initial_state) if not has]

    def per_step(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """`build()`, run by the first layer of the step that asks for `key`; later layers get the same value."""
        if key not in self._per_step:
            self._per_step[key] = build()
        return self._per_step[key]

    def fresh_slots(self, lo: int, hi: int) -> list[int]:
        """The slots of rows lo..hi-1 that start from zeros."""
        return [self.state_indices_cpu[i] for i in self.fresh_rows if lo <= i < hi]


@dataclass(frozen=True)
class MambaStateShape:
    """Per slot and per Mamba layer: the conv state's [conv_dim, d_conv - 1] and the SSM state's
    [num_heads, head_dim, d_state]."""

    num_layers: int
    conv_dim: int
    conv_width: int  # d_conv - 1
    num_heads: int
    head_dim: int
    state_size: int

    def bytes_per_slot(self, dtype: torch.dtype, ssm_dtype: torch.dtype = torch.float32) -> int:
        conv = self.conv_dim * self.conv_width * dtype.itemsize
        ssm = self.num_heads * self.head_dim * self.state_size * ssm_dtype.itemsize
        return self.num_layers * (conv + ssm)


def allocate_layer_caches(shape: MambaStateShape, num_slots: int, dtype: torch.dtype, device: torch.device,
                          ssm_dtype: torch.dtype = torch.float32) -> list[MambaLayerCache]:
    """Zeroed state for `num_slots` slots of every Mamba layer (the conv's inputs in `dtype`, the SSM state in
    `ssm_dtype`)."""
    return [MambaLayerCache(
        torch.zeros(num_slots, shape.conv_dim, shape.conv_width, dtype=dtype, device=device),
        torch.zeros(num_slots, shape.num_heads, shape.head_dim, shape.state_size, dtype=ssm_dtype, device=device))
        for _ in range(shape.num_layers)]


def copy_state_slots(caches: list[MambaLayerCache], pairs: list[tuple[int, int]]) -> None:
    """Copy slot src's state to slot dst in every layer (a forked sequence starts from its parent's state)."""
    if not pairs or not caches:
        return
    device = caches[0].ssm_state.device
    src = async_tensor_h2d([s for s, _ in pairs], torch.long, device)
    dst = async_tensor_h2d([d for _, d in pairs], torch.long, device)
    for cache in caches:
        cache.conv_state.index_copy_(0, dst, cache.conv_state.index_select(0, src))
        cache.ssm_state.index_copy_(0, dst, cache.ssm_state.index_select(0, src))


def clear_state_slots(caches: list[MambaLayerCache], slots: list[int]) -> None:
    """Zero the state of `slots` in every layer (sequences that start from position 0)."""
    if not slots or not caches:
        return
    index = async_tensor_h2d(slots, torch.long, caches[0].ssm_state.device)
    for cache in caches:
        cache.conv_state.index_fill_(0, index, 0)
        cache.ssm_state.index_fill_(0, index, 0)
