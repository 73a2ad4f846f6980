"""Calibrated per-layer FP8 KV scales (``--calculate-kv-scales``, worker/kv_scale_calibration.py): the
calibration pass's amax against HF transformers on the same weights, per-layer scales, the calibration
prompt, the worker's wiring before the backend is built, the flag, and plain pools ignoring it. CPU,
float32, small random-weight Llama models; the FP8 engine itself on CUDA only."""
from __future__ import annotations

import argparse
import random

import pytest
import torch

from pagedllm.kernels import kv_quant
from pagedllm.worker import kv_scale_calibration as cal


def _tiny_llama(path, layers: int = 3, hidden: int = 64, heads: int = 4, std: float | None = None) -> None:
    """A random-weight Llama (GQA: 2 KV heads) saved as safetensors under `path`; weights N(0, std), or by
    default of different magnitudes per tensor (so that the layers' amax differ)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for i, p in enumerate(hf.parameters()):
            p.normal_(0, std if std is not None else 0.02 * (1 + i % 7))
    hf.save_pretrained(path)


def _worker(path, **engine_kw):
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.model import loader
    from pagedllm.model.models.registry import get_model_max_len
    from pagedllm.worker.worker import Worker

    args = EngineArgs(model=str(path), device="cpu", dtype="float32", skip_tokenizer_init=True,
                      num_gpu_blocks_override=8, swap_space=0, **engine_kw)
    model_dir = loader.prepare_model_dir(args.model, args.load_format)
    hf_config = loader.load_config(model_dir)
    config = args.create_engine_config(get_model_max_len(hf_config, args.max_model_len))
    worker = Worker(config, str(model_dir), hf_config)
    worker.load_model()
    return worker


def _hf_amax(path, token_ids: list[int]) -> tuple[list[float], list[float]]:
    """Per layer amax |k| (after RoPE) and |v| of HF transformers' own KV cache for the same prompt."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(torch.tensor([token_ids]), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    layers = cache.layers
    return ([layer.keys.abs().max().item() for layer in layers], [layer.values.abs().max().item() for layer in layers])


def test_calibration_amax_matches_hf_transformers_and_scales_differ_per_layer(tmp_path):
    _tiny_llama(tmp_path)
    worker = _worker(tmp_path)
    ids = random.Random(0).choices(range(256), k=97)
    result = worker.calibrate_kv_scales(ids)
    hf_k, hf_v = _hf_amax(tmp_path, ids)
    assert result.num_tokens == 97 and len(result.k_amax) == 3
    torch.testing.assert_close(torch.tensor(result.k_amax), torch.tensor(hf_k), rtol=1e-4, atol=0)
    torch.testing.assert_close(torch.tensor(result.v_amax), torch.tensor(hf_v), rtol=1e-4, atol=0)
    scales = worker.kv_spec.layer_scales
    assert scales == result.scales()
    for (ks, vs), k, v in zip(scales, hf_k, hf_v):
        assert ks == pytest.approx(k / kv_quant.K_SCALE_CONSTANT, rel=1e-4)
        assert vs == pytest.approx(v / kv_quant.V_SCALE_CONSTANT, rel=1e-4)
    assert len({k for k, _ in scales}) == 3 and len({v for _, v in scales}) == 3
    assert worker.kv_spec.scales(1) == scales[1]


