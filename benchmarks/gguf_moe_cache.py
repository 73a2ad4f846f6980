"""A quantized MoE GGUF's converted cache and load times: what the cache holds on disk and how long a load takes.

Writes a random ``qwen3moe`` file (default: 4 layers, hidden 1024, 64 Q4_K experts of width 768, top 8; attention and
embedding Q8_0, norms and routers F32), converts it into a fresh cache directory, then times engine start-ups
(``LLM(...)`` construction: weight load and the engine's set-up) with quantization='gguf' (experts served from their
blocks) and 'none' (dequantized float32). Prints the GGUF's bytes, the cache's bytes on disk, the first start-up
(conversion included) and the median of warm start-ups. Run it under two checkouts to compare them:

    PYTHONPATH=. python benchmarks/gguf_moe_cache.py --layers 4
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def write_random_qwen3moe(path: Path, layers: int, hidden: int, experts: int, width: int, top_k: int,
                          expert_type: str, vocab: int = 4096, heads: int = 16, kv_heads: int = 4) -> None:
    """A qwen3moe GGUF of random blocks in llama.cpp's layout (merged ffn_*_exps per layer)."""
    import gguf

    from pagedllm.benchmarks.gguf_quant import random_gguf_blocks
    from pagedllm.kernels.cpu_quant import GGML_TYPES

    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(4 * hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1e6)
    w.add_expert_count(experts)
    w.add_expert_used_count(top_k)
    w.add_expert_feed_forward_length(width)
    w.add_token_list([f"t{i}" for i in range(vocab)])
    rng = np.random.default_rng(0)
    seed = iter(range(1 << 30))

    def add(name: str, *shape: int, type_name: str | None = None) -> None:
        if type_name is None:  # norms and routers
            w.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            return
        data = random_gguf_blocks(GGML_TYPES[type_name], int(np.prod(shape[:-1])), shape[-1], next(seed))
        w.add_tensor(name, data.reshape(*shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType[type_name])

    add("token_embd.weight", vocab, hidden, type_name="Q8_0")
    add("output_norm.weight", hidden)
    add("output.weight", vocab, hidden, type_name="Q8_0")
    for i in range(layers):
        for name, rows in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim),
                           ("attn_v", kv_heads * head_dim)):
            add(f"blk.{i}.{name}.weight", rows, hidden, type_name="Q8_0")
        add(f"blk.{i}.attn_output.weight", hidden, heads * head_dim, type_name="Q8_0")
        for name, size in (("attn_q_norm", head_dim), ("attn_k_norm", head_dim), ("attn_norm", hidden),
                           ("ffn_norm", hidden)):
            add(f"blk.{i}.{name}.weight", size)
        add(f"blk.{i}.ffn_gate_inp.weight", experts, hidden)
        add(f"blk.{i}.ffn_gate_exps.weight", experts, width, hidden, type_name=expert_type)
        add(f"blk.{i}.ffn_up_exps.weight", experts, width, hidden, type_name=expert_type)
        add(f"blk.{i}.ffn_down_exps.weight", experts, hidden, width, type_name=expert_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _start(path: Path, quantization: str) -> float:
    """Seconds to construct the engine (the weights' load included)."""
    from pagedllm import LLM

    t0 = time.perf_counter()
    llm = LLM(model=str(path), quantization=quantization, skip_tokenizer_init=True, device="cpu",
              num_gpu_blocks_override=16, max_model_len=64, swap_space=0.01)
    seconds = time.perf_counter() - t0
    del llm
    return seconds


def _build_kernels() -> None:
    """Build (or find) the CPU kernels in the cache directory first, so that no start-up times their compilation."""
    from pagedllm.kernels.cpu_f32_gemm import load_f32_gemm
    from pagedllm.kernels.cpu_kernels import load_cpu_kernels
    from pagedllm.kernels.cpu_quant import load_quant_kernels

    load_cpu_kernels()
    load_quant_kernels()
    load_f32_gemm()


def _dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--type", default="Q4_K", help="the experts' GGUF type")
    p.add_argument("--repeats", type=int, default=3, help="warm start-ups per quantization")
    p.add_argument("--workdir", default=None, help="where the GGUF and the cache go (default: a temp dir)")
    args = p.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gguf-moe-cache-"))
    os.environ["PAGEDLLM_CACHE_DIR"] = str(work / "cache")
    src = work / "moe.gguf"
    if not src.is_file():
        write_random_qwen3moe(src, args.layers, args.hidden, args.experts, args.width, args.top_k, args.type)
    _build_kernels()
    first = _start(src, "gguf")
    cache = work / "cache" / "gguf"
    print(f"{args.layers} layers x {args.experts} {args.type} experts ({args.width} x {args.hidden}): GGUF "
          f"{src.stat().st_size / 1e6:.0f} MB, converted cache {_dir_bytes(cache) / 1e6:.0f} MB on disk")
    print(f"first start-up (conversion included), quantization=gguf: {first:.2f} s")
    for quantization in ("gguf", "none"):
        times = [_start(src, quantization) for _ in range(args.repeats)]
        print(f"warm start-up, quantization={quantization}: median {statistics.median(times):.2f} s "
              f"({', '.join(f'{t:.2f}' for t in times)})")


if __name__ == "__main__":
    main()
