"""Activations, including the fused gate of SwiGLU."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim → silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def get_act_fn(name: str):
    acts = {
        "silu": F.silu,
        "relu": F.relu,
        "gelu": F.gelu,
        "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    }
    if name not in acts:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(acts)}")
    return acts[name]
