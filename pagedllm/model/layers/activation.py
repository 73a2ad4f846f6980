"""Activations, including the fused gate of SwiGLU and GeGLU's gate."""
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


def fused_ops_for(x: torch.Tensor):
    """The fused RMSNorm (Llama's and Gemma's) / RoPE / SiLU·mul / GeGLU ops for x's device and dtype: Triton on
    CUDA, the native CPU kernels (kernels/cpu_kernels.py) for float32 on the CPU; None where neither applies
    (torch serves)."""
    if x.is_cuda:
        return cuda_fused_ops()
    if x.device.type == "cpu" and x.dtype == torch.float32:
        from pagedllm.kernels.cpu_kernels import load_cpu_kernels

        return load_cpu_kernels()
    return None


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim → silu(gate) * up (one fused kernel on CUDA and CPU)."""
    if x.dim() == 2 and x.stride(-1) == 1 and (ops := fused_ops_for(x)) is not None:
        return ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """x = [gate | up] along the last dim → gelu(gate) * up (GeGLU; `approximate`: "none" or "tanh", as F.gelu).
    One fused kernel for "tanh" (Gemma's) on CUDA and on the CPU in float32 (the kernel the CPU direct forward
    calls, so both paths give the same bits), torch ops otherwise."""
    if approximate == "tanh" and x.dim() == 2 and x.stride(-1) == 1 and (ops := fused_ops_for(x)) is not None:
        return ops.gelu_tanh_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu_and_mul with the tanh approximation (Gemma's gelu_pytorch_tanh)."""
    return gelu_and_mul(x, "tanh")


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
