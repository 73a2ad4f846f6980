"""Memory sharing on CUDA, against Hugging Face transformers on the same weights in float32.

Prefix caching reads cached context through the Triton prefill kernel; beam search forks and frees
sequences, copies shared last blocks with the Triton `copy_blocks`, and decodes through CUDA graphs.
"""
from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.cuda

EOS = 1023


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, initializer_range=0.3, bos_token_id=0, eos_token_id=EOS)
    path = tmp_path_factory.mktemp("cuda_sharing_llama")
    LlamaForCausalLM(cfg).save_pretrained(str(path), safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).to("cuda").eval()


def _llm(model_dir: str, **kw) -> LLM:
    return LLM(model_dir, skip_tokenizer_init=True, dtype="float32", device="cuda", block_size=16,
               num_gpu_blocks_override=256, max_model_len=512, swap_space=0.05, **kw)


def _hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                eos_token_id=None, pad_token_id=EOS)
    return out[0, len(prompt):].tolist()


def test_prefix_caching_on_cuda_matches_hf(model_dir, hf_model):
    rng = random.Random(0)
    prefix = [rng.randrange(1, 1000) for _ in range(53)]  # 3 full blocks of 16 are cacheable
    prompts = [prefix + [rng.randrange(1, 1000) for _ in range(rng.randint(1, 30))] for _ in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = _llm(model_dir, enable_prefix_caching=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 48 for o in rest)  # the cached prefix blocks were reused
    assert llm.stats()["prefix_cache_hits"] >= 4 * 48
    for prompt, out in zip(prompts, first + rest):
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf_model, prompt, 16)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_beam_search_on_cuda_matches_hf(model_dir, hf_model, enforce_eager):
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 1000) for _ in range(n)] for n in (5, 17, 31)]  # partial last blocks: CoW
    width, max_tokens = 3, 10
    llm = _llm(model_dir, enforce_eager=enforce_eager)
    params = SamplingParams(use_beam_search=True, best_of=width, n=width, temperature=0.0, max_tokens=max_tokens,
                            ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.stats()["num_cow_copies"] > 0
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt], device="cuda")
        with torch.inference_mode():
            hf = hf_model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width,
                                   num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens,
                                   early_stopping=False, length_penalty=1.0, eos_token_id=None, pad_token_id=EOS,
                                   return_dict_in_generate=True, output_scores=True)
        expected = hf.sequences[:, len(prompt):].tolist()
        assert [list(c.token_ids) for c in out.outputs] == expected
        for c, score in zip(out.outputs, hf.sequences_scores.tolist()):
            assert c.cumulative_logprob / len(c.token_ids) == pytest.approx(score, abs=2e-3)
