"""Writes a mamba-130m-shaped Mamba-1 (hidden 768, 24 layers, state 16, expand 2, vocabulary 50 280; random weights,
transformers' init, seed 0) to /tmp/mamba_130m, for BENCHMARKS §82."""
import torch
import transformers

cfg = transformers.MambaConfig(vocab_size=50280, hidden_size=768, state_size=16, num_hidden_layers=24, expand=2,
                               conv_kernel=4, pad_token_id=0, bos_token_id=0, eos_token_id=0)
torch.manual_seed(0)
transformers.MambaForCausalLM(cfg).save_pretrained("/tmp/mamba_130m")
