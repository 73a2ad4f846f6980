"""Decode attention benchmark: paged Triton kernel vs SDPA on contiguous K/V (needs CUDA).

    python benchmarks/decode_attention.py --variants --json kernels.json
"""
# Not named kernels.py: this directory is first on sys.path when one of its scripts runs, and transformers
# imports the Hub's `kernels` package whenever a module of that name can be found.
import sys

from pagedllm.benchmarks import kernels

if __name__ == "__main__":
    sys.exit(kernels.main())
