"""A SmolLM2-135M-shaped HF config with the bundled tokenizer (carried in .tok/), for --load-format dummy runs on
the device: python3 benchmarks/gpu/make_s135.py [/tmp/s135]."""
import shutil
import sys

from transformers import LlamaConfig

out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/s135"
LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
            torch_dtype="bfloat16").save_pretrained(out)
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(f".tok/{f}", out)
