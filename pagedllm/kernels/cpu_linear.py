"""CPU GEMMs through oneDNN with prepacked weights: the CPU path's linear layers.

torch's default CPU matmul calls the BLAS it was built with (MKL). On AMD processors MKL runs its
AVX2 kernels even where AVX-512 exists, and it re-packs the weight matrix on every call, which
dominates at decode-sized batches. oneDNN picks its kernels from the CPU's ISA flags and takes a
weight packed once, at load time, into its blocked layout: on a 2-core AVX-512 EPYC this runs the
model's float32 GEMMs at 2-3.7x the rate of ``F.linear`` (BENCHMARKS.md, "CPU GEMM"). Arithmetic
stays float32 (bfloat16 for bfloat16 weights); only the summation order differs from ``F.linear``.

``PAGEDLLM_CPU_GEMM``: ``auto`` (default) packs for oneDNN and also runs float32 linears of few rows on the
native kernel of kernels/cpu_f32_gemm.py; ``onednn`` packs for oneDNN only; ``torch`` turns packing off (every
linear then runs ``F.linear``), for comparison.

bfloat16 packing needs AVX-512 BW/VL/DQ (or AVX-NE-CONVERT): without it torch's reorder raises inside
oneDNN. Where the CPU, or the level forced by ``PAGEDLLM_CPU_ISA`` (kernels/cpu_isa.py), lacks them,
`packable_dtypes()` leaves bfloat16 out and bfloat16 layers run ``F.linear`` (the worker logs why).
float32 packing works on every x86-64 CPU (oneDNN has SSE4.1/AVX2/AVX-512 kernels).

Row buckets: oneDNN builds (JIT-compiles) one primitive per input shape and keeps it in its
primitive cache (1 024 entries by default), about 0.6 MiB each whatever the shape. A server's steps
have every row count from 1 to the batched-token limit, so exact shapes fill that cache with up to
~620 MiB of native memory over hours of serving and then churn it (BENCHMARKS.md, soak). So GEMMs run
only at bucket sizes: exact up to `EXACT_ROWS`, then 8 sizes per octave, at most 16 + 8·log2(max_rows/16)
shapes per weight. Below `SPLIT_ROWS` the rows are padded up to the next size (at most 1/8 more); from
there on the largest size that fits runs on a view of x and only the remainder is padded (1151 rows →
1024 + 127 padded to 128), which keeps the wasted arithmetic small for long prefills.
"""
from __future__ import annotations

import functools
import os

import torch

from pagedllm.kernels import cpu_isa

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)  # what oneDNN can pack on some CPU; see packable_dtypes()
GEMM_ENV = "PAGEDLLM_CPU_GEMM"
GEMM_CHOICES = ("auto", "onednn", "torch")
EXACT_ROWS = 16  # decode-sized GEMMs keep their exact shape (no wasted rows where steps are shortest)
BUCKETS_PER_OCTAVE = 8
SPLIT_ROWS = 512  # from here a remainder GEMM (one more read of the weight) costs less than padding


def gemm_choice() -> str:
    choice = os.environ.get(GEMM_ENV, "auto").strip().lower()
    if choice not in GEMM_CHOICES:
        raise ValueError(f"{GEMM_ENV}={choice!r} is not one of {GEMM_CHOICES}")
    return choice


def cpu_gemm_backend() -> str:
    """'onednn' when oneDNN's packed linear is usable here and not turned off, else 'torch'."""
    if gemm_choice() != "torch" and onednn_linear_available():
        return "onednn"
    return "torch"


def f32_small_rows_wanted() -> bool:
    """Whether float32 linears of few rows should run the native kernel (kernels/cpu_f32_gemm.py)."""
    return gemm_choice() == "auto"


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN with the packed-weight linear ops."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


