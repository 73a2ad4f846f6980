"""Decode roofline of a Llama-3-8B-shaped dummy model (needs CUDA).

    python benchmarks/roofline.py --batch 1 64 256 --context 1024
"""
import logging
import sys

from pagedllm.benchmarks import roofline

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(roofline.main())
