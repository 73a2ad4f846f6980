"""A random GPT-OSS of ~110 M parameters for the CPU comparison (BENCHMARKS §84): 8 layers of hidden 512, 8 query /
2 KV heads of 64, 16 experts top-4 of width 512, vocab 8 000, 128-token windows on every other layer, sinks."""
import sys

import torch
import transformers

torch.manual_seed(0)
cfg = transformers.GptOssConfig(num_hidden_layers=8, layer_types=["sliding_attention", "full_attention"] * 4,
                                vocab_size=8000, hidden_size=512, intermediate_size=512, num_attention_heads=8,
                                num_key_value_heads=2, head_dim=64, num_local_experts=16, num_experts_per_tok=4,
                                sliding_window=128, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
                                eos_token_id=2, rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 1024,
                                "rope_theta": 150000.0})
m = transformers.GptOssForCausalLM(cfg)
with torch.no_grad():
    for n, p in m.named_parameters():
        p.normal_(0, 1.0 if "sinks" in n else 0.02)
print(f"{sum(p.numel() for p in m.parameters()) / 1e6:.1f} M params")
m.save_pretrained(sys.argv[1])
