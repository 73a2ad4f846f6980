"""GGUF-quantized linear kernels for the CPU (kernels/cpu/quant_ops.c), built on first use, called via ctypes.

Weights stay in memory as their GGUF quants (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4), repacked once
at load into groups of 16 interleaved rows ("R16", quant_ops.c describes it; the 4- and 8-bit types' bytes rearranged,
MXFP4's nibbles and E8M0 exponents exactly the file's size, the 5- and 6-bit types' quants widened to one byte each:
1.3-1.6x the file's bytes). Two GEMM designs are built:
``int8`` quantizes the activations per row into blocks of 32 int8 and multiplies them with integer dot
products, one vector lane per weight row (AVX-512 VNNI / AVX-VNNI / AVX2), and ``dequant`` dequantizes a group
of rows into fp32 and uses FMAs (activations not rounded). ``int8`` is the default at every batch size
(BENCHMARKS.md, "GGUF GEMM on interleaved rows", has the measurement); both designs give a row the same bits
whatever it is batched with, and ``int8`` gives the same bits on every ISA level.

The library is built for the CPU's ISA level (kernels/cpu_isa.py: ``PAGEDLLM_CPU_ISA`` forces a lower
one, e.g. ``avx2`` or ``portable``, so any machine can test every path), plus the CPU's int8 dot-product
extension (AVX-512 VNNI or AVX-VNNI) when the level is not forced below the CPU's own.
``PAGEDLLM_QUANT_GEMM`` = ``auto`` | ``int8`` | ``dequant`` forces one design.

``PAGEDLLM_CPU_AMX=1`` lets the ``int8`` design multiply the whole 16-row sets of batches of 64 rows and more
with AMX-INT8 tiles on CPUs that have them (and Linux's permission to use tile data), giving every row the same
bits as the vector path; the ISA string (``QuantKernels.isa``) then ends in ``+amx_int8``. It is off by
default: on a Sapphire Rapids-class Xeon it measured no faster than AVX-512 VNNI below 64 rows, 1.05-1.09x
at 64 and 1.16x at 128 (quant_ops.c says why), and it stays off when ``PAGEDLLM_CPU_ISA`` forces a level
below the CPU's own.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedllm.kernels import cpu_isa
from pagedllm.kernels.cpu_kernels import build_library

logger = logging.getLogger("pagedllm")

SOURCE = Path(__file__).with_name("cpu") / "quant_ops.c"
GEMM_ENV = "PAGEDLLM_QUANT_GEMM"
GEMM_METHODS = ("auto", "int8", "dequant")
METHOD_CODES = {"int8": 0, "dequant": 1}  # quant_linear's `method` argument
AMX_ENV = "PAGEDLLM_CPU_AMX"  # "1": AMX tiles for the int8 GEMM where the CPU has them; "0" (default): vectors only
# quant_amx_configure's answers
AMX_STATUS = {1: "on", 0: "off", -1: "not in this build (needs the AVX-512 build and gcc >= 11 / clang >= 12)",
              -2: "the CPU or its OS lacks AMX-INT8", -3: "Linux refused tile data permission (arch_prctl)"}

# ggml_type codes and (elements, bytes) per block
GGML_TYPES: dict[str, int] = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13,
                              "Q6_K": 14, "MXFP4": 39}
BLOCK_LAYOUT: dict[int, tuple[int, int]] = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
                                            12: (256, 144), 13: (256, 176), 14: (256, 210), 39: (32, 17)}
TYPE_NAMES: dict[int, str] = {v: k for k, v in GGML_TYPES.items()}
# The qtype of a weight made of row segments, each in its own type (quant_ops.c's T_SEGMENTS: a fused layer whose
# parts the file stores in different types, e.g. Q4_K_M's q | k | v = Q4_K, Q4_K, Q6_K); its data starts with a
# SEGMENT_HEADER-byte table (count, then type, rows and byte offset of each segment), each segment's R16 weight after.
SEGMENTS = 1000
SEGMENT_HEADER, MAX_SEGMENTS = 256, 10

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


@dataclass
class GGUFWeight:
    """A [N, K] weight held as GGUF quants in the R16 layout: ``data`` is uint8, ``r16_bytes`` long
    (build one from the file's blocks with :meth:`from_gguf_blocks`)."""

    data: torch.Tensor
    qtype: int
    out_features: int
    in_features: int
    # "auto" picks the GEMM design (choose_method); "int8" / "dequant" pin one design.
    gemm_method: str = "auto"
    # qtype SEGMENTS: (qtype, rows) of each row segment, in row order (from_segments); () otherwise
    segments: tuple[tuple[int, int], ...] = ()
    data_ptr: int = field(init=False, repr=False)  # the quants' address, handed to the kernels

    def __post_init__(self) -> None:
        if self.qtype == SEGMENTS:
            if sum(rows for _, rows in self.segments) != self.out_features:
                raise ValueError(f"segments {self.segments} do not add up to {self.out_features} rows")
            expected = segmented_bytes(self.segments, self.in_features)
        elif self.qtype not in BLOCK_LAYOUT:
            raise ValueError(f"GGUF type {self.qtype} is not served quantized; supported: {sorted(GGML_TYPES)}")
        else:
            expected = r16_bytes(self.qtype, self.out_features, self.in_features)
        if self.data.dtype != torch.uint8 or self.data.shape != (expected,) or not self.data.is_contiguous():
            raise ValueError(f"R16 weight data must be contiguous uint8 ({expected},), got "
                             f"{self.data.dtype} {tuple(self.data.shape)}")
        if self.gemm_method not in GEMM_METHODS:
            raise ValueError(f"gemm_method must be one of {list(GEMM_METHODS)}, got {self.gemm_method!r}")
        self.data_ptr = self.data.data_ptr()

    @classmethod
    def from_gguf_blocks(cls, blocks: torch.Tensor, qtype: int, out_features: int, in_features: int,
                         gemm_method: str = "auto") -> GGUFWeight:
        """Repack the file's blocks (uint8 [N, row_bytes], rows in HF order) into R16."""
        expected = (out_features, row_bytes(qtype, in_features))
        if blocks.dtype != torch.uint8 or tuple(blocks.shape) != expected:
            raise ValueError(f"GGUF weight data must be uint8 {expected}, got {blocks.dtype} {tuple(blocks.shape)}")
        packed = load_quant_kernels().repack(blocks.contiguous(), qtype, out_features, in_features)
        return cls(packed, qtype, out_features, in_features, gemm_method)

    @classmethod
    def from_segments(cls, parts: list[tuple[torch.Tensor, int]], in_features: int,
                      gemm_method: str = "auto") -> GGUFWeight:
        """One weight of row segments: ``parts`` are (blocks uint8 [rows, row_bytes], qtype) in row order (a fused
        layer's q, k, v or gate, up). Neighbours of one type are joined; a single type gives a plain weight."""
        merged: list[tuple[list[torch.Tensor], int]] = []
        for blocks, qtype in parts:
            if merged and merged[-1][1] == qtype:
                merged[-1][0].append(blocks)
            else:
                merged.append(([blocks], qtype))
        joined = [(torch.cat(b) if len(b) > 1 else b[0], t) for b, t in merged]
        rows = sum(b.shape[0] for b, _ in joined)
        if len(joined) == 1:
            return cls.from_gguf_blocks(joined[0][0], joined[0][1], rows, in_features, gemm_method)
        if len(joined) > MAX_SEGMENTS:
            raise ValueError(f"at most {MAX_SEGMENTS} segments of different types, got {len(joined)}")
        segments = tuple((t, int(b.shape[0])) for b, t in joined)
        data = torch.zeros(segmented_bytes(segments, in_features), dtype=torch.uint8)
        table, offset = [len(segments)], SEGMENT_HEADER
        for blocks, qtype in joined:
            w = cls.from_gguf_blocks(blocks, qtype, blocks.shape[0], in_features)
            data[offset:offset + w.nbytes] = w.data
            table += [qtype, blocks.shape[0], offset]
            offset += _aligned(w.nbytes)
        data[:8 * len(table)] = torch.tensor(table, dtype=torch.int64).view(torch.uint8)
        return cls(data, SEGMENTS, rows, in_features, gemm_method, segments)

    @property
    def type_name(self) -> str:
        """The GGUF type's name; a segmented weight's types in row order joined by "+" (e.g. ``Q4_K+Q6_K``)."""
        if self.qtype == SEGMENTS:
            return "+".join(TYPE_NAMES[t] for t, _ in self.segments)
        return TYPE_NAMES[self.qtype]

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def _aligned(nbytes: int) -> int:
    return (nbytes + 63) // 64 * 64


def segmented_bytes(segments: tuple[tuple[int, int], ...], k: int) -> int:
    """Bytes of a SEGMENTS weight: the table, then each (qtype, rows) segment's R16 bytes, 64-byte aligned."""
    return SEGMENT_HEADER + sum(_aligned(r16_bytes(t, rows, k)) for t, rows in segments)


def r16_bytes(qtype: int, n: int, k: int) -> int:
    """Bytes of an [n, k] weight in the R16 layout (rows padded to a multiple of 16; quant_ops.c owns the
    layout); ValueError for an unsupported type or a ``k`` that is not a whole number of blocks."""
    row_bytes(qtype, k)  # the clear error
    return load_quant_kernels().r16_bytes(qtype, n, k)


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of ``k`` elements; ValueError when ``k`` is not a whole number of blocks."""
    if qtype not in BLOCK_LAYOUT:
        raise ValueError(f"GGUF type {qtype} is not supported; supported: {sorted(GGML_TYPES)}")
    elems, nbytes = BLOCK_LAYOUT[qtype]
    if k % elems:
        raise ValueError(f"{TYPE_NAMES[qtype]} rows need a multiple of {elems} elements, got {k}")
    return k // elems * nbytes


class QuantKernels:
    """Typed wrappers over one build of quant_ops.c."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._linear = lib.quant_linear
        self._linear.restype = _int
        self._linear.argtypes = [_int, _ptr, _i64, _i64, _ptr, _i64, _ptr, _int]
        self._dequant = lib.dequantize_rows
        self._dequant.restype = _int
        self._dequant.argtypes = [_int, _ptr, _i64, _ptr, _i64, _ptr]
        self._dequant_segments = getattr(lib, "dequantize_rows_segments", None)  # absent from older variants
        if self._dequant_segments is not None:
            self._dequant_segments.restype = _int
            self._dequant_segments.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr]
        self._repack = lib.repack_r16
        self._repack.restype = _int
        self._repack.argtypes = [_int, _ptr, _i64, _i64, _ptr]
        self._r16_bytes = lib.r16_bytes
        self._r16_bytes.restype = _i64
        self._r16_bytes.argtypes = [_int, _i64, _i64]
        self._isa = lib.quant_isa
        self._isa.restype = ctypes.c_char_p
        # absent from builds of older quant_ops.c variants (benchmarks/results probes load those)
        self._amx_configure = getattr(lib, "quant_amx_configure", None)
        self._amx_min_rows = getattr(lib, "quant_amx_min_rows", None)
        if self._amx_configure is not None:
            self._amx_configure.restype = _int
            self._amx_configure.argtypes = [_int, _int]
            self._amx_min_rows.restype = _int

    @property
    def isa(self) -> str:
        """The int8 GEMM's instructions, e.g. ``avx512_vnni`` or ``avx512_vnni+amx_int8`` (AMX in use)."""
        return self._isa().decode()

    @property
    def amx(self) -> bool:
        """Whether the int8 GEMM takes AMX tiles (for batches of at least ``amx_min_rows`` rows)."""
        return self.isa.endswith("+amx_int8")

    @property
    def amx_min_rows(self) -> int:
        """The smallest batch that takes tiles (then its whole 16-row sets; the other rows stay on vectors)."""
        return int(self._amx_min_rows()) if self._amx_min_rows is not None else 0

    def configure_amx(self, enable: bool, min_rows: int = 0) -> str:
        """Turn the AMX path on or off for this library (for all its callers), for batches of at least
        ``min_rows`` rows (0: the measured default, 64; at least 16). Returns AMX_STATUS's word for the outcome:
        "on", "off", or why it cannot be on."""
        if self._amx_configure is None:
            return AMX_STATUS[-1]
        return AMX_STATUS[int(self._amx_configure(int(enable), int(min_rows)))]

    def c_functions(self) -> tuple:
        """(quant_linear, dequantize_rows): the typed C entry points without this class's checks, for callers
        that checked their inputs once (model/cpu_direct_forward.py)."""
        return self._linear, self._dequant

    def linear(self, x: torch.Tensor, w: GGUFWeight, method: str = "auto") -> torch.Tensor:
        """y = x Wᵀ for float32 x [..., K]; ``method`` is auto, int8 or dequant. (Called ~120 times per decode
        step of a small model: the common case, 2-D contiguous x, takes no copies.)"""
        if x.dtype is not torch.float32 or not x.is_cpu:
            raise ValueError(f"GGUF linear needs float32 CPU activations, got {x.dtype} on {x.device}")
        k = x.shape[-1]
        if k != w.in_features:
            raise ValueError(f"GGUF linear: input has {k} features, weight expects {w.in_features}")
        flat = x.dim() == 2 and x.is_contiguous()
        x2 = x if flat else x.reshape(-1, k).contiguous()
        m = x2.shape[0]
        y = torch.empty((m, w.out_features), dtype=torch.float32)
        if m:
            code = METHOD_CODES[choose_method() if method == "auto" else method]
            rc = self._linear(w.qtype, w.data_ptr, w.out_features, k, x2.data_ptr(), m, y.data_ptr(), code)
            if rc:
                raise RuntimeError(f"quant_linear failed with status {rc} ({w.type_name}, K={k})")
        return y if flat else y.view(*x.shape[:-1], w.out_features)

    def r16_bytes(self, qtype: int, n: int, k: int) -> int:
        """Bytes of an [n, k] weight in the R16 layout (0 for an unsupported type or k)."""
        return int(self._r16_bytes(qtype, n, k))

    def repack(self, blocks: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
        """The R16 bytes of GGUF blocks uint8 [n, row_bytes] (contiguous)."""
        out = torch.empty(r16_bytes(qtype, n, k), dtype=torch.uint8)
        if self._repack(qtype, blocks.data_ptr(), n, k, out.data_ptr()):
            raise ValueError(f"cannot repack {TYPE_NAMES.get(qtype, qtype)} rows of {k} elements")
        return out

    def dequantize_rows(self, w: GGUFWeight, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), K]: the listed rows of ``w`` dequantized (bit-exact with gguf.quants)."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= w.out_features):
            raise ValueError(f"row ids must lie in [0, {w.out_features}), got [{int(flat.min())}, {int(flat.max())}]")
        out = torch.empty(flat.numel(), w.in_features, dtype=torch.float32)
        if flat.numel():
            if w.qtype == SEGMENTS:
                rc = self._dequant_segments(w.data_ptr, w.out_features, w.in_features, flat.data_ptr(),
                                            flat.numel(), out.data_ptr())
            else:
                rc = self._dequant(w.qtype, w.data_ptr, w.in_features, flat.data_ptr(), flat.numel(),
                                   out.data_ptr())
            if rc:
                raise RuntimeError(f"dequantize_rows failed with status {rc}")
        return out.view(*ids.shape, w.in_features)


