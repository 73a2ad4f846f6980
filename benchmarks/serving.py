"""Online serving benchmark against a running `pagedllm serve` (same as `pagedllm bench serving`).

    python benchmarks/serving.py --num-prompts 50 --request-rate 2
"""
import argparse
import sys

from pagedllm.benchmarks import serving

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=serving.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serving.add_args(parser)
    sys.exit(serving.run(parser.parse_args()))
