"""Keep the CPU path's per-step activations off the page-fault path.

Each step allocates and frees the same large tensors (a 2048-token MLP activation is 25 MB, a
64-row logits matrix 12.6 MB). glibc serves such sizes with fresh mmaps and trims its heap after
frees, so every step page-faults and zeroes that memory again: a fifth of a CPU decode step on the
bundled model (BENCHMARKS.md). A fixed mmap threshold at glibc's maximum and a high trim threshold
keep freed blocks in the heap for the next step, as tcmalloc/jemalloc would.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger("pagedllm")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD_BYTES = (1 << 31) - 1  # mallopt takes an int


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def glibc_mallinfo_available() -> bool:
    """Whether this C library has glibc's mallinfo2 (glibc >= 2.33)."""
    libc = _libc()
    return libc is not None and hasattr(libc, "mallinfo2")


def malloc_in_use_bytes() -> int:
    """Bytes the C allocator has handed out and not got back, over all arenas (glibc mallinfo2):
    native memory in use, without the freed memory the thresholds above keep for reuse."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        raise RuntimeError("malloc_in_use_bytes needs glibc's mallinfo2 (glibc >= 2.33)")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def keep_freed_memory_for_reuse() -> bool:
    """Set glibc's malloc thresholds (process-wide); False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    if ok:
        logger.info("malloc: mmap threshold %d MiB, trim threshold %d MiB (freed activations are reused)",
                    MMAP_THRESHOLD_BYTES >> 20, TRIM_THRESHOLD_BYTES >> 20)
    return ok


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_free_memory() -> float | None:
    """Give the C allocator's free pages back to the OS (glibc malloc_trim(0), every arena).

    The thresholds above keep freed activations resident while steps run; once the engine is idle
    that memory (tens of MiB after a burst of varied batch shapes, more in a fragmented heap) is
    only RSS. Returns the MiB of RSS released, None where the C library is not glibc."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return None
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    before = _rss_bytes()
    libc.malloc_trim(0)
    return max(before - _rss_bytes(), 0) / 2**20
