"""The offline lower bound's arithmetic (pagedllm/benchmarks/lower_bound.py) on a hand-computed case."""
from __future__ import annotations

import pytest

from pagedllm.benchmarks.lower_bound import (
    ModelShape,
    format_bound,
    lower_bound,
    with_step_count,
)


def test_lower_bound_matches_a_hand_computed_case():
    # 1 layer, hidden 4, 2 heads (1 KV head) of dim 2, intermediate 8, vocab 10, gated MLP, 2 bytes.
    shape = ModelShape(num_layers=1, hidden=4, intermediate=8, num_heads=2, num_kv_heads=1, head_dim=2, vocab=10)
    # qkv 4·(2+2)·2 = 32, o 2·2·4 = 16, mlp 3·4·8 = 96 → 144 matmul params; + lm_head 40 → W = 368 bytes.
    assert shape.matmul_params == 144 and shape.step_weight_bytes == 368
    assert shape.kv_bytes_per_token == 2 * 1 * 1 * 2 * 2 == 8
    # Two requests: (p=3, o=2) and (p=1, o=3). Pool of 8 tokens, mean length 4.5 → batch 1 (8 // 4.5).
    lb = lower_bound(shape, [3, 1], [2, 3], max_num_seqs=4, pool_tokens=8, bandwidth=100.0, matmul_peak=1000.0)
    # prefill FLOPs: 2·144·4 tokens = 1152; attention 1·4·2·2 = 16 per p(p+1)/2: (6 + 1)·16 = 112; lm 2·40 = 80 each.
    assert lb.prefill_flops == 1152 + 112 + 160
    assert lb.prefill_s == pytest.approx(1424 / 1000)
    # decode tokens: 1 + 2 = 3 at batch 1 → 3 steps of 368 bytes; KV tokens: (3+1) + (1+1)+(1+2) = 9 → 72 bytes.
    assert lb.decode_batch == 1 and lb.decode_steps == 3
    assert lb.decode_weight_bytes == 3 * 368 and lb.decode_kv_bytes == 72
    # decode FLOPs 2·184·3 = 1104 → 1.104 s at 1000 FLOP/s; bytes (1104 + 72) / 100 = 11.76 s: memory wins.
    assert lb.decode_flops == 1104
    assert lb.decode_s == pytest.approx(11.76)
    assert lb.total_s == pytest.approx(1.424 + 11.76)
    assert "efficiency 50.0 %" in format_bound(lb, 2 * lb.total_s)


def test_lower_bound_batch_is_capped_by_max_num_seqs_and_requests_and_checks_input():
    shape = ModelShape(1, 4, 8, 2, 1, 2, 10)
    assert lower_bound(shape, [3] * 10, [5] * 10, 4, 10**6, 1.0, 1.0).decode_batch == 4
    assert lower_bound(shape, [3] * 2, [5] * 2, 4, 10**6, 1.0, 1.0).decode_batch == 2
    # One long request: its 99 decode tokens need 99 sequential steps whatever the batch.
    chain = lower_bound(shape, [3, 3, 3], [100, 2, 2], 4, 10**6, 1.0, 1.0)
    assert chain.decode_batch == 3 and chain.decode_steps == 99
    with pytest.raises(ValueError, match="equal length"):
        lower_bound(shape, [3], [], 4, 100, 1.0, 1.0)
    with pytest.raises(ValueError, match="bandwidth"):
        lower_bound(shape, [3], [2], 4, 100, 0.0, 1.0)


def test_fp8_kv_and_weights_count_one_byte_and_linears_run_at_the_fp8_peak():
    # The hand-computed case above with an FP8 KV cache and FP8 decoder weights (the lm_head stays 2 bytes).
    shape = ModelShape(num_layers=1, hidden=4, intermediate=8, num_heads=2, num_kv_heads=1, head_dim=2, vocab=10,
                       kv_dtype_bytes=1, matmul_weight_bytes=1)
    assert shape.step_weight_bytes == 144 + 40 * 2 and shape.kv_bytes_per_token == 4
    lb = lower_bound(shape, [3, 1], [2, 3], max_num_seqs=4, pool_tokens=8, bandwidth=100.0, matmul_peak=1000.0,
                     linear_peak=2000.0)
    # prefill: linears 1152 FLOPs at 2000/s, attention + lm_head 112 + 160 at 1000/s
    assert lb.prefill_s == pytest.approx(1152 / 2000 + 272 / 1000)
    # decode: 3 steps × 224 bytes + 9 KV tokens × 4 bytes at 100 B/s (compute: 0.432 + 0.24 s, smaller)
    assert lb.decode_weight_bytes == 3 * 224 and lb.decode_kv_bytes == 36
    assert lb.decode_s == pytest.approx(708 / 100)
    # the same shape without FP8 is the case above: the bound shrinks by the bytes saved
    assert lower_bound(ModelShape(1, 4, 8, 2, 1, 2, 10), [3, 1], [2, 3], 4, 8, 100.0, 1000.0).decode_s == \
        pytest.approx(11.76)


