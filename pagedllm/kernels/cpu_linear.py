"""CPU GEMMs through oneDNN with prepacked weights: the CPU path's linear layers.

torch's default CPU matmul calls the BLAS it was built with (MKL). On AMD processors MKL runs its
AVX2 kernels even where AVX-512 exists, and it re-packs the weight matrix on every call, which
dominates at decode-sized batches. oneDNN picks its kernels from the CPU's ISA flags and takes a
weight packed once, at load time, into its blocked layout: on a 2-core AVX-512 EPYC this runs the
model's float32 GEMMs at 2-3.7x the rate of ``F.linear`` (BENCHMARKS.md, "CPU GEMM"). Arithmetic
stays float32 (bfloat16 for bfloat16 weights); only the summation order differs from ``F.linear``.

``PAGEDLLM_CPU_GEMM=torch`` turns packing off (every linear then runs ``F.linear``), for comparison.

Row buckets: oneDNN builds (JIT-compiles) one primitive per input shape and keeps it in its
primitive cache (1 024 entries by default), about 0.6 MiB each whatever the shape. A server's steps
have every row count from 1 to the batched-token limit, so exact shapes fill that cache with up to
~620 MiB of native memory over hours of serving and then churn it (BENCHMARKS.md, soak). Row counts
above `EXACT_ROWS` are padded up to one of 8 sizes per octave (at most 1/8 more rows, zeros, sliced
off), so a model sees at most 16 + 8·log2(max_rows/16) shapes per weight.
"""
from __future__ import annotations

import os

import torch

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
GEMM_ENV = "PAGEDLLM_CPU_GEMM"
GEMM_CHOICES = ("onednn", "torch")
EXACT_ROWS = 16  # decode-sized GEMMs keep their exact shape (no wasted rows where steps are shortest)
BUCKETS_PER_OCTAVE = 8


def cpu_gemm_backend() -> str:
    """'onednn' when oneDNN's packed linear is usable here and not turned off, else 'torch'."""
    choice = os.environ.get(GEMM_ENV, "onednn").strip().lower()
    if choice not in GEMM_CHOICES:
        raise ValueError(f"{GEMM_ENV}={choice!r} is not one of {GEMM_CHOICES}")
    if choice == "onednn" and onednn_linear_available():
        return "onednn"
    return "torch"


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN with the packed-weight linear ops."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] CPU weight → oneDNN's blocked layout (an opaque mkldnn tensor, a copy)."""
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES:
        raise ValueError(
            f"oneDNN packing takes a CPU weight in {PACKABLE_DTYPES}, got {weight.dtype} on {weight.device}"
        )
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def gemm_rows_bucket(rows: int) -> int:
    """The row count a GEMM of `rows` rows runs at: `rows` up to EXACT_ROWS, then the next of
    BUCKETS_PER_OCTAVE evenly spaced sizes per power of two (at most rows/8 of padding)."""
    if rows <= EXACT_ROWS:
        return rows
    step = (1 << (rows.bit_length() - 1)) // BUCKETS_PER_OCTAVE  # the octave [2^k, 2^k+1) in 8 steps
    return -(-rows // step) * step


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x Wᵀ + b with W from `pack_linear_weight`; x is [..., in] in W's dtype.

    Rows are padded to `gemm_rows_bucket` (the padding's outputs are dropped) so that oneDNN
    compiles and caches a bounded set of shapes."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    padded = gemm_rows_bucket(rows)
    if padded != rows:
        x2 = torch.nn.functional.pad(x2, (0, 0, 0, padded - rows))
    y = torch.ops.mkldnn._linear_pointwise(x2, packed_weight, bias, "none", [], "")
    if padded != rows:
        y = y[:rows]
    return y.reshape(*lead, y.shape[-1])
