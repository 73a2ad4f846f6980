"""--kv-cache-dtype bfloat16 on the CPU (the bundled float32 model): the pool stores bf16, so the same memory
holds twice the blocks and attention streams half the bytes; perplexity stays within a fraction of a percent
of the float32 pool, and every step path (the direct forward, the module path) attends to the same
stored values. The kernels themselves: tests/test_cpu_kernels.py, tests/test_cpu_isa.py."""
from __future__ import annotations

import math

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.fp8_accuracy import eval_text


def _perplexity(llm: LLM, ids: list[int]) -> float:
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    nll = [-lp[tid].logprob for tid, lp in zip(ids[1:], out.prompt_logprobs[1:])]
    return math.exp(sum(nll) / len(nll))


@pytest.fixture(scope="module")
def text_ids() -> list[int]:
    llm = LLM(device="cpu", num_gpu_blocks_override=8, max_model_len=1024)
    return list(llm.get_tokenizer().encode(eval_text()))[:600]


def test_bf16_pool_doubles_the_blocks_and_keeps_perplexity(text_ids):
    """64-token chunks, so every chunk reads the earlier ones back from the pool: the bf16 pool's rounding
    costs under 0.5 % of perplexity (measured: +0.11 % over 2 000 tokens, BENCHMARKS.md §39)."""
    kw = dict(device="cpu", max_model_len=1024, max_num_batched_tokens=64, kv_cache_memory_bytes=64 << 20)
    f32 = LLM(**kw)
    bf16 = LLM(kv_cache_dtype="bfloat16", **kw)
    pools = [llm.llm_engine.executor.driver_worker.cache_engine.gpu_cache[0][0] for llm in (f32, bf16)]
    assert (pools[0].dtype, pools[1].dtype) == (torch.float32, torch.bfloat16)
    blocks = [llm.stats()["kv_blocks_total"] for llm in (f32, bf16)]
    assert blocks[1] == 2 * blocks[0]
    assert bf16.stats()["kv_cache_dtype"] == "bfloat16"
    p32, p16 = _perplexity(f32, text_ids), _perplexity(bf16, text_ids)
    assert abs(p16 / p32 - 1) < 5e-3, (p32, p16)


def test_bf16_pool_gives_the_same_tokens_on_every_step_path(text_ids, monkeypatch):
    """Greedy tokens with the bf16 pool are the same whether the steps run the direct forward or the module
    path with the native backend: both write and read the pool with the same kernels. (Chunks that the
    backend sends to torch attend to the K/V as stored too: tests/test_cpu_kernels.py.)"""
    prompts = [{"prompt_token_ids": text_ids[i * 50: i * 50 + 120]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kw = dict(device="cpu", kv_cache_dtype="bfloat16", quantization="gguf", max_model_len=1024,
              num_gpu_blocks_override=128)
    direct = LLM(**kw)
    assert direct.llm_engine.executor.driver_worker.model_runner.direct_forward is not None
    want = [list(o.outputs[0].token_ids) for o in direct.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("PAGEDLLM_CPU_DIRECT_FORWARD", "0")
    module = LLM(**kw)
    assert module.llm_engine.executor.driver_worker.model_runner.direct_forward is None
    got = [list(o.outputs[0].token_ids) for o in module.generate(prompts, params, use_tqdm=False)]
    assert got == want


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_pool_under_a_float32_model_on_cuda(tmp_path):
    """The flag holds on the GPU too: a float32 model (tiny, random) with a bf16 pool runs the Triton kernels and
    CUDA graphs, and its teacher-forced perplexity stays within 1 % of the float32 pool's."""
    from tiny_models import save_tiny_llama

    model_dir = save_tiny_llama(tmp_path)
    ids = [int(x) for x in torch.randint(1, 1024, (300,), generator=torch.Generator().manual_seed(0))]
    ppl = {}
    for kv in ("auto", "bfloat16"):
        llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", device="cuda", kv_cache_dtype=kv,
                  max_model_len=512, num_gpu_blocks_override=64, max_num_batched_tokens=64)
        pool = llm.llm_engine.executor.driver_worker.cache_engine.gpu_cache[0][0]
        assert pool.dtype == (torch.bfloat16 if kv == "bfloat16" else torch.float32)
        ppl[kv] = _perplexity(llm, ids)
        del llm
    assert abs(ppl["bfloat16"] / ppl["auto"] - 1) < 1e-2, ppl


def test_a_bfloat16_model_attends_through_the_native_kernels(text_ids, monkeypatch):
    """A bfloat16 model on the CPU takes the native attention backend (its q/k/v widened to float32 for the
    kernels, BENCHMARKS.md §52.9). In 16-token chunks every chunk and decode runs the kernels' token path, so the
    perplexity it gives equals the torch backend's to bf16 precision."""
    from pagedllm.model.layers.attention import NativeCpuAttentionBackend

    ids = text_ids[:300]
    kw = dict(device="cpu", dtype="bfloat16", quantization="none", max_model_len=1024, max_num_batched_tokens=16,
              num_gpu_blocks_override=64)
    native = LLM(**kw)
    assert native.llm_engine.executor.driver_worker.model_runner.attn_backend.name == "cpu-native"
    p_native = _perplexity(native, ids)
    del native
    monkeypatch.setattr(NativeCpuAttentionBackend, "model_dtypes", (torch.float32,))
    reference = LLM(**kw)
    assert reference.llm_engine.executor.driver_worker.model_runner.attn_backend.name == "torch"
    p_torch = _perplexity(reference, ids)
    assert abs(p_native / p_torch - 1) < 5e-3, (p_native, p_torch)
