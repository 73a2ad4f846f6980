"""CPU PagedAttention A/B: kernels/cpu/cpu_ops.c at a git revision against the working tree, same inputs, same run.

Shapes of the bundled model (9 query / 3 KV heads of 64, block 16): a decode batch, speculative verification
(4 sequences × 5 query tokens) and prompt chunks (64 tokens and more: the kernel's tile path). Each case runs 30
layers with a KV cache per layer (decode and verification: the caches do not fit the CPU's caches, as in a real
step) and prints milliseconds per 30 layers (best of several rounds) and whether both builds gave bit-identical
outputs.

    python benchmarks/cpu_attention_ab.py --base-rev cf66d30
"""
import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pagedllm.kernels import cpu_isa
from pagedllm.kernels.cpu_kernels import SOURCE, CpuKernels, build_library

BLOCK, HQ, HK, D = 16, 9, 3, 64
CASES = [  # (sequences, context per sequence after the step, query tokens per sequence, layer caches)
    (64, 300, 1, 30), (4, 500, 1, 30), (4, 500, 5, 30), (16, 160, 64, 8), (1, 459, 459, 4), (4, 300, 300, 4),
    (2, 1000, 1000, 2)]


def load(source: Path) -> CpuKernels:
    isa = cpu_isa.detect_cpu_isa().name
    return CpuKernels(ctypes.CDLL(str(build_library(source, isa))), source, isa)


def case_inputs(seqs: int, ctx: int, qlen: int, layers: int):
    g = torch.Generator().manual_seed(seqs * 7 + ctx + qlen)
    per = -(-ctx // BLOCK)
    caches = [(torch.randn(seqs * per, BLOCK, HK, D, generator=g), torch.randn(seqs * per, BLOCK, HK, D, generator=g))
              for _ in range(layers)]
    tables = torch.randperm(seqs * per, generator=g).to(torch.int32).view(seqs, per).contiguous()
    qsl = torch.arange(0, seqs * qlen + 1, qlen, dtype=torch.int32)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    return caches, tables, qsl, lens, torch.randn(seqs * qlen, HQ, D, generator=g)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-rev", required=True, help="git revision whose cpu_ops.c is the baseline")
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    text = subprocess.run(["git", "show", f"{args.base_rev}:pagedllm/kernels/cpu/cpu_ops.c"], check=True,
                          capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        base_src = Path(tmp) / "cpu_ops.c"
        base_src.write_text(text)
        builds = {args.base_rev: load(base_src), "working tree": load(SOURCE)}
    print(f"{'sequences × context × query tokens':36s}" + "".join(f"{name:>16s}" for name in builds) + "   ratio  same bits")
    for seqs, ctx, qlen, layers in CASES:
        caches, tables, qsl, lens, q = case_inputs(seqs, ctx, qlen, layers)
        times, outs = [], []
        for kernels in builds.values():
            out, best = torch.empty_like(q), float("inf")
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                for kc, vc in caches:
                    kernels.paged_attention(out, q, kc, vc, tables, lens, qsl, D**-0.5, indices_checked=True)
                best = min(best, time.perf_counter() - t0)
            times.append(1e3 * best * 30 / layers)
            outs.append(out.clone())
        label = f"{seqs} × {ctx} × {qlen}"
        print(f"{label:36s}" + "".join(f"{t:13.2f} ms" for t in times) + f"  {times[0] / times[1]:5.2f}x  "
              f"{torch.equal(*outs)}")


if __name__ == "__main__":
    main()
