"""Save a DeepSeek-V2-Lite-shaped config.json (no weights, no tokenizer) for --load-format dummy runs on the device:

    python3 benchmarks/gpu/make_deepseek_config.py DIR [v2-lite|tiny]

v2-lite: DeepSeek-V2-Lite's shape (27 layers, hidden 2048, 16 heads, kv_lora_rank 512, no q compression, 64 routed
experts of width 1408 top-6 + 2 shared, first layer dense; 15.7 B parameters, 2.4 B active per token), default RoPE
(its YaRN factors change no FLOP or byte). tiny: the same structure at hidden 64, for a CPU check of the command."""
import sys

from transformers import DeepseekV2Config

SHAPES = {
    "v2-lite": dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
                    n_routed_experts=64, num_experts_per_tok=6, kv_lora_rank=512, q_lora_rank=None,
                    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128),
    "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8,
                 num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16,
                 qk_nope_head_dim=16),
}
path = sys.argv[1]
shape = sys.argv[2] if len(sys.argv) > 2 else "v2-lite"
cfg = DeepseekV2Config(**SHAPES[shape], first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1,
                       routed_scaling_factor=1.0, norm_topk_prob=False, max_position_embeddings=4096,
                       torch_dtype="bfloat16")
cfg.architectures = ["DeepseekV2ForCausalLM"]
cfg.save_pretrained(path)
print("saved config", path)
