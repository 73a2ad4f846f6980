"""Normalisation layers."""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from pagedllm.model.layers.activation import fused_ops_for


class RMSNorm(nn.Module):
    #: The scale is weight + weight_offset (the CPU direct forward passes it to the C norm: Gemma's is 1).
    weight_offset = 0

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalise x (after adding residual, if given); returns (out, new_residual) then.

        One fused kernel on CUDA (kernels/triton_fused_ops.py) and on the CPU in float32
        (kernels/cpu_kernels.py), with the same roundings; else torch ops.
        """
        if (x.dim() == 2 and x.stride(-1) == 1 and x.dtype == self.weight.dtype
                and (ops := fused_ops_for(x)) is not None):
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps)
            if residual.dtype == x.dtype and residual.shape == x.shape and residual.stride(-1) == 1:
                return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return self.forward_native(x, residual)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The plain-torch path (CPU, and the fused kernel's oracle)."""
        if residual is not None:
            x = x + residual
            residual = x
        orig = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(orig)
        return out if residual is None else (out, residual)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the checkpoint stores offsets w and the scale is (1 + w), applied in float32 before the one
    rounding to x's dtype (Llama rounds the normalised x first, then multiplies by w in x's dtype)."""

    weight_offset = 1

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalise x (after adding residual, if given); returns (out, new_residual) then.

        One fused kernel in Gemma's roundings: Triton on CUDA (any dtype), the native CPU kernel in float32 (1 + w
        summed in float32 inside it, from the live weight: the CPU direct forward calls the same kernel, so the
        two paths agree bit for bit). Else ``forward_native``."""
        if (x.dim() == 2 and x.stride(-1) == 1 and x.dtype == self.weight.dtype
                and (ops := fused_ops_for(x)) is not None):
            if residual is None:
                return ops.gemma_rms_norm(x, self.weight, self.eps)
            if residual.dtype == x.dtype and residual.shape == x.shape and residual.stride(-1) == 1:
                return ops.fused_add_gemma_rms_norm(x, residual, self.weight, self.eps)
        return self.forward_native(x, residual)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The plain-torch path, as transformers' GemmaRMSNorm computes it."""
        if residual is not None:
            x = x + residual
            residual = x
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (xf * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)


class LayerNorm(nn.Module):
    """LayerNorm with optional affine weight/bias (OPT's layer_norm_elementwise_affine, GPT-2's ln_*)."""

    def __init__(
        self, hidden_size: int, eps: float, dtype: torch.dtype, elementwise_affine: bool = True, bias: bool = True
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = None
        self.bias = None
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
            if bias:
                self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)
