"""What attention needs to know about a flattened batch (passed down, never global)."""
from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Describes one step's flat batch: decode sequences first, then prefill chunks.

    Sequence i owns query tokens ``query_start_loc[i]:query_start_loc[i+1]`` and, after this step,
    ``seq_lens[i]`` tokens of KV cache reached through ``block_tables[i]``.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = padding, not written
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]
    num_decodes: int  # leading sequences with exactly one query token
    max_seq_len: int
    max_query_len: int
    backend: Any = None  # the AttentionBackend the layers call
    # Derived once per step by the torch backend and shared by all layers (decodes grouped by length).
    decode_buckets: list | None = None
    # A whole-step graph's static buffers: block_tables / seq_lens / query_start_loc cover a fixed number of
    # sequences (padding ones own no query rows) and the layout is read on the device, so attention runs as
    # one launch whose grid depends on those sizes only (kernels/triton_unified_attention.py); the host lists
    # describe the capture, not the step.
    unified: bool = False
    # A hybrid model's KV cache groups (core/kv_cache_groups.py): entry g is group g's metadata (its own slot mapping
    # and block tables; entry 0 is this one). An attention layer of group g reads entry g. None: one group.
    group_metadata: list[AttentionMetadata] | None = None
    kv_cache_group: int = 0  # which group's metadata this is
    # A model with Mamba (state-space) layers: the step's state slots (model/layers/mamba_state.py). None otherwise.
    mamba: Any = None

    def with_groups(self, slots_and_tables: list[tuple[torch.Tensor, torch.Tensor]]) -> AttentionMetadata:
        """This metadata as group 0's, with groups 1.. reading (slot_mapping, block_tables) from `slots_and_tables`
        (the same sequences, lengths and query rows); unchanged when there is no other group."""
        if slots_and_tables:
            self.group_metadata = [self] + [
                dataclasses.replace(self, slot_mapping=slots, block_tables=tables, group_metadata=None,
                                    kv_cache_group=g)
                for g, (slots, tables) in enumerate(slots_and_tables, 1)]
        return self

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


def window_and_cap(sliding_window: Any, logits_soft_cap: Any) -> tuple[int, float]:
    """A layer's sliding window and logit soft cap as the kernels take them: (window, soft_cap), 0 where None (off).
    ValueError unless the window is a positive integer (tokens) and the cap a positive finite number, or None. A
    window past 2^31 - 1 tokens, wider than any context the kernels' int32 lengths reach, is clamped there."""
    window = 0
    if sliding_window is not None:
        try:
            window = -1 if isinstance(sliding_window, bool) else operator.index(sliding_window)
        except TypeError:
            window = -1
        if window < 1:
            raise ValueError(f"sliding_window must be a positive int (tokens) or None, got {sliding_window!r}")
        window = min(window, 2**31 - 1)
    cap = 0.0
    if logits_soft_cap is not None:
        try:
            cap = -1.0 if isinstance(logits_soft_cap, bool) else float(logits_soft_cap)
        except (TypeError, ValueError):
            cap = -1.0
        if not (cap > 0 and math.isfinite(cap)):
            raise ValueError(f"logits_soft_cap must be a positive finite number or None, got {logits_soft_cap!r}")
    return window, cap
