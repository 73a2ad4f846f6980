"""FP8 accuracy on the bundled model against bf16 (same as `pagedllm bench fp8-accuracy`).

    python benchmarks/fp8_accuracy.py --configs bf16 fp8-kv fp8-kv-w8
"""
import argparse
import logging
import sys

from pagedllm.benchmarks import fp8_accuracy

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    parser = argparse.ArgumentParser(description=fp8_accuracy.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    fp8_accuracy.add_args(parser)
    sys.exit(fp8_accuracy.run(parser.parse_args()))
