"""A model whose every layer slides (Mistral-7B-v0.1's layout, here tiny and random) runs sequences longer than the
whole KV pool: the block manager frees the blocks behind the window as they fall out of it, the kernels never need
them, and the tokens are transformers' greedy tokens all the same."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from test_models_hf import hf_greedy_reference
from tiny_models import greedy_token_ids

from pagedllm import LLM, SamplingParams

VOCAB = 500
WINDOW = 8
PROMPT_LENS = (20, 13, 27)
MAX_TOKENS = 60  # every sequence reaches 73-87 tokens; the pool holds 48
ENGINE_KW = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", swap_space=0.01, block_size=4,
                 num_gpu_blocks_override=12, max_model_len=128, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], list[list[int]]]:
    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        sliding_window=WINDOW, initializer_range=0.1)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("mistral_window")
    model.save_pretrained(path, safe_serialization=True)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    model.set_attn_implementation("eager")
    model.generation_config.eos_token_id = None  # ignore_eos on our side: never stop early here either
    return path, prompts, hf_greedy_reference(model, prompts, MAX_TOKENS)[0]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return greedy_token_ids(llm, prompts, MAX_TOKENS)


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_sequences_longer_than_the_pool_match_transformers(kernels: str, mistral, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", kernels)
    path, prompts, reference = mistral
    llm = LLM(model=str(path), **ENGINE_KW)
    assert llm.llm_engine.scheduler.block_manager.sliding_window == WINDOW
    assert _greedy(llm, prompts) == reference
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == 12
    llm.llm_engine.scheduler.block_manager.check_invariants()


def test_prefix_cache_hits_behind_a_window(mistral) -> None:
    path, prompts, reference = mistral
    llm = LLM(model=str(path), enable_prefix_caching=True, **ENGINE_KW)
    assert _greedy(llm, prompts[:1]) == reference[:1]
    assert _greedy(llm, prompts) == reference  # the first prompt again: its blocks are looked up in the cache
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_each_sequence_holds_about_one_window(mistral) -> None:
    path, prompts, _ = mistral
    llm = LLM(model=str(path), **ENGINE_KW)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request("0", {"prompt_token_ids": prompts[2]}, params)
    bm = engine.scheduler.block_manager
    held_max, steps = 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        held_max = max(held_max, bm.num_gpu_blocks - bm.get_num_free_gpu_blocks())
    # At most the window and one step's chunk of 16 tokens, in blocks of 4, plus the partly filled ones.
    assert 0 < held_max <= -(-(WINDOW + 16) // 4) + 2
    assert steps >= MAX_TOKENS


def test_disable_sliding_window_caps_max_model_len_at_the_window(mistral) -> None:
    path, prompts, reference = mistral
    kw = {**ENGINE_KW, "max_model_len": None, "num_gpu_blocks_override": 64}
    llm = LLM(model=str(path), disable_sliding_window=True, **kw)
    assert llm.llm_engine.config.scheduler_config.max_model_len == WINDOW
    assert llm.llm_engine.scheduler.block_manager.sliding_window is None
    short = [p[:4] for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=WINDOW - 4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in short], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == WINDOW - 4 for o in outs)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=str(path), disable_sliding_window=True, **{**kw, "max_model_len": 64})
