"""--quantization fp8 (issue 21): per-channel weight quantization bounds, the _scaled_mm linear against a
float32 matmul, the CPU error, and (CUDA) the engine's greedy output against the bf16 model."""
from __future__ import annotations

import random

import pytest
import torch

from pagedllm.kernels import fp8_linear


def test_weight_quantization_is_per_channel_and_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 48, generator=g) * torch.logspace(-3, 1, 64)[:, None]  # channels of very different size
    q, s = fp8_linear.quantize_weight(w.to(torch.bfloat16))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (1, 64) and s.dtype == torch.float32
    back = q.float() * s.t()
    wb = w.to(torch.bfloat16).float()
    # Each channel's largest element maps to ±448; relative error ≤ 2^-4 above e4m3's normal range.
    assert torch.allclose(q.float().abs().amax(dim=1), torch.full((64,), 448.0))
    normal = wb.abs() >= s.t() * 2.0**-6
    assert ((back - wb).abs() / wb.abs())[normal].max().item() <= 2.0**-4 + 1e-6


def test_fp8_linear_matches_float_matmul():
    # torch 2.11's CPU _scaled_mm takes only per-tensor scales (2.13's takes row-wise): CUDA where there is one.
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 64, generator=g).to(dev, torch.bfloat16)
    w = (torch.randn(32, 64, generator=g) * 0.05).to(dev, torch.bfloat16)
    b = torch.randn(32, generator=g).to(dev, torch.bfloat16)
    q, s = fp8_linear.quantize_weight(w)
    y = fp8_linear.fp8_linear(x, q, s, b, torch.bfloat16)
    ref = x.float() @ w.float().t() + b.float()
    assert y.shape == (3, 7, 32) and y.dtype == torch.bfloat16
    assert ((y.float() - ref).norm() / ref.norm()).item() < 0.06  # two e4m3 roundings (x and W)


def test_quantization_choices_and_cpu_error():
    from pagedllm import LLM
    from pagedllm.config import ModelConfig

    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig(quantization="int3")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="quantization='fp8' needs a CUDA device"):
            LLM(quantization="fp8", device="cpu", num_gpu_blocks_override=8)


@pytest.mark.cuda
def test_engine_fp8_weights_on_cuda(tmp_path):
    """bf16 random-weight Llama with FP8 weights (and FP8 weights + FP8 KV), CUDA graphs on: greedy output
    agrees with the bf16 model; the first token of every prompt matches."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm import LLM, SamplingParams

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    hf = LlamaForCausalLM(cfg).eval()
    for p in hf.parameters():
        p.data.normal_(0, 0.08)
    hf.save_pretrained(tmp_path)
    del hf
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 1024) for _ in range(n)]} for n in (5, 17, 40, 3, 90, 33)]
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    results = {}
    for name, kw in (("bf16", {}), ("w8", {"quantization": "fp8"}),
                     ("w8kv8", {"quantization": "fp8", "kv_cache_dtype": "fp8"})):
        llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="bfloat16", device="cuda",
                  kv_cache_memory_bytes=64 << 20, max_model_len=512, **kw)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        results[name] = [list(o.outputs[0].token_ids) for o in outs]
        del llm
        torch.cuda.empty_cache()
    base = results["bf16"]
    for name in ("w8", "w8kv8"):
        same = sum(a == b for x, y in zip(results[name], base) for a, b in zip(x, y)) / sum(map(len, base))
        first = sum(x[0] == y[0] for x, y in zip(results[name], base))
        print(f"{name}: {same:.1%} of greedy tokens and {first}/6 first tokens agree with bf16")
        assert first >= 5 and same >= 0.3, f"{name}: {same:.2%} of greedy tokens, {first}/6 first tokens agree"
