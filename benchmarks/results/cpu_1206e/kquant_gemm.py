"""GGUF Q5_0 / Q5_1 / Q5_K / Q6_K linears served quantized (kernels/cpu/quant_ops.c, int8 design) vs the float32 GEMM
of the same weights dequantized (torch.nn.functional.linear), at the bundled model's linear shapes and 1 / 4 / 16 /
64 activation rows; Q8_0 and Q4_K as the existing types' reference. Interleaved (quantized, float, quantized, ...),
median of REPEATS samples, each sample enough calls to take >= 20 ms; "(min)" is the speedup between the fastest
single calls of all samples. The 2 cores are shared with other work: each row count starts once the cores have
been idle for 0.3 s (up to 90 s of waiting), and a line ends "(other load N%)" when other processes took over 10 %
of the cores while it was measured.
Also bytes in memory vs the file's bytes vs float32. The K-quants need rows of a multiple of 256 inputs: where the shape's K is 576 they are timed at K = 768
(marked *; llama.cpp itself stores such tensors as Q5_0 / Q5_1 / Q8_0, its fallbacks for rows not of 256).

    PYTHONPATH=. python benchmarks/results/cpu_1206e/kquant_gemm.py > benchmarks/results/cpu_1206e/kquant_gemm.txt
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from pagedllm.benchmarks.gguf_quant import random_gguf_blocks
from pagedllm.kernels import cpu_quant
from pagedllm.kernels.cpu_quant import BLOCK_LAYOUT, GGML_TYPES, GGUFWeight

SHAPES = [("q/o 576->576", 576, 576), ("gate/up 576->1536", 576, 1536), ("down 1536->576", 1536, 576),
          ("lm_head 576->49152", 576, 49152)]
TYPES = ["Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q4_K"]
ROWS = [1, 4, 16, 64]
REPEATS = 9


def _snap() -> tuple[float, float]:
    """(CPU seconds spent by every process, by this one) so far (/proc/stat's busy jiffies, os.times)."""
    with open("/proc/stat") as f:
        v = [int(t) for t in f.readline().split()[1:]]
    mine = os.times()
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK"), mine.user + mine.system


def _busy(seconds: float = 0.3) -> float:
    """Fraction of the machine's CPU time spent (by anyone) over ``seconds``."""
    a, _ = _snap()
    time.sleep(seconds)
    b, _ = _snap()
    return (b - a) / (seconds * os.cpu_count())


def _wait_quiet(limit_s: float = 90.0) -> bool:
    """Wait (up to ``limit_s``) until other processes leave the cores idle: the 2 cores are shared with other work,
    and a GEMM whose thread is descheduled takes a whole time slice. False if it never got quiet."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if _busy() < 0.1:
            return True
    return False


def _sample(fn, min_s: float = 0.02) -> tuple[float, float]:
    """Seconds per call of ``fn`` over enough calls to last ``min_s``, and the fastest single call among them."""
    n, best, t0 = 0, float("inf"), time.perf_counter()
    while True:
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        n, best = n + 1, min(best, t2 - t1)
        if t2 - t0 >= min_s:
            return (t2 - t0) / n, best


def main() -> None:
    torch.set_num_threads(2)
    kern = cpu_quant.load_quant_kernels()
    print(f"# quant_ops ISA {kern.isa}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"median of {REPEATS} interleaved samples; load average at start {os.getloadavg()[0]:.2f}")
    print(f"{'type':5} {'shape':20} {'rows':>4} {'quant ms':>9} {'f32 ms':>8} {'speedup':>7} {'(min)':>6}   "
          f"{'mem MB':>7} {'file MB':>7} {'f32 MB':>7} {'mem/file':>8}")
    for type_name in TYPES:
        qtype = GGML_TYPES[type_name]
        for label, k, n in SHAPES:
            star = ""
            if k % BLOCK_LAYOUT[qtype][0]:
                k, star = 768, "*"
            raw = torch.from_numpy(random_gguf_blocks(qtype, n, k, seed=qtype))
            w = GGUFWeight.from_gguf_blocks(raw, qtype, n, k, gemm_method="int8")
            dense = kern.dequantize_rows(w, torch.arange(n))
            for m in ROWS:
                quiet = _wait_quiet()
                t0, (all0, mine0) = time.monotonic(), _snap()
                x = torch.randn(m, k)
                quant = lambda x=x, w=w: kern.linear(x, w, "int8")  # noqa: E731
                f32 = lambda x=x, dense=dense: torch.nn.functional.linear(x, dense)  # noqa: E731
                quant(), f32()
                tq, tf = [], []
                for _ in range(REPEATS):
                    tq.append(_sample(quant))
                    tf.append(_sample(f32))
                mq, mf = statistics.median(t for t, _ in tq) * 1e3, statistics.median(t for t, _ in tf) * 1e3
                sp_min = min(b for _, b in tf) / min(b for _, b in tq)
                all1, mine1 = _snap()
                others = ((all1 - all0) - (mine1 - mine0)) / ((time.monotonic() - t0) * os.cpu_count())
                mark = "" if quiet and others < 0.1 else f" (other load {others:.0%})"
                print(f"{type_name:5} {label + star:20} {m:4d} {mq:9.3f} {mf:8.3f} {mf / mq:6.2f}x {sp_min:5.2f}x   "
                      f"{w.nbytes / 1e6:7.2f} {raw.numel() / 1e6:7.2f} {n * k * 4 / 1e6:7.2f} "
                      f"{w.nbytes / raw.numel():7.2f}x{mark}", flush=True)


if __name__ == "__main__":
    main()
