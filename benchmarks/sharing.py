"""Memory sharing (paper Fig. 15) and prefix caching throughput (paper Fig. 16).

    python benchmarks/sharing.py --plot benchmarks/figures/sharing_fig15.png
"""
import argparse
import logging
import sys

from pagedllm.benchmarks import sharing

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(description=sharing.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sharing.add_args(parser)
    sys.exit(sharing.run(parser.parse_args()))
