"""Write a random-weight gpt-oss GGUF file in llama.cpp's layout (MXFP4 experts, Q8_0 attention, embedding and
output, F32 norms, biases and sinks; the bundled model's tokenizer), for the CPU benchmark against llama.cpp on the
same file (nothing can be downloaded here, so not gpt-oss-20b itself; its shape scaled down: head_dim 64, 8 query
heads per KV head, 32 experts, 4 per token, a 128-token window on every other layer, YaRN).

    python benchmarks/gpt_oss_gguf.py /tmp/gpt-oss-small.gguf --hidden 1024 --layers 8
    python benchmarks/throughput.py --model /tmp/gpt-oss-small.gguf --compare llama.cpp --num-prompts 32
"""
from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

from pagedllm.benchmarks.gguf_quant import copy_gguf_tokenizer
from pagedllm.model.loader import default_model_path


def write(path: Path, hidden: int, layers: int, experts: int, used: int, width: int, kv_heads: int,
          seed: int, output_scale: float = 1.0) -> Path:
    """The file; ``output_scale`` multiplies the output layer's weights (wider logit margins: random weights leave the
    top two tokens within hundredths of a nat, so any rounding flips greedy choices)."""
    rng = np.random.default_rng(seed)
    heads, head_dim = hidden // 64, 64

    def randn(*shape: int, scale: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)

    def add(name: str, arr: np.ndarray, qtype: gguf.GGMLQuantizationType | None = None) -> None:
        if qtype is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)

    w = gguf.GGUFWriter(str(path), "gpt-oss")
    vocab = copy_gguf_tokenizer(w, default_model_path())
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(width)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(150000.0)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_expert_count(experts)
    w.add_expert_used_count(used)
    w.add_expert_feed_forward_length(width)
    w.add_sliding_window(128)
    q8, mx = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.MXFP4
    s = hidden ** -0.5
    add("token_embd.weight", randn(vocab, hidden, scale=1.0), q8)
    add("output_norm.weight", np.ones(hidden, np.float32))
    add("output.weight", randn(vocab, hidden, scale=s * output_scale), q8)
    for i in range(layers):
        b = f"blk.{i}"
        add(f"{b}.attn_norm.weight", np.ones(hidden, np.float32))
        add(f"{b}.post_attention_norm.weight", np.ones(hidden, np.float32))
        for name, rows, cols in (("attn_q", heads * head_dim, hidden), ("attn_k", kv_heads * head_dim, hidden),
                                 ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, heads * head_dim)):
            add(f"{b}.{name}.weight", randn(rows, cols, scale=cols ** -0.5), q8)
            add(f"{b}.{name}.bias", randn(rows, scale=0.02))
        add(f"{b}.attn_sinks.weight", randn(heads, scale=1.0))
        add(f"{b}.ffn_gate_inp.weight", randn(experts, hidden, scale=s))
        add(f"{b}.ffn_gate_inp.bias", randn(experts, scale=0.1))
        for name, rows, cols in (("ffn_gate_exps", width, hidden), ("ffn_up_exps", width, hidden),
                                 ("ffn_down_exps", hidden, width)):
            add(f"{b}.{name}.weight", randn(experts, rows, cols, scale=cols ** -0.5), mx)
            add(f"{b}.{name}.bias", randn(experts, rows, scale=0.02))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", type=Path)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--experts-per-token", type=int, default=4)
    p.add_argument("--expert-width", type=int, default=1024)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-scale", type=float, default=1.0)
    a = p.parse_args()
    out = write(a.path, a.hidden, a.layers, a.experts, a.experts_per_token, a.expert_width, a.kv_heads, a.seed,
                a.output_scale)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
