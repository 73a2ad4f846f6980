"""Offline throughput benchmark (same as `pagedllm bench throughput`).

    python benchmarks/throughput.py --compare hf
"""
import argparse
import logging
import sys

from pagedllm.benchmarks import throughput

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    parser = argparse.ArgumentParser(description=throughput.__doc__)
    throughput.add_args(parser)
    sys.exit(throughput.run(parser.parse_args()))
