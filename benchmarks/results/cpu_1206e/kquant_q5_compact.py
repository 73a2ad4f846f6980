"""NOT ADOPTED (BENCHMARKS §80.4): this script measures q5_compact_layout.patch (next to it), which is not in the tree;
apply it (git apply) to rerun. Q5_0 / Q5_1 / Q5_K held compactly (Q4's nibbles + a plane of fifth bits, bytes rebuilt in registers) vs the
previous layout (one byte per quant, commit 44e8305 .. HEAD^ of this change), in one process: the committed
quant_ops.c (``git show HEAD:...``, passed as argv[1]) is built into its own .so with the flags cpu_quant.py uses,
and both libraries run the int8 GEMM on the same GGUF blocks at the bundled model's linear shapes (kquant_gemm.py's;
the K-quants at K = 768 where K is 576, marked *) and 1 / 4 / 16 / 64 activation rows. Interleaved (new, old, new,
...), median of REPEATS samples of >= 20 ms each, and the fastest single calls ("min"; lines marked "other load" ran while other processes
took over 10 % of the cores: the A/B ratio, from interleaved samples, is the number to read there). Also checks that both give bit-identical outputs. Bytes in
memory ÷ the file's bytes for each layout. One thread (OMP_NUM_THREADS=1) when the 2 cores are shared: a 2-thread
GEMM whose second thread is descheduled waits a time slice at its barrier, which buries the difference.

    git show HEAD:pagedllm/kernels/cpu/quant_ops.c > /tmp/q5prev/quant_ops.c
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/results/cpu_1206e/kquant_q5_compact.py /tmp/q5prev/quant_ops.c \\
        > benchmarks/results/cpu_1206e/kquant_q5_compact.txt
"""
from __future__ import annotations

import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from pagedllm.benchmarks.gguf_quant import random_gguf_blocks
from pagedllm.kernels import cpu_isa, cpu_quant
from pagedllm.kernels.cpu_kernels import build_library
from pagedllm.kernels.cpu_quant import BLOCK_LAYOUT, GGML_TYPES, QuantKernels

sys.path.insert(0, str(Path(__file__).parent))
from kquant_gemm import ROWS, SHAPES, _sample, _snap, _wait_quiet  # noqa: E402

TYPES = ["Q5_0", "Q5_1", "Q5_K"]
REPEATS = 7
QUIET_WAIT_S = 5.0  # the cores are shared with other sessions' test suites: wait at most this long for quiet


def main() -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    new = cpu_quant.load_quant_kernels()
    isa = cpu_isa.detect_cpu_isa()
    old = QuantKernels(ctypes.CDLL(str(build_library(Path(sys.argv[1]), isa.name, cpu_quant.vnni_flags(isa)))),
                       Path(sys.argv[1]))
    print(f"# quant_ops ISA {new.isa} (old build {old.isa}); torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; median of {REPEATS} interleaved samples; load average at start {os.getloadavg()[0]:.2f}")
    print(f"{'type':5} {'shape':20} {'rows':>4} {'new ms':>8} {'old ms':>8} {'old/new':>7} {'min new':>8} {'min old':>8} "
          f"{'old/new':>7}   "
          f"{'new/file':>8} {'old/file':>8}  same bits")
    for type_name in TYPES:
        qtype = GGML_TYPES[type_name]
        for label, k, n in SHAPES:
            star = ""
            if k % BLOCK_LAYOUT[qtype][0]:
                k, star = 768, "*"
            raw = torch.from_numpy(random_gguf_blocks(qtype, n, k, seed=qtype)).contiguous()
            wn = new.repack(raw, qtype, n, k)
            wo = torch.empty(old.r16_bytes(qtype, n, k), dtype=torch.uint8)
            assert old._repack(qtype, raw.data_ptr(), n, k, wo.data_ptr()) == 0
            for m in ROWS:
                quiet = _wait_quiet(QUIET_WAIT_S)
                t0, (all0, mine0) = time.monotonic(), _snap()
                x = torch.randn(m, k)
                yn, yo = torch.empty(m, n), torch.empty(m, n)

                def run_new(x=x, yn=yn, wn=wn, m=m, n=n, k=k):
                    assert new._linear(qtype, wn.data_ptr(), n, k, x.data_ptr(), m, yn.data_ptr(), 0) == 0

                def run_old(x=x, yo=yo, wo=wo, m=m, n=n, k=k):
                    assert old._linear(qtype, wo.data_ptr(), n, k, x.data_ptr(), m, yo.data_ptr(), 0) == 0

                run_new(), run_old()
                same = torch.equal(yn.view(torch.int32), yo.view(torch.int32))
                tn, to = [], []
                for _ in range(REPEATS):
                    tn.append(_sample(run_new))
                    to.append(_sample(run_old))
                mn, mo = statistics.median(t for t, _ in tn) * 1e3, statistics.median(t for t, _ in to) * 1e3
                bn, bo = min(b for _, b in tn) * 1e3, min(b for _, b in to) * 1e3
                all1, mine1 = _snap()
                others = ((all1 - all0) - (mine1 - mine0)) / ((time.monotonic() - t0) * os.cpu_count())
                mark = "" if quiet and others < 0.1 else f" (other load {others:.0%})"
                print(f"{type_name:5} {label + star:20} {m:4d} {mn:8.3f} {mo:8.3f} {mo / mn:6.2f}x {bn:8.3f} {bo:8.3f} {bo / bn:6.2f}x   "
                      f"{wn.numel() / raw.numel():7.3f}x {wo.numel() / raw.numel():7.3f}x  {same}{mark}", flush=True)


if __name__ == "__main__":
    main()