def test_bound_at_a_runs_step_count_charges_the_weights_per_step():
    # The hand-computed case: 3 ideal decode steps of 368 weight bytes + 72 KV bytes at 100 B/s = 11.76 s.
    shape = ModelShape(num_layers=1, hidden=4, intermediate=8, num_heads=2, num_kv_heads=1, head_dim=2, vocab=10)
    lb = lower_bound(shape, [3, 1], [2, 3], max_num_seqs=4, pool_tokens=8, bandwidth=100.0, matmul_peak=1000.0)
    assert lb.decode_compute_s == pytest.approx(1104 / 1000)
    # A schedule that took 5 decode-carrying steps: 5 · 368 + 72 = 1912 bytes → 19.12 s; prefill unchanged.
    run = with_step_count(lb, shape, 5)
    assert run.decode_steps == 5 and run.decode_weight_bytes == 5 * 368 and run.decode_kv_bytes == 72
    assert run.decode_s == pytest.approx(19.12) and run.total_s == pytest.approx(1.424 + 19.12)
    # Compute still wins where it is larger: at a peak of 10 FLOP/s the 1104 decode FLOPs take 110.4 s.
    slow = lower_bound(shape, [3, 1], [2, 3], 4, 8, 100.0, 10.0)
    assert with_step_count(slow, shape, 5).decode_s == pytest.approx(110.4)
    with pytest.raises(ValueError, match="steps"):
        with_step_count(lb, shape, 0)


def test_throughput_benchmark_runs_the_engines_default_dtype_and_the_peer_follows_it():
    """`bench throughput` leaves --dtype at "auto" (bfloat16 on CUDA, float32 on the CPU), and the HF peers resolve
    it as the engine does, also for a device named with its index."""
    import argparse

    import torch

    from pagedllm.benchmarks import throughput
    from pagedllm.worker.worker import resolve_dtype

    parser = argparse.ArgumentParser()
    throughput.add_args(parser)
    assert parser.parse_args([]).dtype == "auto"
    assert resolve_dtype("auto", "cuda") == resolve_dtype("auto", "cuda:0") == torch.bfloat16
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("float16", "cuda:1") == torch.float16


def test_sliding_windows_bound_attention_flops_and_kv_reads():
    # 2 layers: one with a window of 2 keys, one global. Request (p=4, o=3): decode queries at contexts 5 and 6.
    shape = ModelShape(num_layers=2, hidden=4, intermediate=8, num_heads=2, num_kv_heads=1, head_dim=2, vocab=10,
                       layer_windows=(2, None))
    full = ModelShape(num_layers=2, hidden=4, intermediate=8, num_heads=2, num_kv_heads=1, head_dim=2, vocab=10)
    lb = lower_bound(shape, [4], [3], max_num_seqs=4, pool_tokens=64, bandwidth=100.0, matmul_peak=1000.0)
    ref = lower_bound(full, [4], [3], max_num_seqs=4, pool_tokens=64, bandwidth=100.0, matmul_peak=1000.0)
    # keys per layer, averaged: prefill (1+2+2+2 + 1+2+3+4) / 2 = 8.5 against 10; decode (2+2 + 5+6) / 2 = 7.5 vs 11.
    per_key = 2 * 4 * 2 * 2  # layers · 4·Hq·D
    assert ref.prefill_flops - lb.prefill_flops == per_key * (10 - 8.5)
    assert lb.decode_kv_bytes == 7.5 * full.kv_bytes_per_token and ref.decode_kv_bytes == 11 * full.kv_bytes_per_token
    assert shape.shared_window is None and ModelShape(1, 4, 8, 2, 1, 2, 10, layer_windows=(3,)).shared_window == 3


def test_model_shape_reads_each_layers_window_from_the_config():
    import transformers

    mistral = ModelShape.from_hf_config(transformers.MistralConfig(num_hidden_layers=3, sliding_window=64))
    assert mistral.layer_windows == (64, 64, 64) and mistral.shared_window == 64
    gemma2 = ModelShape.from_hf_config(transformers.Gemma2Config(num_hidden_layers=4, sliding_window=32))
    assert gemma2.layer_windows == (32, None, 32, None)
    assert ModelShape.from_hf_config(transformers.LlamaConfig(num_hidden_layers=2)).layer_windows == ()
