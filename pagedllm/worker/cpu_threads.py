"""Which CPUs a CPU rank's OpenMP threads run on: vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` and
``VLLM_CPU_NUM_OF_RESERVED_CPU``.

``VLLM_CPU_OMP_THREADS_BIND``:
- ``auto`` (the default): each tensor-parallel rank takes one NUMA node's CPUs (one logical CPU per physical core,
  unless torch was given more threads than that: then SMT siblings too); with fewer nodes than ranks, the allowed
  CPUs are split into equal contiguous shares. The thread count stays what torch was given (``OMP_NUM_THREADS``,
  ``torch.set_num_threads``), at most the share's size.
- a CPU list per rank, ranks separated by ``|``: ``0-31|32-63`` (rank 0 on CPUs 0–31, rank 1 on 32–63); one
  thread per listed CPU.
- ``nobind`` (older vLLM: ``all``): no pinning; each rank runs ``cores // ranks`` threads.

``VLLM_CPU_NUM_OF_RESERVED_CPU`` (``auto`` only): CPUs taken off the end of each rank's share for the rest of the
process (the API server, tokenizers). Unset: none with one rank, one per rank with several, where a rank keeps at
least one CPU.

Worker thread i > 0 is pinned to the i-th CPU of its rank's list; the engine's own thread (the OpenMP master) may
run on any CPU of the list, so threads it starts later are not stacked on one CPU. Data-parallel ranks
(engine/dp_client.py) get disjoint lists through the same variable.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import weakref
from pathlib import Path

logger = logging.getLogger("pagedllm")

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
# The CPUs the first binding process was allowed: set once, inherited by the processes it starts, so a later
# split sees the whole machine, not a rank's pinned share.
ALLOWED_ENV = "PAGEDLLM_CPU_ALLOWED"
NO_BIND = ("nobind", "all")
SOURCE = Path(__file__).resolve().parents[1] / "kernels" / "cpu" / "thread_affinity.c"
_SYS_CPU = Path("/sys/devices/system/cpu")
_SYS_NODE = Path("/sys/devices/system/node")


def parse_cpu_list(text: str, what: str = BIND_ENV) -> list[int]:
    """``"0-3,8,10-11"`` → [0, 1, 2, 3, 8, 10, 11]; a clear ValueError for anything else."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = (int(lo), int(hi)) if sep else (int(part), int(part))
        except ValueError:
            raise ValueError(f"{what}: {part!r} in {text!r} is not a CPU number or range; write CPU lists like "
                             "'0-3,8' with '|' between ranks ('0-31|32-63'), or 'auto' / 'nobind'") from None
        if first < 0 or last < first:
            raise ValueError(f"{what}: {part!r} in {text!r} is not a CPU range (first <= last, both >= 0)")
        cpus.extend(range(first, last + 1))
    repeated = sorted({c for c in cpus if cpus.count(c) > 1})
    if repeated:
        raise ValueError(f"{what}: CPU(s) {repeated} listed more than once in {text!r}")
    return cpus


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] → ``"0-2,5"``."""
    runs: list[list[int]] = []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def allowed_cpus() -> list[int]:
    """The CPUs this process tree may use (before any rank was pinned)."""
    recorded = os.environ.get(ALLOWED_ENV)
    if recorded:
        return parse_cpu_list(recorded, ALLOWED_ENV)
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))


def _read_cpu_list(path: Path) -> list[int] | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return parse_cpu_list(text, str(path)) if text else []


def numa_nodes(allowed: list[int]) -> list[list[int]]:
    """The allowed CPUs grouped by NUMA node (one group when the system does not say)."""
    nodes = []
    for node in sorted(_SYS_NODE.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        listed = _read_cpu_list(node / "cpulist")
        group = [c for c in (listed or []) if c in allowed]
        if group:
            nodes.append(group)
    covered = {c for group in nodes for c in group}
    return nodes if covered == set(allowed) else [list(allowed)]


def one_per_core(cpus: list[int]) -> list[int]:
    """Drop SMT siblings: the lowest listed logical CPU of each physical core."""
    kept, seen = [], set()
    for c in cpus:
        siblings = _read_cpu_list(_SYS_CPU / f"cpu{c}" / "topology" / "thread_siblings_list") or [c]
        core = min(s for s in siblings if s in cpus or s == c)
        if core not in seen:
            seen.add(core)
            kept.append(c)
    return kept


def _reserved(num_ranks: int) -> tuple[int, bool]:
    """(CPUs to reserve per rank, whether the user asked for that number)."""
    raw = os.environ.get(RESERVED_ENV, "").strip()
    if not raw:
        return (0 if num_ranks == 1 else 1), False
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{RESERVED_ENV}={raw!r}: expected a whole number of CPUs >= 0")
    return value, True


def cpus_for_ranks(value: str, num_ranks: int, allowed: list[int] | None = None,
                   nodes: list[list[int]] | None = None, physical_cores_only: bool = True) -> list[list[int]] | None:
    """Each rank's CPU list under ``VLLM_CPU_OMP_THREADS_BIND=value`` (None: no binding); ``auto`` takes one logical
    CPU per physical core unless `physical_cores_only` is False."""
    value = value.strip() or "auto"
    if value.lower() in NO_BIND:
        return None
    allowed = allowed_cpus() if allowed is None else allowed
    if value.lower() != "auto":
        groups = [parse_cpu_list(g) for g in value.split("|")]
        if len(groups) != num_ranks:
            raise ValueError(f"{BIND_ENV}={value!r} gives {len(groups)} CPU list(s) for {num_ranks} rank(s); give one "
                             "per rank, separated by '|' (e.g. '0-31|32-63' for two), or 'auto' / 'nobind'")
        outside = sorted({c for g in groups for c in g} - set(allowed))
        if outside:
            raise ValueError(f"{BIND_ENV}={value!r}: CPU(s) {outside} are not available to this process "
                             f"(allowed: {format_cpu_list(allowed)})")
        return groups
    nodes = numa_nodes(allowed) if nodes is None else nodes
    if physical_cores_only:
        nodes = [one_per_core(n) for n in nodes]
    if len(nodes) >= num_ranks:
        shares = nodes[:num_ranks]
    else:
        flat = [c for n in nodes for c in n]
        if len(flat) < num_ranks:
            raise ValueError(f"{BIND_ENV}=auto: {num_ranks} ranks need at least one CPU each; {len(flat)} "
                             f"physical cores are available ({format_cpu_list(flat)}); use fewer ranks or 'nobind'")
        size, extra = divmod(len(flat), num_ranks)
        shares, start = [], 0
        for r in range(num_ranks):
            end = start + size + (r < extra)
            shares.append(flat[start:end])
            start = end
    reserved, asked = _reserved(num_ranks)
    if reserved:
        if asked and any(len(s) <= reserved for s in shares):
            raise ValueError(f"{RESERVED_ENV}={reserved} leaves a rank no CPU (shares of "
                             f"{min(len(s) for s in shares)} CPU(s)); reserve fewer")
        shares = [s[:-reserved] if len(s) > reserved else s for s in shares]
    return shares


@functools.cache
def _affinity_lib():
    from pagedllm.kernels.cpu_kernels import build_library

    lib = ctypes.CDLL(str(build_library(SOURCE, "portable")))
    lib.bind_omp_threads.restype = ctypes.c_int
    lib.bind_omp_threads.argtypes = [ctypes.POINTER(ctypes.c_int32), ctypes.c_int, ctypes.c_int]
    return lib


def _pin(cpus: list[int], threads: int) -> str:
    """Pin a team of `threads` OpenMP threads to `cpus` (see the module docstring); returns how."""
    try:
        lib = _affinity_lib()
    except (OSError, RuntimeError) as e:  # no C compiler
        _confine_process(cpus)
        return f"the process confined to them (no per-thread pinning: {e})"
    array = (ctypes.c_int32 * len(cpus))(*cpus)
    status = lib.bind_omp_threads(array, len(cpus), threads)
    if status != 0:
        _confine_process(cpus)
        return f"the process confined to them (pinning each thread failed: {status})"
    return "one thread per CPU"


def _confine_process(cpus: list[int]) -> None:
    for tid in os.listdir("/proc/self/task"):
        _set_thread_affinity(int(tid), cpus)


def configure_cpu_threads(rank: int, world_size: int) -> list[int] | None:
    """Set this CPU rank's thread count and pin its threads as the environment says; returns its CPUs (None:
    not pinned)."""
    import torch

    value = os.environ.get(BIND_ENV, "auto")
    os.environ.setdefault(ALLOWED_ENV, format_cpu_list(allowed_cpus()))
    shares = cpus_for_ranks(value, world_size)
    auto = value.strip().lower() in ("", "auto")
    if auto and shares is not None and len(shares[rank]) < torch.get_num_threads():
        # more threads asked for (OMP_NUM_THREADS, torch.set_num_threads) than physical cores: SMT siblings too
        shares = cpus_for_ranks(value, world_size, physical_cores_only=False)
    if shares is None or not hasattr(os, "sched_setaffinity"):  # (an OS without CPU affinity: as nobind)
        if world_size > 1:  # the ranks must not oversubscribe the CPU
            torch.set_num_threads(max(1, len(allowed_cpus()) // world_size))
        return None
    cpus = shares[rank]
    threads = len(cpus)
    if auto:
        threads = max(1, min(threads, torch.get_num_threads()))
    torch.set_num_threads(threads)
    how = _pin(cpus, threads)
    logger.info("CPU threads of rank %d: %d on CPUs %s, %s (%s=%s)", rank, threads, format_cpu_list(cpus), how,
                BIND_ENV, value)
    return cpus


def keep_thread_affinity(owner: object) -> weakref.finalize:
    """The calling thread's CPUs now, given back to it when the returned finalizer is called or `owner` is
    collected: a tensor-parallel driver pins the caller's thread as rank 0, and the caller's process outlives it."""
    if not hasattr(os, "sched_getaffinity"):  # (no CPU affinity on this OS: nothing was pinned)
        return weakref.finalize(owner, lambda: None)
    return weakref.finalize(owner, _set_thread_affinity, threading.get_native_id(), sorted(os.sched_getaffinity(0)))


def _set_thread_affinity(tid: int, cpus: list[int]) -> None:
    try:
        os.sched_setaffinity(tid, cpus)
    except OSError:  # the thread has ended
        pass
