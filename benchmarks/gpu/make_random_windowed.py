"""Save a random-weight checkpoint of a model with sliding-window attention (safetensors, no tokenizer), or only its
config.json (--config-only, for --load-format dummy runs), for GPU benchmarks:

    python make_random_windowed.py DIR SHAPE [--config-only] [--window N|none]

gemma2-2b: Gemma-2-2B's shape (26 layers, hidden 2304, head_dim 256, window 4096 on every other layer, soft caps).
gemma3-1b: Gemma-3-1B's shape (26 layers, hidden 1152, one KV head, window 512 on 5 of 6 layers).
gemma3-270m: Gemma-3-270M's shape (18 layers, hidden 640, one KV head, window 512 on 5 of 6 layers; a CPU model).
mistral-7b: Mistral-7B-v0.1's shape (32 layers, hidden 4096, GQA 32/8, window 4096 on every layer).
--window overrides the shape's window (none: full attention everywhere, the same model otherwise)."""
import sys

import torch
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, MistralConfig

SHAPES = {
    "gemma2-2b": (Gemma2Config, dict(hidden_size=2304, num_hidden_layers=26, num_attention_heads=8,
                                     num_key_value_heads=4, head_dim=256, intermediate_size=9216, vocab_size=256000,
                                     sliding_window=4096, max_position_embeddings=8192)),
    "gemma3-1b": (Gemma3TextConfig, dict(hidden_size=1152, num_hidden_layers=26, num_attention_heads=4,
                                         num_key_value_heads=1, head_dim=256, intermediate_size=6912,
                                         vocab_size=262144, sliding_window=512, max_position_embeddings=32768)),
    "gemma3-270m": (Gemma3TextConfig, dict(hidden_size=640, num_hidden_layers=18, num_attention_heads=4,
                                           num_key_value_heads=1, head_dim=256, intermediate_size=2048,
                                           vocab_size=262144, sliding_window=512, max_position_embeddings=32768)),
    "mistral-7b": (MistralConfig, dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                       num_key_value_heads=8, intermediate_size=14336, vocab_size=32000,
                                       sliding_window=4096, max_position_embeddings=32768)),
}
path, shape = sys.argv[1], sys.argv[2]
config_cls, kwargs = SHAPES[shape]
if "--window" in sys.argv:
    value = sys.argv[sys.argv.index("--window") + 1]
    kwargs["sliding_window"] = None if value == "none" else int(value)
    if value == "none" and config_cls is not MistralConfig:  # Gemma: every layer full
        kwargs["layer_types"] = ["full_attention"] * kwargs["num_hidden_layers"]
        kwargs["sliding_window"] = 4096  # unused by full layers; the config class needs a number
cfg = config_cls(**kwargs, torch_dtype="bfloat16")
if "--config-only" in sys.argv:
    cfg.architectures = [{Gemma2Config: "Gemma2ForCausalLM", Gemma3TextConfig: "Gemma3ForCausalLM",
                          MistralConfig: "MistralForCausalLM"}[config_cls]]
    cfg.save_pretrained(path)
    print("saved config", path, "window", cfg.sliding_window, getattr(cfg, "layer_types", None) and
          sum(t == "sliding_attention" for t in cfg.layer_types), "sliding layers")
    sys.exit(0)
torch.manual_seed(0)
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
for name, p in model.named_parameters():
    if "norm" in name:
        p.data.fill_(0.0 if config_cls is not MistralConfig else 1.0)  # Gemma's norms scale by (1 + w)
    else:
        p.data.normal_(0, 0.02)
model.save_pretrained(path)
print("saved", path, sum(p.numel() for p in model.parameters()) / 1e9, "B params")
