"""Achieved float32 GFLOP/s of a CPU run against the machine's FMA peak, both measured in the same run.

Peak: kernels/cpu/fma_peak.c (independent vector FMA chains on every thread, built for the ISA level in
use, so a forced AVX2 level is measured at the AVX2 width), best of a few short runs. Also printed for
reference: the best rate of a large float32 ``torch.mm`` on the same threads (what a tuned GEMM gets).

Work, per step (benchmarks/lower_bound.py's shape, worker/step_stats.py's per-step records)::

    F = 2·N_mm·tokens  +  4·L·Hq·D·attended  +  2·H·V·logits_rows

(decoder-layer matmuls for every token; QKᵀ and PV over the context each query token attends to; the
lm_head only for the rows that produce logits). Elementwise ops, norms and softmax are not counted.

Rates are printed twice: per wall-clock second (what a user sees), and per CPU second of the process
(``time.process_time``, all threads) against the FMA loop's own FLOPs per CPU second. On a machine shared
with other processes the second pair is the one that stays put: neither side is charged for the time
the cores ran someone else. With several threads, CPU time includes OpenMP threads spinning at
barriers, so the CPU-time fraction is then a lower bound.
"""
from __future__ import annotations

import ctypes
import functools
import time
from dataclasses import dataclass
from pathlib import Path

from pagedllm.benchmarks.lower_bound import ModelShape

FMA_SOURCE = Path(__file__).resolve().parents[1] / "kernels" / "cpu" / "fma_peak.c"


@dataclass(frozen=True)
class CpuPeak:
    isa: str
    threads: int
    fma_flops: float  # FLOP/s of the FMA loop (wall clock)
    fma_flops_per_cpu_s: float  # its FLOPs per CPU second of the process
    matmul_flops: float  # FLOP/s of torch.mm (float32)

    def line(self) -> str:
        return (f"measured here ({self.threads} threads): fp32 FMA peak {self.fma_flops / 1e9:.1f} GFLOP/s "
                f"({self.fma_flops_per_cpu_s / 1e9:.1f} GFLOP per CPU-second; {self.isa} vectors), "
                f"torch.mm fp32 {self.matmul_flops / 1e9:.1f} GFLOP/s")


@functools.cache
def _fma_lib(isa: str):
    from pagedllm.kernels.cpu_kernels import build_library

    lib = ctypes.CDLL(str(build_library(FMA_SOURCE, isa)))
    lib.fma_peak_f32.restype = ctypes.c_double
    lib.fma_peak_f32.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_float)]
    return lib


def measure_fma_peak(isa: str | None = None, repeats: int = 5, seconds: float = 0.2) -> float:
    """Best FLOP/s (wall clock) of the FMA loop over `repeats` runs of about `seconds` each."""
    return measure_fma_peak_both(isa, repeats, seconds)[0]


def measure_fma_peak_both(isa: str | None = None, repeats: int = 5, seconds: float = 0.2) -> tuple[float, float]:
    """(best FLOP/s of wall clock, best FLOPs per CPU second) of the FMA loop."""
    from pagedllm.kernels import cpu_isa

    lib = _fma_lib(isa or cpu_isa.detect_cpu_isa().name)
    sink = ctypes.c_float()
    iters, best, best_cpu = 1 << 16, 0.0, 0.0
    for _ in range(30):  # calibrate to ~`seconds`
        t0 = time.perf_counter()
        lib.fma_peak_f32(iters, ctypes.byref(sink))
        if time.perf_counter() - t0 > seconds / 4:
            break
        iters *= 2
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        flops = lib.fma_peak_f32(iters * 4, ctypes.byref(sink))
        t1, c1 = time.perf_counter(), time.process_time()
        best, best_cpu = max(best, flops / (t1 - t0)), max(best_cpu, flops / max(c1 - c0, 1e-9))
    return best, best_cpu


