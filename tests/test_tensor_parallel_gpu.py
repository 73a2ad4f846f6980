"""Tensor parallelism on GPUs through NCCL: tp=2 equals tp=1 token for token (needs 2 CUDA GPUs)."""
from __future__ import annotations

import gc

import pytest
import torch

from pagedllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

PROMPTS = [[1, 2, 3, 4, 5], [10, 20, 30], [100] * 40, list(range(40, 137)), [7] * 3, list(range(500, 520))]
# Small pool and short chunks: chunked prefill, swap preemption and copy-on-write cross the broadcast too.
KW = dict(
    skip_tokenizer_init=True, dtype="float32", device="cuda", block_size=16, num_gpu_blocks_override=14,
    swap_space=0.05, max_num_batched_tokens=64, max_num_seqs=8, preemption_mode="swap",
)


def _params() -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, n=2, seed=7, max_tokens=32, ignore_eos=True)
    return [greedy, greedy, sampled, greedy, greedy, greedy]


def _llama_dir(tmp_path_factory, heads: int, kv_heads: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1024, hidden_size=heads * 32, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=32, max_position_embeddings=1024,
        tie_word_embeddings=False, initializer_range=0.3, bos_token_id=0, eos_token_id=1023,
    )
    path = tmp_path_factory.mktemp(f"llama_{heads}h_{kv_heads}kv")
    LlamaForCausalLM(cfg).save_pretrained(str(path), safe_serialization=True)
    return str(path)


def _run(model_dir: str, **kw) -> tuple[list[list[list[int]]], dict]:
    llm = LLM(model_dir, **KW, **kw)
    try:
        outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
        return [[list(c.token_ids) for c in o.outputs] for o in outs], llm.stats()
    finally:
        llm.llm_engine.executor.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


# (8 q heads, 2 KV heads): an even split; (12, 3): 2+1 KV heads per rank; (4, 1): the KV head replicated.
# Decode steps replay CUDA graphs (NCCL all-reduce captured inside) unless enforce_eager.
@pytest.mark.parametrize("heads,kv_heads,enforce_eager", [(8, 2, False), (12, 3, False), (12, 3, True), (4, 1, False)])
def test_tp2_nccl_matches_tp1(tmp_path_factory, heads, kv_heads, enforce_eager):
    model_dir = _llama_dir(tmp_path_factory, heads, kv_heads)
    expected, ref_stats = _run(model_dir, enforce_eager=True)
    got, stats = _run(model_dir, tensor_parallel_size=2, distributed_executor_backend="mp", enforce_eager=enforce_eager)
    assert got == expected
    assert stats["num_swap_outs"] > 0 and stats["num_cow_copies"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
