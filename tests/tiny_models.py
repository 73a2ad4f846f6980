"""Small random-weight HF models saved to a directory, for tests that need an architecture other than the bundled model."""
from __future__ import annotations

import torch


def _save_random(hf_model, path) -> str:
    """Weights (and biases) of `hf_model` drawn N(0, 0.08) from torch's generator as the caller seeded it, saved to
    `path`."""
    hf = hf_model.to(torch.float32).eval()
    for p in hf.parameters():
        p.data.normal_(0, 0.08)
    hf.save_pretrained(path)
    return str(path)


def save_tiny_llama(path, tie_word_embeddings: bool = False) -> str:
    """A 3-layer GQA Llama (hidden 256, 8 q / 2 KV heads, vocab 1024), weights N(0, 0.08), saved to `path`
    (`tie_word_embeddings`: the LM head shares the embeddings, as in the bundled model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=tie_word_embeddings)
    return _save_random(LlamaForCausalLM(cfg), path)


def save_tiny_qwen2(path, tie_word_embeddings: bool = True) -> str:
    """A 2-layer Qwen2 (q/k/v biases; hidden 256, 8 q / 2 KV heads, vocab 1024), weights and biases N(0, 0.08)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=tie_word_embeddings)
    return _save_random(Qwen2ForCausalLM(cfg), path)
