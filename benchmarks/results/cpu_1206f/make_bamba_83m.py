"""Writes the 83 M-parameter Bamba of BENCHMARKS §81.3 (random weights, transformers' init, seed 0) to /tmp/bamba_s."""
import torch
import transformers

cfg = transformers.BambaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=12,
                               num_attention_heads=9, num_key_value_heads=3, attn_layer_indices=[5, 11],
                               mamba_n_heads=18, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4,
                               mamba_chunk_size=128, max_position_embeddings=4096, tie_word_embeddings=True,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2)
torch.manual_seed(0)
transformers.BambaForCausalLM(cfg).save_pretrained("/tmp/bamba_s")