def measure_matmul_peak_cpu(n: int = 1536, repeats: int = 5) -> float:
    """Best FLOP/s of an n×n×n float32 torch.mm."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def measure_cpu_peak() -> CpuPeak:
    import torch

    from pagedllm.kernels import cpu_isa

    isa = cpu_isa.detect_cpu_isa().name
    return CpuPeak(isa, torch.get_num_threads(), *measure_fma_peak_both(isa), measure_matmul_peak_cpu())


HOST_SPEED_TOLERANCE = 0.15  # readings further apart than this mark a same-run comparison as unreliable


def host_speed_report(readings: list[tuple[str, float]], tolerance: float = HOST_SPEED_TOLERANCE) -> dict:
    """Print the FMA peak read at several points of a run (`(when, FLOP/s)`); a shared host whose speed changed
    between them by more than `tolerance` gets a warning, since same-run ratios assume both systems saw the same
    machine. → JSON figures."""
    values = [v for _, v in readings]
    spread = max(values) / min(values) - 1.0
    listed = ", ".join(f"{when} {v / 1e9:.1f}" for when, v in readings)
    steady = spread <= tolerance
    if steady:
        print(f"host speed steady: FMA peak (GFLOP/s) {listed}; spread {spread:.0%}")
    else:
        print(f"WARNING: the host's speed changed during the run: FMA peak (GFLOP/s) {listed}; spread {spread:.0%} "
              f"> {tolerance:.0%}. Something else ran on these cores (another process or guest) or their clock "
              f"changed, so this run's figures and ratios are not reliable: run it again on a quiet machine.")
    return {"fma_peak_readings": [{"when": w, "flops": v} for w, v in readings], "fma_peak_spread": spread,
            "host_speed_steady": steady}


def step_flops(shape: ModelShape, num_tokens: int, attended: int, logits_rows: int) -> float:
    return (2.0 * shape.active_matmul_params * num_tokens + 4.0 * shape.num_layers * shape.num_heads * shape.head_dim * attended
            + 2.0 * shape.hidden * shape.vocab * logits_rows)


def flops_by_kind(shape: ModelShape, stats) -> dict[str, dict[str, float]]:
    """{step kind: {steps, flops, seconds, cpu_seconds, gflops, gflops_per_cpu_s}} over the CPU steps
    `stats` recorded, plus "all"."""
    acc: dict[str, list[float]] = {}
    for (kind, _path, n, a, b), work in zip(stats.records, stats.work):
        if work is None:
            continue
        f = step_flops(shape, n, work.attended, work.logits_rows)
        for key in (kind, "all"):
            row = acc.setdefault(key, [0, 0.0, 0.0, 0.0])
            row[0] += 1
            row[1] += f
            row[2] += a.elapsed_time(b) / 1e3
            row[3] += a.cpu_time(b)
    return {k: {"steps": c, "flops": f, "seconds": s, "cpu_seconds": cs, "gflops": f / s / 1e9 if s else 0.0,
                "gflops_per_cpu_s": f / cs / 1e9 if cs else 0.0}
            for k, (c, f, s, cs) in acc.items()}


def report(shape: ModelShape, stats, peak: CpuPeak, elapsed_s: float, elapsed_cpu_s: float) -> dict:
    """Print GFLOP/s by step kind and for the whole run, each as a fraction of the FMA peak (per wall
    second, and per CPU second); → JSON figures."""
    kinds = flops_by_kind(shape, stats)
    total = kinds.get("all", {"flops": 0.0})["flops"]
    pc = peak.fma_flops_per_cpu_s
    print(f"{'steps':<9}{'count':>6}{'TFLOP':>8}{'wall s':>8}{'GFLOP/s':>9}{'of peak':>9}"
          f"{'CPU s':>8}{'GFLOP/CPU-s':>12}{'of peak':>9}")
    for k in ("decode", "mixed", "prefill", "all"):
        if k in kinds:
            v = kinds[k]
            print(f"{k:<9}{v['steps']:>6}{v['flops'] / 1e12:>8.3f}{v['seconds']:>8.2f}{v['gflops']:>9.1f}"
                  f"{v['gflops'] * 1e9 / peak.fma_flops:>9.1%}{v['cpu_seconds']:>8.2f}{v['gflops_per_cpu_s']:>12.1f}"
                  f"{v['gflops_per_cpu_s'] * 1e9 / pc:>9.1%}")
    run, run_cpu = total / elapsed_s, total / elapsed_cpu_s
    print(f"whole run: {total / 1e12:.3f} TFLOP in {elapsed_s:.2f} s = {run / 1e9:.1f} GFLOP/s = "
          f"{run / peak.fma_flops:.1%} of the fp32 FMA peak ({peak.fma_flops / 1e9:.1f} GFLOP/s); per CPU second "
          f"({elapsed_cpu_s:.2f} CPU s): {run_cpu / 1e9:.1f} = {run_cpu / pc:.1%} of {pc / 1e9:.1f}")
    return {"cpu_peak": peak.__dict__, "steps_flops": kinds, "run_gflops": run / 1e9,
            "run_fraction_of_fma_peak": run / peak.fma_flops, "run_cpu_s": elapsed_cpu_s,
            "run_fraction_of_fma_peak_per_cpu_s": run_cpu / pc}
