"""Cost of the live KV-cache dashboard: throughput with /dashboard/events open vs closed (same server, same requests).

    python benchmarks/dashboard_overhead.py --rounds 3 --num-prompts 24
"""
import sys

from pagedllm.benchmarks import dashboard_overhead

if __name__ == "__main__":
    sys.exit(dashboard_overhead.main())
