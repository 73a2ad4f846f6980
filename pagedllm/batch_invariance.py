"""Batch invariance (vLLM's ``VLLM_BATCH_INVARIANT=1``): a request's outputs do not depend on what it is
batched with, how its prompt is chunked, or which of its blocks came from the prefix cache.

CPU. A token already gets the same bits in any batch for a fixed chunking: the native attention kernel chooses
its path by the chunk's own length, the GGUF GEMMs and the native float32 GEMM compute each row alone. Two
choices still depend on the step, and this mode pins them:
- attention: chunks of ``TILE_MIN_QUERY_LEN`` tokens or more take the kernel's tile path, and chunks over 512
  tokens torch's SDPA; both sum in other orders than the token path, so a prompt read after a prefix-cache hit
  (a shorter chunk) got other bits than the same prompt computed whole. Here every chunk takes the token path.
- float32 linears: above ``F32Gemm.max_rows`` rows oneDNN's GEMM runs (another summation order). Here the native
  kernel takes every row count.

CUDA. cuBLAS picks a kernel, and a reduction order, per GEMM shape; the split-KV decode kernel splits a context
by the step's sequence count; decode, prefill and unified attention kernels tile keys differently. Here every
linear runs the Triton GEMM of kernels/triton_invariant_matmul.py (no split-K, a fixed K-tile depth), and every
step's attention the unified kernel (one key loop per token, from key 0 in tiles of a fixed width), inside the CUDA
graphs as in eager steps: a graph bucket's padding rows change neither. The norms, rotary embedding, activation
and sampling kernels already work row by row.

A last-bit difference matters: an FP8 KV cache rounds it to the next e4m3 code, a bfloat16 model to the next
bf16 value, and a greedy output changes (BENCHMARKS.md §54).
"""
from __future__ import annotations

import os

BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def batch_invariant_from_env() -> bool:
    """Whether ``VLLM_BATCH_INVARIANT`` asks for batch invariance (1/true/yes/on; unset or 0/false/no/off: no)."""
    value = os.environ.get(BATCH_INVARIANT_ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{BATCH_INVARIANT_ENV}={value!r}: use 1 (batch-invariant outputs) or 0 (the default).")


def unsupported_reason(device: str, dtype: str, quantization: str | None, native_kernels: bool,
                       native_f32_gemm: bool, fp8_weights: bool = False, tensor_parallel_size: int = 1) -> str | None:
    """Why batch invariance cannot be given to this engine (None: it can). `dtype` is the resolved model dtype's
    name, `quantization` the resolved weight format ("gguf" or None), `fp8_weights` whether linears run FP8."""
    if tensor_parallel_size > 1:
        return ("batch invariance needs tensor_parallel_size=1: an all-reduce sums a row in an order that depends "
                "on where it sits in the step's buffer.")
    if device == "cuda":
        if fp8_weights:
            return ("batch invariance on CUDA runs the linears through a fixed-tile Triton GEMM in the model's dtype; "
                    "FP8 weights (torch._scaled_mm) have none: leave quantization unset, with a bf16 checkpoint.")
        return None
    if device != "cpu":
        return f"batch invariance is implemented for the CPU and CUDA paths, not {device}."
    if not native_kernels:
        return ("batch invariance needs the native CPU kernels (a C compiler, PAGEDLLM_CPU_KERNELS unset or "
                "'native'): torch's attention sums in an order that depends on the chunk.")
    if quantization == "gguf":
        return None
    if dtype != "float32":
        return (f"batch invariance on the CPU needs float32 (or GGUF-quantized) weights: {dtype} GEMMs run in "
                f"oneDNN, whose summation order depends on the row count. Use dtype='float32'.")
    if not native_f32_gemm:
        return ("batch invariance with float32 weights needs the native float32 GEMM (kernels/cpu/f32_gemm.c; "
                "PAGEDLLM_CPU_GEMM unset or 'auto').")
    return None