def test_causal_attention_matches_the_reference_prefill():
    """The recorder's stand-in attention is the reference's causal GQA attention."""
    from pagedllm.kernels import reference
    from pagedllm.kernels.metadata import AttentionMetadata

    g = torch.Generator().manual_seed(0)
    t, hq, hk, d = 11, 6, 2, 8
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hk, hk))
    bs = 4
    nblk = -(-t // bs)
    kc, vc = torch.zeros(nblk, bs, hk, d), torch.zeros(nblk, bs, hk, d)
    slots = torch.arange(t)
    reference.reshape_and_cache(k, v, kc, vc, slots)
    meta = AttentionMetadata(slot_mapping=slots, block_tables=torch.arange(nblk, dtype=torch.int32)[None],
                             seq_lens=torch.tensor([t], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, t], dtype=torch.int32), seq_lens_cpu=[t],
                             query_lens_cpu=[t], num_decodes=0, max_seq_len=t, max_query_len=t)
    want = reference.paged_attention(q, k, v, kc, vc, meta, 0.3)
    torch.testing.assert_close(cal.causal_attention(q, k, v, 0.3), want, rtol=1e-5, atol=1e-5)
    sinks = torch.randn(hq, generator=g) * 3  # GPT-OSS's attention sinks, with a window
    want = reference.paged_attention(q, k, v, kc, vc, meta, 0.3, sliding_window=4, sinks=sinks)
    torch.testing.assert_close(cal.causal_attention(q, k, v, 0.3, 4, None, sinks), want, rtol=1e-5, atol=1e-5)


def test_scale_from_amax_and_defaults():
    assert kv_quant.scale_from_amax(10.0, 200.0) == 0.05
    for bad in (0.0, float("inf"), float("nan"), -1.0):
        assert kv_quant.scale_from_amax(bad, 200.0) == 1.0
    result = cal.KVCalibration((20.0, 0.0), (0.6, 3.0), 5, 0.1)
    assert result.scales() == ((0.1, 0.006), (1.0, 0.03))
    spec = kv_quant.KVCacheSpec(torch.float8_e4m3fn)
    assert spec.scales(7) == (1.0, 1.0)  # uncalibrated: every layer the default


def test_calibration_prompt():
    text = cal.calibration_text()
    assert 250 <= len(text.split()) <= 400
    from pagedllm.benchmarks.fp8_accuracy import eval_text

    assert text[:200] not in eval_text()  # not the accuracy benchmark's evaluation text
    ids = cal.calibration_token_ids(None, 100, 4096, seed=3)
    assert len(ids) == cal.NUM_RANDOM_TOKENS and all(0 <= i < 100 for i in ids)
    assert ids == cal.calibration_token_ids(None, 100, 4096, seed=3)  # deterministic
    assert cal.calibration_token_ids(None, 100, 10, seed=3) == ids[:10]  # capped at max_model_len

    class Words:
        def encode(self, s: str) -> list[int]:
            return [len(w) for w in s.split()]

    assert cal.calibration_token_ids(Words(), 100, 50) == [len(w) for w in text.split()][:50]
    with pytest.raises(ValueError, match="max_len"):
        cal.calibration_token_ids(None, 100, 0)


def test_calibration_text_tokens_with_the_bundled_tokenizer(tokenizer):
    ids = cal.calibration_token_ids(tokenizer, len(tokenizer), 4096)
    assert ids == list(tokenizer.encode(cal.calibration_text())) and 300 <= len(ids) <= 500
    assert cal.calibration_token_ids(tokenizer, len(tokenizer), 64) == ids[:64]


def test_fp8_pool_is_calibrated_in_init_cache_before_the_backend(tmp_path, monkeypatch):
    """The worker's wiring on CPU (an FP8 pool is CUDA-only, so its dtype check is bypassed): init_cache
    calibrates before the backend is built (random ids: no tokenizer), and the backend mapping keys every
    layer's key cache to its scales; by default (no --calculate-kv-scales) the scales stay 1.0."""
    _tiny_llama(tmp_path, layers=2)
    monkeypatch.setattr(kv_quant, "resolve_cache_dtype", lambda *a: torch.float8_e4m3fn)
    from pagedllm.worker import worker as worker_mod

    seen = []
    original = worker_mod.Worker.attn_backend

    def spy(self):
        seen.append(self.kv_spec.layer_scales)
        return original(self)

    monkeypatch.setattr(worker_mod.Worker, "attn_backend", spy)
    w = _worker(tmp_path, kv_cache_dtype="fp8", max_model_len=128, calculate_kv_scales=True)
    assert w.config.cache_config.calculate_kv_scales
    w.init_cache(8, 0)
    assert len(seen) == 1 and len(seen[0]) == 2 and seen[0] != ((1.0, 1.0), (1.0, 1.0))
    by_cache = w._scales_by_cache()
    assert [by_cache[k.data_ptr()] for k, _ in w.cache_engine.gpu_cache] == list(w.kv_spec.layer_scales)

    off = _worker(tmp_path, kv_cache_dtype="fp8", max_model_len=128)  # the default: scales of 1.0
    off.init_cache(8, 0)
    assert off.kv_spec.layer_scales == () and off._scales_by_cache() is None


