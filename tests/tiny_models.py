"""Small random-weight HF models saved to a directory, for tests that need an architecture other than the bundled model."""
from __future__ import annotations

import torch

#: What the tiny-Llama checkpoint tests (FP8, integer weights) run: CPU, float32, a small pool, token-id prompts.
TINY_ENGINE_KW = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", num_gpu_blocks_override=64,
                      block_size=8)
TINY_PROMPTS = [[5, 17, 300, 42], [900, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [77] * 6]
TINY_MAX_TOKENS = 12


#: What the parallelism tests (tensor, pipeline) run on a tiny Llama: small pools and short chunks, so chunked prefill,
#: swap preemption and copy-on-write all happen; prompts and parameters of greedy and seeded parallel sampling.
PARALLEL_KW = dict(skip_tokenizer_init=True, block_size=8, num_gpu_blocks_override=12, swap_space=0.002,
                   max_num_batched_tokens=24, max_num_seqs=8, preemption_mode="swap")
PARALLEL_PROMPTS = [[1, 2, 3, 4, 5], [10, 20, 30], [100] * 20, list(range(40, 77))]


def parallel_params():
    from pagedllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, n=2, seed=7, max_tokens=16, ignore_eos=True)
    return [greedy, greedy, sampled, greedy]


def output_tokens(outputs) -> list[list[list[int]]]:
    """Every completion's token ids, per request."""
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def save_peaked_tiny_llama(path, num_layers: int, num_kv_heads: int, tie_word_embeddings: bool) -> str:
    """A Llama of 4 query heads (head_dim 16, vocab 255: uneven vocab splits) with peaked logits (initializer_range
    0.5: greedy choices far from ties), for the parallelism tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=255, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=num_kv_heads, head_dim=16,
                      max_position_embeddings=512, tie_word_embeddings=tie_word_embeddings, initializer_range=0.5,
                      bos_token_id=0, eos_token_id=254)
    LlamaForCausalLM(cfg).save_pretrained(str(path), safe_serialization=True)
    return str(path)


def tiny_hf_greedy(path, **from_pretrained_kwargs) -> list[list[int]]:
    """transformers' greedy tokens (float32, no end of sequence) for TINY_PROMPTS, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **from_pretrained_kwargs).eval()
    hf.generation_config.eos_token_id = None  # ignore_eos on the engine's side: never stop early here either
    out = []
    with torch.inference_mode():
        for p in TINY_PROMPTS:
            ids = torch.tensor([p])
            seq = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=TINY_MAX_TOKENS, pad_token_id=0)
            out.append(seq[0, len(p):].tolist())
    return out


def greedy_token_ids(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The engine's greedy tokens for token-id prompts (no end of sequence), one list per prompt."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


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
