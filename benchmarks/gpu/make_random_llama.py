"""Save a random-weight Llama-shaped checkpoint (safetensors, no tokenizer) for GPU benchmarks that need the same
weights in pagedllm and in transformers: python make_random_llama.py DIR [hidden layers heads kv_heads inter vocab]."""
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

path = sys.argv[1]
hidden, layers, heads, kv, inter, vocab = (int(x) for x in (sys.argv[2:] or [2048, 16, 32, 8, 8192, 32000]))
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                  torch_dtype="bfloat16")
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
for p in model.parameters():
    p.data.normal_(0, 0.02)
model.save_pretrained(path)
print("saved", path, sum(p.numel() for p in model.parameters()) / 1e9, "B params")