def test_calculate_kv_scales_flag_parses():
    from pagedllm.config import CacheConfig
    from pagedllm.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args([])).calculate_kv_scales is False
    args = EngineArgs.from_cli_args(parser.parse_args(["--kv-cache-dtype", "fp8", "--no-calculate-kv-scales"]))
    assert args.calculate_kv_scales is False
    assert args.create_engine_config(1024).cache_config.calculate_kv_scales is False
    assert EngineArgs.from_cli_args(parser.parse_args(["--calculate-kv-scales"])).calculate_kv_scales is True
    with pytest.raises(ValueError, match="calculate_kv_scales must be a bool"):
        CacheConfig(calculate_kv_scales="yes")


def test_plain_pool_ignores_calculate_kv_scales(tmp_path, monkeypatch):
    from pagedllm import LLM, SamplingParams
    from pagedllm.worker.worker import Worker

    _tiny_llama(tmp_path, layers=2)

    def fail(self, token_ids=None):
        raise AssertionError("a plain pool must not calibrate")

    monkeypatch.setattr(Worker, "calibrate_kv_scales", fail)
    llm = LLM(model=str(tmp_path), device="cpu", dtype="float32", skip_tokenizer_init=True,
              num_gpu_blocks_override=16, max_model_len=128, calculate_kv_scales=True)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert llm.llm_engine.executor.driver_worker.kv_spec.layer_scales == ()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_fp8_calibrated_scales_on_cuda(tmp_path):
    """bf16 random-weight Llama with an FP8 pool: calibration with calculate_kv_scales=True (distinct per-layer
    scales, CUDA graphs captured after it), off by default; greedy first tokens agree with bf16."""
    from pagedllm import LLM, SamplingParams

    _tiny_llama(tmp_path, layers=4, hidden=256, heads=8, std=0.08)  # as test_engine_fp8_kv_cache_on_cuda
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 256) for _ in range(n)]} for n in (5, 17, 40, 3, 90, 33)]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results = {}
    for name, kw in (("bf16", {}), ("fp8", {"kv_cache_dtype": "fp8", "calculate_kv_scales": True}),
                     ("fp8-s1", {"kv_cache_dtype": "fp8"})):
        llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="bfloat16", device="cuda",
                  kv_cache_memory_bytes=32 << 20, max_model_len=256, max_num_seqs=8, max_capture_tokens=128, **kw)
        scales = llm.llm_engine.executor.driver_worker.kv_spec.layer_scales
        outs = llm.generate(prompts, sp, use_tqdm=False)
        results[name] = (scales, [list(o.outputs[0].token_ids) for o in outs])
        del llm
        torch.cuda.empty_cache()
    assert results["bf16"][0] == () and results["fp8-s1"][0] == ()
    scales = results["fp8"][0]
    assert len(scales) == 4 and len(set(scales)) == 4 and all(k > 0 and v > 0 for k, v in scales)
    base = results["bf16"][1]
    for name in ("fp8", "fp8-s1"):
        toks = results[name][1]
        same = sum(a == b for x, y in zip(toks, base) for a, b in zip(x, y)) / sum(map(len, base))
        first = sum(x[0] == y[0] for x, y in zip(toks, base))
        print(f"{name}: {same:.1%} of greedy tokens, {first}/6 first tokens agree with the bf16 pool; scales "
              f"{results[name][0]}")
        assert first >= 5, f"{name}: {first}/6 first tokens agree"
