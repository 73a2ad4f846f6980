"""Which x86 vector ISA the CPU path builds its native kernels for, and the compiler flags of each.

Detected once per process from the CPU's feature flags (/proc/cpuinfo), from the highest level down:

    avx512_bf16  AVX-512 F/BW/VL/DQ + AVX512_BF16 (Zen 4/5, Sapphire Rapids and later)
    avx512       AVX-512 F/BW/VL/DQ (Skylake-SP, Cascade Lake, Ice Lake)
    avx2         AVX2 + FMA + F16C (Haswell and later, every Zen)
    portable     anything else (plain x86-64 SSE2, or another architecture): -O3 only

``PAGEDLLM_CPU_ISA={avx512_bf16,avx512,avx2,portable}`` forces a level at or below the detected one
(so an AVX-512 machine can run and test the AVX2 and portable kernels); a level above it is an error.
The flags are explicit (``-mavx2 -mfma -mf16c``), never ``-march=native``: the build is named by its
ISA, and a library built for one level runs on every CPU of that level or above.

Other kernels (e.g. quantized GEMMs) take the same level: ``c_compile_flags(detect_cpu_isa().name)``.
"""
from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import dataclass

logger = logging.getLogger("pagedllm")

ISA_ENV = "PAGEDLLM_CPU_ISA"
ISA_LEVELS = ("portable", "avx2", "avx512", "avx512_bf16")  # ascending: each level includes the ones before

# The /proc/cpuinfo flags each level needs (on top of the level below it).
_REQUIRED_FLAGS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_bf16": ("avx512_bf16",),
}

_ISA_CFLAGS = {
    "portable": (),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
    "avx512_bf16": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                    "-mavx512bf16", "-mavx512vnni"),
}


@dataclass(frozen=True)
class CpuIsa:
    """The level the kernels are built for (`name`), the highest this CPU supports (`detected`), the
    CPU's flags, and why `name` was chosen (for the start-up log)."""

    name: str
    detected: str
    flags: frozenset[str]
    reason: str

    @property
    def has_vnni(self) -> bool:
        """AVX-512 VNNI or AVX-VNNI (int8 dot products) on this CPU, whatever level was chosen."""
        return bool({"avx512_vnni", "avx_vnni"} & self.flags)

    def at_least(self, level: str) -> bool:
        """Whether the chosen level includes `level` (one of ISA_LEVELS)."""
        return ISA_LEVELS.index(self.name) >= ISA_LEVELS.index(_check_level(level, "level"))


def c_compile_flags(isa: str) -> list[str]:
    """Optimisation and ISA flags for a C kernel built for `isa` (one of ISA_LEVELS), e.g.
    ``avx2 → ['-O3', '-mavx2', '-mfma', '-mf16c']``, ``portable → ['-O3']``. The caller adds the
    rest (``-fPIC -shared``, OpenMP). Code picks its paths with ``#if defined(__AVX512F__)`` /
    ``__AVX2__`` / scalar, which these flags set."""
    return ["-O3", *_ISA_CFLAGS[_check_level(isa, "isa")]]


def uses_libmvec(isa: str) -> bool:
    """Whether kernels built for `isa` call glibc's vector math library (vector expf): AVX2 and above."""
    return _check_level(isa, "isa") != "portable" and _is_x86_64()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none: e.g. macOS)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def isa_from_flags(flags: frozenset[str] | set[str]) -> str:
    """The highest level of ISA_LEVELS whose flags (and those of every level below) are all present."""
    best = "portable"
    for level in ISA_LEVELS[1:]:
        if not all(f in flags for f in _REQUIRED_FLAGS[level]):
            break
        best = level
    return best


def missing_flags(flags: frozenset[str] | set[str], level: str) -> list[str]:
    """The CPU flags `level` needs that `flags` lacks (all levels up to it)."""
    need = [f for lv in ISA_LEVELS[1 : ISA_LEVELS.index(_check_level(level, "level")) + 1] for f in _REQUIRED_FLAGS[lv]]
    return [f for f in need if f not in flags]


def detect_cpu_isa() -> CpuIsa:
    """The level to build for: the CPU's highest, or ``PAGEDLLM_CPU_ISA`` if set (ValueError when that
    is not a level or is above what the CPU supports). Logged once per process and choice."""
    return _resolve(os.environ.get(ISA_ENV, "").strip().lower())


@functools.cache
def _resolve(forced: str) -> CpuIsa:
    flags = cpu_flags() if _is_x86_64() else frozenset()
    detected = isa_from_flags(flags)
    if not forced:
        shown = " ".join(f for lv in ISA_LEVELS[1 : ISA_LEVELS.index(detected) + 1] for f in _REQUIRED_FLAGS[lv])
        reason = (f"the CPU's highest level (flags: {shown})" if detected != "portable" else
                  f"no AVX2+FMA+F16C on this CPU ({platform.machine()}): scalar code, -O3 only")
        isa = CpuIsa(detected, detected, flags, reason)
    else:
        if forced not in ISA_LEVELS:
            raise ValueError(f"{ISA_ENV}={forced!r} is not one of {ISA_LEVELS}")
        if ISA_LEVELS.index(forced) > ISA_LEVELS.index(detected):
            raise ValueError(
                f"{ISA_ENV}={forced} is above what this CPU supports: it lacks "
                f"{', '.join(missing_flags(flags, forced))} (highest level here: {detected}). "
                f"Allowed here: {', '.join(ISA_LEVELS[: ISA_LEVELS.index(detected) + 1])}."
            )
        isa = CpuIsa(forced, detected, flags, f"forced by {ISA_ENV}={forced} (the CPU supports {detected})")
    logger.info("CPU ISA: %s, %s", isa.name, isa.reason)
    return isa


def _check_level(level: str, what: str) -> str:
    if level not in ISA_LEVELS:
        raise ValueError(f"{what} {level!r} is not one of {ISA_LEVELS}")
    return level


def _is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")