def choose_method() -> str:
    """The GEMM design of "auto": int8 at every batch size (``PAGEDLLM_QUANT_GEMM`` overrides)."""
    forced = os.environ.get(GEMM_ENV, "auto")
    if forced not in GEMM_METHODS:
        raise ValueError(f"{GEMM_ENV} must be one of {list(GEMM_METHODS)}, got {forced!r}")
    return "int8" if forced == "auto" else forced


def amx_wanted(isa: cpu_isa.CpuIsa, level: str) -> tuple[bool, str]:
    """Whether a build for ``level`` should try AMX, and why not: only with ``PAGEDLLM_CPU_AMX=1``, at the CPU's
    own level (a forced lower one tests the vector paths), on a CPU with amx_tile and amx_int8."""
    setting = os.environ.get(AMX_ENV, "0").strip() or "0"
    if setting not in ("0", "1"):
        raise ValueError(f"{AMX_ENV} must be 0 or 1, got {setting!r}")
    if not {"amx_tile", "amx_int8"} <= isa.flags:
        return False, "the CPU has no AMX-INT8"
    if setting == "0":
        return False, f"off ({AMX_ENV}=1 turns it on)"
    if level != isa.detected:
        return False, f"the {level} build is below the CPU's own level ({isa.detected})"
    return True, ""


