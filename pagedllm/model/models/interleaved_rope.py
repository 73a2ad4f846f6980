"""Checkpoints whose RoPE rotates interleaved pairs (GPT-J's rotate_every_two; Cohere, GLM) served by the engine's
rotate-half RoPE: each head's q and k rows are reordered at load time (layers/rotary.py's interleaved_to_half_rows),
which leaves every attention score as it was, so the fused RoPE kernels run these families unchanged."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagedllm.model.layers.rotary import interleaved_to_half_rows

_PROJECTIONS = ("q_proj", "k_proj")
_HEAD_NORMS = ("q_norm", "k_norm")  # [heads, head_dim] per-head norm weights (Cohere's use_qk_norm)


def interleaved_rope_tensors(weights: Iterable[tuple[str, torch.Tensor]], head_dim: int,
                             rotary_dim: int) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` under our names, each q_proj / k_proj tensor (weight, bias, LoRA B: rows of heads · head_dim) and
    each per-head q_norm / k_norm weight reordered for rotate-half RoPE on the first `rotary_dim` dims of each head;
    the other tensors as they are."""
    for name, tensor in weights:
        module = name.split(".")[-2] if "." in name else ""
        if module in _PROJECTIONS:
            tensor = interleaved_to_half_rows(tensor, head_dim, rotary_dim)
        elif module in _HEAD_NORMS:
            tensor = interleaved_to_half_rows(tensor.reshape(-1), head_dim, rotary_dim).view(tensor.shape)
        yield name, tensor
