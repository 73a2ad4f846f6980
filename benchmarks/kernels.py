"""Decode attention benchmark: paged Triton kernel vs SDPA on contiguous K/V (needs CUDA).

    python benchmarks/kernels.py --variants --json kernels.json
"""
import sys

from pagedllm.benchmarks import kernels

if __name__ == "__main__":
    sys.exit(kernels.main())
