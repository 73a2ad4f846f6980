"""Greedy outputs equal HF transformers token for token, under batching, preemption, chunking, block sizes."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

MAX_TOKENS = 24


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_all_free(llm: LLM) -> None:
    s = llm.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
    assert s["num_running"] == s["num_waiting"] == 0
    llm.llm_engine.scheduler.block_manager.check_invariants()


def _check(llm, parity_prompts, hf_greedy):
    ours = _run(llm, parity_prompts)
    for i, (a, b) in enumerate(zip(ours, hf_greedy)):
        assert a == b, f"prompt {i} (len {len(parity_prompts[i])}): pagedllm {a} != hf {b}"
    _assert_all_free(llm)


def test_batched_greedy_matches_hf(parity_prompts, hf_greedy):
    llm = LLM(num_gpu_blocks_override=512, max_model_len=1024)
    _check(llm, parity_prompts, hf_greedy)
    assert llm.stats()["num_preemptions"] == 0


def test_greedy_matches_hf_under_preemption(parity_prompts, hf_greedy):
    # 48 blocks × 16 = 768 token slots for ~1.4k prompt tokens: requests must be preempted and recomputed.
    llm = LLM(num_gpu_blocks_override=48, max_model_len=1024, preemption_mode="recompute")
    _check(llm, parity_prompts, hf_greedy)
    assert llm.stats()["num_preemptions"] > 0


def test_greedy_matches_hf_with_chunked_prefill(parity_prompts, hf_greedy):
    llm = LLM(num_gpu_blocks_override=512, max_model_len=1024, max_num_batched_tokens=64, max_num_seqs=8)
    _check(llm, parity_prompts, hf_greedy)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_greedy_matches_hf_for_block_sizes(block_size, parity_prompts, hf_greedy):
    num_blocks = 8192 // block_size
    llm = LLM(block_size=block_size, num_gpu_blocks_override=num_blocks, max_model_len=1024)
    _check(llm, parity_prompts, hf_greedy)


@pytest.mark.parametrize("gemm,kernels", [("torch", "torch"), ("onednn", "torch"), ("torch", "native")])
def test_greedy_matches_hf_on_every_cpu_path(gemm, kernels, monkeypatch, parity_prompts, hf_greedy):
    """The default run above uses oneDNN GEMMs and the native kernels; the fallbacks equal HF too."""
    from pagedllm.kernels.cpu_kernels import load_cpu_kernels

    monkeypatch.setenv("PAGEDLLM_CPU_GEMM", gemm)
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", kernels)
    load_cpu_kernels.cache_clear()
    try:
        llm = LLM(num_gpu_blocks_override=512, max_model_len=1024)
        worker = llm.llm_engine.executor.driver_worker
        assert worker.model_runner.attn_backend.name == ("torch" if kernels == "torch" else "cpu-native")
        packed = [m for m in worker.model.modules() if getattr(m, "packed_weight", None) is not None]
        assert bool(packed) == (gemm == "onednn")
        _check(llm, parity_prompts, hf_greedy)
    finally:
        load_cpu_kernels.cache_clear()
