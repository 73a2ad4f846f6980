"""Write a random-weight FP8 checkpoint of a Llama config (compressed-tensors FP8_DYNAMIC layout: e4m3 linear
weights with per-channel float32 scales [N, 1], embeddings and LM head in bf16), for loading FP8 checkpoints at
scale where no hub is reachable. Weights are drawn as `init_dummy_weights` draws them (N(0, 0.02), norms 1).

    python benchmarks/gpu/make_fp8_checkpoint.py /tmp/l8b /tmp/l8b-fp8
"""
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from pagedllm.kernels import fp8_linear

LINEARS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"], "kv_cache_scheme": None,
    "config_groups": {"group_0": {"targets": ["Linear"],
                                  "input_activations": {"num_bits": 8, "type": "float", "dynamic": True,
                                                        "strategy": "token", "symmetric": True},
                                  "weights": {"num_bits": 8, "type": "float", "dynamic": False,
                                              "strategy": "channel", "symmetric": True}}}}


def main() -> None:
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    t0 = time.perf_counter()
    cfg = AutoConfig.from_pretrained(src)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or h // heads
    shapes = {"q_proj": (heads * hd, h), "k_proj": (kv * hd, h), "v_proj": (kv * hd, h), "o_proj": (h, heads * hd),
              "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    dst.mkdir(parents=True, exist_ok=True)
    weight_map, nbytes = {}, 0

    def randn(*shape):
        return torch.empty(shape, device=dev).normal_(0, 0.02, generator=gen).to(torch.bfloat16)

    def flush(tensors: dict, name: str) -> None:
        nonlocal nbytes
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(dst / name))
        weight_map.update({k: name for k in tensors})
        nbytes += sum(v.numel() * v.element_size() for v in tensors.values())

    flush({"model.embed_tokens.weight": randn(cfg.vocab_size, h), "model.norm.weight":
           torch.ones(h, dtype=torch.bfloat16, device=dev), "lm_head.weight": randn(cfg.vocab_size, h)},
          "model-embed.safetensors")
    for i in range(cfg.num_hidden_layers):
        layer = {f"model.layers.{i}.{n}.weight": torch.ones(h, dtype=torch.bfloat16, device=dev)
                 for n in ("input_layernorm", "post_attention_layernorm")}
        for proj, parent in LINEARS.items():
            q, s = fp8_linear.quantize_weight(randn(*shapes[proj]))
            base = f"model.layers.{i}.{parent}.{proj}"
            layer[f"{base}.weight"], layer[f"{base}.weight_scale"] = q, s.reshape(-1, 1)
        flush(layer, f"model-layer{i:03d}.safetensors")
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": nbytes},
                                                                  "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    config["torch_dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    for extra in ("generation_config.json",):
        if (src / extra).exists():
            shutil.copy(src / extra, dst / extra)
    print(f"wrote {dst}: {nbytes / 1e9:.2f} GB in {len(set(weight_map.values()))} files, "
          f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
