"""`pagedllm bench throughput|serving|cpu-kernels` — the benchmarks/ scripts' logic, in the package."""
from __future__ import annotations

import argparse


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="Benchmarks (throughput, serving, cpu-kernels).", description="Run pagedllm's benchmarks.")
    bench_sub = p.add_subparsers(dest="bench_cmd", required=True)
    from pagedllm.benchmarks import throughput

    t = bench_sub.add_parser("throughput", help="Offline throughput on a fixed, seeded workload.",
                             description=throughput.__doc__)
    throughput.add_args(t)
    t.set_defaults(func=lambda args: throughput.run(args))
    from pagedllm.benchmarks import serving

    sv = bench_sub.add_parser("serving", help="Online serving latency/throughput against a running server.",
                              description=serving.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serving.add_args(sv)
    sv.set_defaults(func=lambda args: serving.run(args))
    from pagedllm.benchmarks import cpu_kernels

    ck = bench_sub.add_parser("cpu-kernels", help="The CPU path's kernels against their torch peers.",
                              description=cpu_kernels.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cpu_kernels.add_args(ck)
    ck.set_defaults(func=lambda args: cpu_kernels.run(args))
    from pagedllm.benchmarks import http_overhead

    ho = bench_sub.add_parser("http-overhead", help="The same batch through LLM.generate and through HTTP.",
                              description=http_overhead.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    http_overhead.add_args(ho)
    ho.set_defaults(func=lambda args: http_overhead.run(args))
    from pagedllm.benchmarks import spec_decode

    sd = bench_sub.add_parser("spec-decode", help="Speculative decoding on vs off: input-copying and ShareGPT-like.",
                              description=spec_decode.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    spec_decode.add_args(sd)
    sd.set_defaults(func=lambda args: spec_decode.run(args))
    from pagedllm.benchmarks.paper import cli as paper_cli

    pp = bench_sub.add_parser("paper", help="The paper's Figures 2, 12 and 13, one command each.",
                              description=paper_cli.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    paper_cli.add_args(pp)
    pp.set_defaults(func=lambda args: paper_cli.run(args))
