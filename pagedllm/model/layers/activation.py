"""Activations, including the fused gate of SwiGLU."""
from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F


@functools.cache
def cuda_fused_ops() -> ModuleType | None:
    """``pagedllm.kernels.triton_fused_ops`` (the CUDA path of RMSNorm, RoPE and silu_and_mul), imported on first
    CUDA use so that CPU runs never load Triton; None where Triton is not installed (then torch serves CUDA too)."""
    try:
        from pagedllm.kernels import triton_fused_ops
    except ImportError:
        return None
    return triton_fused_ops


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim → silu(gate) * up (one fused Triton kernel on CUDA)."""
    if x.is_cuda and x.dim() == 2 and (ops := cuda_fused_ops()) is not None:
        return ops.silu_and_mul(x)
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
