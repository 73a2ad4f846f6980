"""float32 GEMMs of decode-sized row counts on the CPU (kernels/cpu/f32_gemm.c), through ctypes.

oneDNN's packed GEMM (kernels/cpu_linear.py) is the CPU path's GEMM for prompts and large batches. At the few
rows of a small decode step or a speculative verification it reaches under half of what the memory allows:
the bundled model's 121 GEMMs took 36-42 ms at 4 rows against ~25 ms at one row (BENCHMARKS.md §42.3). This
kernel streams a weight packed into column panels once per tile of rows, with the panel prefetched ahead, and
takes float32 linears of up to `F32Gemm.max_rows` rows. A row's result does not depend on the rows it runs with.

Built like the other native kernels (``build_library``: the system C compiler, the ISA level of
kernels/cpu_isa.py, cached per source and flags). ``PAGEDLLM_CPU_GEMM=onednn`` leaves it out (oneDNN for every
row count, as before); without a compiler it is left out and the reason logged.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from pagedllm.kernels import cpu_isa
from pagedllm.kernels.cpu_kernels import build_library

logger = logging.getLogger("pagedllm")

SOURCE = Path(__file__).with_name("cpu") / "f32_gemm.c"
BUILD_FLAGS = ("-ffp-contract=fast",)  # the tiles' multiply-adds as FMAs
# Rows up to this many tiles run here, more run oneDNN. Before AVX-512 builds prefetched the next panel the two
# were even at 4 tiles (48 rows, §42.3); with it this kernel took 0.75-0.89x oneDNN's time from 48 to 96 rows
# and 0.94x at 128 over the bundled model's GEMMs on a Xeon with AMX (§53.1). Portable builds, and an AVX2
# build on a CPU where oneDNN runs AVX-512 (PAGEDLLM_CPU_ISA=avx2 on an AVX-512 CPU), keep 2 tiles.
TILES_AVX512 = 8
TILES_OTHER = 2
# On an AVX2-only CPU oneDNN runs AVX2 too, and this kernel was 1.1-2.1x faster than its packed GEMM from 1 to
# 512 rows over the bundled model's GEMMs (0.95x at 1 024) on an AMD EPYC Zen 3 (BENCHMARKS.md §44.2).
ROWS_AVX2_CPU = 512

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@dataclass(frozen=True)
class F32Gemm:
    """One build of f32_gemm.c: `panel_width` output columns per packed panel, `tile_rows` rows per tile."""

    lib: ctypes.CDLL
    path: Path
    isa: str
    row_limit: int | None = None  # None: where this kernel beats oneDNN here (native_row_limit)
    panel_width: int = field(init=False)
    tile_rows: int = field(init=False)
    max_rows: int = field(init=False)  # the largest row count this build takes (more go to oneDNN)

    def __post_init__(self) -> None:
        self.lib.f32_gemm.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64]
        self.lib.f32_gemm.restype = ctypes.c_int
        self.lib.f32_gemm_pack.argtypes = [_ptr, _i64, _i64, _i64, _ptr]
        self.lib.f32_gemm_pack.restype = None
        # Read once: every linear call consults them (a ctypes call costs ~1 µs on the per-step path).
        object.__setattr__(self, "panel_width", self.lib.f32_gemm_panel_width())
        object.__setattr__(self, "tile_rows", self.lib.f32_gemm_tile_rows())
        object.__setattr__(self, "max_rows", self.row_limit if self.row_limit is not None else
                           native_row_limit(self.isa, cpu_isa.detect_cpu_isa().detected, self.tile_rows))

    def for_every_row_count(self) -> F32Gemm:
        """This build taking linears of any row count (batch invariance: none goes to oneDNN)."""
        return replace(self, row_limit=1 << 62)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """A float32 CPU weight [n, k] → its panels (a flat float32 tensor of ceil(n / panel_width) · k ·
        panel_width values, zeros past n)."""
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2 or weight.stride(1) != 1:
            raise ValueError(f"f32_gemm packs a float32 CPU matrix with contiguous rows, got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        n, k = weight.shape
        nb = self.panel_width
        panels = torch.empty(-(-n // nb) * nb * k, dtype=torch.float32)
        self.lib.f32_gemm_pack(weight.data_ptr(), weight.stride(0), n, k, panels.data_ptr())
        return panels

    def unpack(self, panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """The dense [n, k] weight that `pack` made these panels from (exact: a copy)."""
        nb = self.panel_width
        return panels.view(-1, k, nb).transpose(1, 2).reshape(-1, k)[:n].contiguous()

    def linear(self, x: torch.Tensor, panels: torch.Tensor, out_features: int,
               bias: torch.Tensor | None) -> torch.Tensor:
        """y [..., out_features] = x [..., k] · Wᵀ (+ bias) for W packed by `pack`."""
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if x2.dtype != torch.float32 or x2.stride(-1) != 1:
            x2 = x2.float().contiguous()
        if panels.numel() != -(-out_features // self.panel_width) * self.panel_width * k:
            raise ValueError(f"these panels do not hold a [{out_features}, {k}] weight")
        if bias is not None and (bias.dtype != torch.float32 or bias.numel() != out_features
                                 or not bias.is_contiguous()):
            raise ValueError(f"bias must be a contiguous float32 [{out_features}] tensor")
        y = torch.empty((x2.shape[0], out_features), dtype=torch.float32)
        self.lib.f32_gemm(x2.data_ptr(), x2.stride(0), x2.shape[0], k, panels.data_ptr(), out_features,
                          None if bias is None else bias.data_ptr(), y.data_ptr(), out_features)
        return y.reshape(*lead, out_features)


def native_row_limit(build_isa: str, cpu_detected: str, tile_rows: int) -> int:
    """The most rows a build for `build_isa` takes before oneDNN's packed GEMM does better, on a CPU whose highest
    level is `cpu_detected` (oneDNN picks its own kernels by that, whatever PAGEDLLM_CPU_ISA says)."""
    if build_isa.startswith("avx512"):
        return tile_rows * TILES_AVX512
    if build_isa == "avx2" and cpu_detected == "avx2":
        return ROWS_AVX2_CPU
    return tile_rows * TILES_OTHER


@functools.cache
def load_f32_gemm(isa: str | None = None) -> F32Gemm | None:
    """The build for `isa` (default: kernels/cpu_isa.py's level, which honours PAGEDLLM_CPU_ISA), or None
    where it cannot be built (the reason is logged once). Cached per argument."""
    isa = isa or cpu_isa.detect_cpu_isa().name
    try:
        path = build_library(SOURCE, isa, BUILD_FLAGS)
        return F32Gemm(ctypes.CDLL(str(path)), path, isa)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("float32 small-batch GEMM kernel unavailable (%s); oneDNN runs every row count", e)
        return None
