"""`pagedllm bench <name>` — the benchmarks/ scripts' logic, in the package."""
from __future__ import annotations

import argparse
import importlib

#: (subcommand, module with `add_args(parser)` / `run(args)` and a docstring, one-line help).
BENCHMARKS: tuple[tuple[str, str, str], ...] = (
    ("throughput", "pagedllm.benchmarks.throughput", "Offline throughput on a fixed, seeded workload."),
    ("latency", "pagedllm.benchmarks.latency", "One batch end to end (vLLM's bench latency), HF in the same run."),
    ("serving", "pagedllm.benchmarks.serving", "Online serving latency/throughput against a running server."),
    ("cpu-kernels", "pagedllm.benchmarks.cpu_kernels", "The CPU path's kernels against their torch peers."),
    ("http-overhead", "pagedllm.benchmarks.http_overhead", "The same batch through LLM.generate and through HTTP."),
    ("spec-decode", "pagedllm.benchmarks.spec_decode", "Speculative decoding on vs off: input-copying and ShareGPT-like."),
    ("gguf-quant", "pagedllm.benchmarks.gguf_quant", "GGUF served quantized vs dequantized: agreement, perplexity, GEMMs."),
    ("paper", "pagedllm.benchmarks.paper.cli", "The paper's Figures 2 and 12-19, one command each."),
    ("fp8-accuracy", "pagedllm.benchmarks.fp8_accuracy", "FP8 KV / weights vs bf16 on the bundled model: agreement, ppl."),
    ("cpu-decode-step", "pagedllm.benchmarks.cpu_decode_step", "Single-sequence CPU decode step by phase, direct forward on/off."),
    ("embed", "pagedllm.benchmarks.embed", "Embedding throughput (pooling runner) vs transformers, same prompts."),
    ("lora", "pagedllm.benchmarks.lora", "Multi-LoRA throughput: no adapter, one, several mixed; transformers+peft peer."),
    ("kv-offload", "pagedllm.benchmarks.kv_offload", "KV offloading (a CPU tier under the prefix cache) vs the prefix cache alone."),
)


def add_bench_parser(sub) -> None:
    names = ", ".join(name for name, _, _ in BENCHMARKS)
    p = sub.add_parser("bench", help=f"Benchmarks ({names}).", description="Run pagedllm's benchmarks.")
    bench_sub = p.add_subparsers(dest="bench_cmd", required=True)
    for name, module_name, help_text in BENCHMARKS:
        module = importlib.import_module(module_name)
        bp = bench_sub.add_parser(name, help=help_text, description=module.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_args(bp)
        bp.set_defaults(func=module.run)
