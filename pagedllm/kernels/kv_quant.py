"""FP8 KV cache: the pool dtypes behind ``--kv-cache-dtype``, the per-layer scales, and the plain-torch
quantize / dequantize oracles the Triton kernels are tested against.

A cached value x is stored as fp8(clamp(x / scale, ±max)) and read back as fp8 · scale, one scale per
layer for keys (k_scale) and one for values (v_scale). By default they are 1.0 (vLLM's default without a
calibrated checkpoint); with ``--calculate-kv-scales`` (``worker/kv_scale_calibration.py``, vLLM's
``calculate_kv_scales``) they are calibrated at start-up: scale = amax / constant over one forward pass of a
fixed text, with constants below e4m3's 448 so that later values up to 2.24× (K) / 4.48× (V) the
calibration's amax still fit. A scale only moves which values fall below e4m3's normal range (2^-6) or
saturate: the 3-bit mantissa is the same at every magnitude (why 1.0 stays the default: README, "FP8 KV
cache"). Static scales are what CUDA graphs need: they are
baked into the captured launches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# vLLM's K_SCALE_CONSTANT / V_SCALE_CONSTANT: a calibrated scale is amax / constant, so the calibration's
# largest |k| is stored as 200 and its largest |v| as 100 (e4m3 saturates at 448).
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0


@dataclass(frozen=True)
class KVCacheSpec:
    """Element type of the KV pool and the scales of an FP8 pool: `layer_scales` holds the calibrated
    (k_scale, v_scale) of each layer; without them every layer uses (k_scale, v_scale). Plain pools
    ignore the scales."""

    dtype: torch.dtype
    k_scale: float = 1.0
    v_scale: float = 1.0
    layer_scales: tuple[tuple[float, float], ...] = ()

    @property
    def is_fp8(self) -> bool:
        return is_fp8(self.dtype)

    def scales(self, layer: int) -> tuple[float, float]:
        """(k_scale, v_scale) of one layer."""
        return self.layer_scales[layer] if self.layer_scales else (self.k_scale, self.v_scale)


def scale_from_amax(amax: float, constant: float) -> float:
    """amax / constant (vLLM's calculated scale); 1.0 when amax is 0 or not finite (nothing to scale by)."""
    if not (math.isfinite(amax) and amax > 0.0):
        return 1.0
    return amax / constant


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for e4m3, 57344 for e5m2); 0.0 for other dtypes."""
    return float(torch.finfo(dtype).max) if is_fp8(dtype) else 0.0


def resolve_cache_dtype(cache_dtype: str, model_dtype: torch.dtype, device: str) -> torch.dtype:
    """The pool dtype for ``--kv-cache-dtype``: "auto" is the model's, "bfloat16" a bf16 pool on any device;
    FP8 pools need CUDA (the Triton kernels) or the CPU (its native kernels; the worker checks they load)."""
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype == "bfloat16":
        return torch.bfloat16
    if cache_dtype not in _FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of ['auto', 'bfloat16', {', '.join(map(repr, _FP8_DTYPES))}], "
                         f"got {cache_dtype!r}.")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"kv_cache_dtype={cache_dtype!r} needs a CUDA device or the CPU (the FP8 cache is read and "
                         f"written by the Triton or the native CPU kernels); this engine runs on {device!r}: use "
                         f"kv_cache_dtype='auto'.")
    return _FP8_DTYPES[cache_dtype]


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x / scale, saturated to the FP8 range, cast to `dtype` (what ``reshape_and_cache`` stores)."""
    m = fp8_max(dtype)
    return (x.float() / scale).clamp(-m, m).to(dtype)


def dequantize(x: torch.Tensor, out_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """fp8 · scale in `out_dtype` (what the attention kernels read)."""
    return (x.float() * scale).to(out_dtype)
