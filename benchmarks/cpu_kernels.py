"""CPU kernels against their torch peers (same as `pagedllm bench cpu-kernels`).

    python benchmarks/cpu_kernels.py
"""
import argparse
import sys

from pagedllm.benchmarks import cpu_kernels

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=cpu_kernels.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cpu_kernels.add_args(parser)
    sys.exit(cpu_kernels.run(parser.parse_args()))
