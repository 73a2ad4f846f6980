"""FP8 KV cache: the pool dtypes behind ``--kv-cache-dtype`` and the plain-torch quantize / dequantize
oracles the Triton kernels are tested against.

A cached value x is stored as fp8(clamp(x / scale, ±max)) and read back as fp8 · scale, one scale per
layer for keys (k_scale) and one for values (v_scale). The engine uses fixed scales of 1.0 (vLLM's
default without a calibrated checkpoint): K and V activations of Llama-family models stay far inside
e4m3's ±448, and e4m3 keeps a relative step of 2^-3 at every magnitude from 2^-6 up, so a scale would
only move where the (rare) sub-2^-6 values lose precision. A static scale is also what CUDA graphs
need: it is baked into the captured launches.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class KVCacheSpec:
    """Element type of the KV pool and the per-layer scales of an FP8 pool (1.0 for a plain one)."""

    dtype: torch.dtype
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def is_fp8(self) -> bool:
        return is_fp8(self.dtype)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for e4m3, 57344 for e5m2); 0.0 for other dtypes."""
    return float(torch.finfo(dtype).max) if is_fp8(dtype) else 0.0


def resolve_cache_dtype(cache_dtype: str, model_dtype: torch.dtype, device: str) -> torch.dtype:
    """The pool dtype for ``--kv-cache-dtype``; FP8 pools need CUDA (the Triton kernels)."""
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype not in _FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of ['auto', {', '.join(map(repr, _FP8_DTYPES))}], "
                         f"got {cache_dtype!r}.")
    if device != "cuda":
        raise ValueError(f"kv_cache_dtype={cache_dtype!r} needs a CUDA device (the FP8 cache is read and written "
                         f"by the Triton kernels); this engine runs on {device!r}: use kv_cache_dtype='auto'.")
    return _FP8_DTYPES[cache_dtype]


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x / scale, saturated to the FP8 range, cast to `dtype` (what ``reshape_and_cache`` stores)."""
    m = fp8_max(dtype)
    return (x.float() / scale).clamp(-m, m).to(dtype)


def dequantize(x: torch.Tensor, out_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """fp8 · scale in `out_dtype` (what the attention kernels read)."""
    return (x.float() * scale).to(out_dtype)