def vnni_flags(isa: cpu_isa.CpuIsa) -> tuple[str, ...]:
    """The int8 dot-product extension to compile in: the CPU's own, and only at its own level (a forced
    lower level tests the plain AVX2 / scalar int8 paths)."""
    if isa.name != isa.detected:
        return ()
    if "avx512_vnni" in isa.flags and isa.at_least("avx512"):
        return ("-mavx512vnni",)
    if "avx_vnni" in isa.flags and isa.at_least("avx2"):
        return ("-mavxvnni",)
    return ()


@functools.cache
def load_quant_kernels(level: str | None = None) -> QuantKernels:
    """The kernels built for ISA ``level`` (one of cpu_isa.ISA_LEVELS; default: ``cpu_isa.detect_cpu_isa()``);
    raises if they cannot be built, or if ``level`` is above what the CPU supports."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"GGUF quantized kernels are written for x86-64, this CPU is {platform.machine()}")
    isa = cpu_isa.detect_cpu_isa()
    level = level or isa.name
    allowed = cpu_isa.ISA_LEVELS[: cpu_isa.ISA_LEVELS.index(isa.detected) + 1]
    if level not in allowed:
        raise ValueError(f"ISA level {level!r} cannot be built and run here: allowed {allowed}")
    extra = vnni_flags(isa) if level == isa.name else ()
    path = build_library(SOURCE, level, extra)
    kernels = QuantKernels(ctypes.CDLL(str(path)), path)
    want, why_not = amx_wanted(isa, level)
    if want:
        outcome = kernels.configure_amx(True)
        why_not = "" if kernels.amx else outcome
        if why_not:
            logger.warning("GGUF quantized kernels: AMX-INT8 not used: %s", why_not)
    logger.info("GGUF quantized kernels: %s build (%s%s)", level, kernels.isa,
                f", AMX tiles from {kernels.amx_min_rows} rows" if kernels.amx else f"; AMX {why_not}")
    return kernels
