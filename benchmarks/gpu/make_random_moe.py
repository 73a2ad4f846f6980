"""Save a random-weight Qwen3-MoE checkpoint (safetensors, no tokenizer) for GPU benchmarks that need the same
weights in pagedllm and in transformers, or only its config.json (--config-only, for --load-format dummy runs):

    python make_random_moe.py DIR [small|qwen3-30b-a3b] [--config-only]

small: hidden 1024, 16 layers, 64 experts of width 512, top-8 (1.3 B parameters, 0.25 B active per token).
qwen3-30b-a3b: Qwen3-30B-A3B's shape (48 layers, hidden 2048, 128 experts of width 768, top-8)."""
import sys

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

SHAPES = {
    "small": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                  num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512, intermediate_size=2816,
                  vocab_size=32000),
    "qwen3-30b-a3b": dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          intermediate_size=6144, vocab_size=151936),
}
path = sys.argv[1]
shape = next((a for a in sys.argv[2:] if a in SHAPES), "small")
cfg = Qwen3MoeConfig(**SHAPES[shape], max_position_embeddings=4096, norm_topk_prob=True, torch_dtype="bfloat16")
if "--config-only" in sys.argv:
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    cfg.save_pretrained(path)
    print("saved config", path)
    sys.exit(0)
torch.manual_seed(0)
with torch.device("cuda"):
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
for p in model.parameters():
    p.data.normal_(0, 0.02)
model.save_pretrained(path)
print("saved", path, sum(p.numel() for p in model.parameters()) / 1e9, "B params")