def bf16_packing_unsupported_reason() -> str | None:
    """None where bfloat16 weights can be packed here, else why not (the missing CPU feature)."""
    isa = cpu_isa.detect_cpu_isa()
    if not isa.at_least("avx512"):
        missing = ", ".join(cpu_isa.missing_flags(isa.flags, "avx512")) or "none (forced lower)"
        return (f"oneDNN's bfloat16 GEMM needs AVX-512 BW/VL/DQ; the CPU ISA level in use is {isa.name} "
                f"(missing CPU flags: {missing})")
    if not _onednn_bf16_ok():
        return "oneDNN reports no bfloat16 support on this CPU (ONEDNN_MAX_CPU_ISA, or no AVX-512 BW/VL/DQ)"
    return None


@functools.cache
def _onednn_bf16_ok() -> bool:
    """torch's own check (the one its reorder raises on); it follows ONEDNN_MAX_CPU_ISA."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes `pack_linear_weight` takes on this CPU: float32, plus bfloat16 where supported."""
    return PACKABLE_DTYPES if bf16_packing_unsupported_reason() is None else (torch.float32,)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] CPU weight → oneDNN's blocked layout (an opaque mkldnn tensor, a copy)."""
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES:
        raise ValueError(
            f"oneDNN packing takes a CPU weight in {PACKABLE_DTYPES}, got {weight.dtype} on {weight.device}"
        )
    if weight.dtype == torch.bfloat16 and (reason := bf16_packing_unsupported_reason()) is not None:
        raise ValueError(f"cannot pack a bfloat16 weight here: {reason}; use F.linear, or float32 weights")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def _octave_step(rows: int) -> int:
    return (1 << (rows.bit_length() - 1)) // BUCKETS_PER_OCTAVE  # the octave [2^k, 2^k+1) in 8 steps


def gemm_rows_bucket(rows: int) -> int:
    """The smallest bucket size >= `rows`: `rows` itself up to EXACT_ROWS, then one of
    BUCKETS_PER_OCTAVE evenly spaced sizes per power of two."""
    if rows <= EXACT_ROWS:
        return rows
    step = _octave_step(rows)
    return -(-rows // step) * step


def gemm_row_plan(rows: int) -> list[tuple[int, int]]:
    """(rows, bucket size it runs at) per GEMM for `rows` rows: whole buckets while at least
    SPLIT_ROWS are left, then the rest padded up to its bucket."""
    plan = []
    while rows >= SPLIT_ROWS:
        step = _octave_step(rows)
        plan.append((rows // step * step,) * 2)
        rows -= plan[-1][0]
    if rows:
        plan.append((rows, gemm_rows_bucket(rows)))
    return plan


def _gemm(x: torch.Tensor, rows_run: int, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0]
    if rows_run != rows:
        x = torch.nn.functional.pad(x, (0, 0, 0, rows_run - rows))
    y = torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
    return y[:rows] if rows_run != rows else y


def cpu_linear_forward(x: torch.Tensor, weight: torch.Tensor, packed_weight: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """y = x Wᵀ + b for a layer holding both its dense `weight` and the packed copy: one float32 row (a
    single sequence's decode step) runs ``F.linear`` on the dense weight, whose matrix-vector kernel streams
    it faster than oneDNN's packed GEMM (1.2x a whole step of the bundled model, BENCHMARKS.md §41); any
    other shape runs `packed_linear`."""
    if weight.dtype == torch.float32 and x.numel() == x.shape[-1]:
        return torch.nn.functional.linear(x, weight, bias)
    return packed_linear(x, packed_weight, bias)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x Wᵀ + b with W from `pack_linear_weight`; x is [..., in] in W's dtype.

    Runs as `gemm_row_plan` (padding's outputs dropped, pieces concatenated) so that oneDNN
    compiles and caches a bounded set of shapes."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    plan = gemm_row_plan(x2.shape[0])
    if len(plan) <= 1:
        y = _gemm(x2, plan[0][1], packed_weight, bias) if plan else _gemm(x2, 0, packed_weight, bias)
    else:
        outs, start = [], 0
        for rows, rows_run in plan:
            outs.append(_gemm(x2[start:start + rows], rows_run, packed_weight, bias))
            start += rows
        y = torch.cat(outs)
    return y.reshape(*lead, y.shape[-1])
