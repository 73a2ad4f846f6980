"""Pooling models (vLLM's --runner pooling): `LLM.embed` returns each prompt's pooled final hidden state.

The independent reference is transformers' own forward on the same weights (the bundled GGUF read by
transformers, or a random base model saved by it): its last hidden state (after the final norm) pooled the
same way. Chunked prompts, prefix caching and preemption must not change an embedding."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM, PoolingParams, SamplingParams

TEXTS = [
    "Hello, my name is",
    "x",
    "The capital of France is Paris, a city on the Seine that " * 12,
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
]
# device="cpu": these parity checks hold float32 to 1e-4, so they stay on the CPU where a GPU is present too
# (the CUDA ones below say so explicitly).
ENGINE_KW = dict(runner="pooling", num_gpu_blocks_override=64, max_num_batched_tokens=48, device="cpu")


def _reference(hf_model, ids: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    with torch.no_grad():
        h = hf_model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    vec = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[pooling]
    return F.normalize(vec, dim=-1) if normalize else vec


def _vectors(outs) -> list[torch.Tensor]:
    return [torch.tensor(o.outputs.embedding) for o in outs]


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_embeddings_match_transformers(pooling: str, hf_model) -> None:
    """Every pooling type, on prompts of 1 to ~160 tokens, the longest cut into 48-token chunks."""
    llm = LLM(**ENGINE_KW, pooler_config={"pooling_type": pooling})
    outs = llm.embed(TEXTS, use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in outs) > 3 * ENGINE_KW["max_num_batched_tokens"]
    for out, vec in zip(outs, _vectors(outs)):
        assert out.finished and vec.shape == (576,)
        ref = _reference(hf_model, out.prompt_token_ids, pooling)
        torch.testing.assert_close(vec, ref, atol=1e-4, rtol=0)
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]  # nothing held after the requests


def test_normalize_off_truncation_and_encode(hf_model) -> None:
    llm = LLM(**ENGINE_KW)
    raw = llm.embed(TEXTS[2], PoolingParams(normalize=False), use_tqdm=False)[0]
    ref = _reference(hf_model, raw.prompt_token_ids, "LAST", normalize=False)
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding), ref, atol=1e-4, rtol=1e-4)
    assert ref.norm() > 2  # unnormalized really is another vector
    cut = llm.embed(TEXTS[2], truncate_prompt_tokens=10, use_tqdm=False)[0]
    assert cut.prompt_token_ids == raw.prompt_token_ids[-10:]
    torch.testing.assert_close(torch.tensor(cut.outputs.embedding), _reference(hf_model, cut.prompt_token_ids, "LAST"),
                               atol=1e-4, rtol=0)
    enc = llm.encode([TEXTS[0], {"prompt_token_ids": cut.prompt_token_ids}], use_tqdm=False)
    assert isinstance(enc[0].outputs.data, torch.Tensor) and enc[0].outputs.data.dtype == torch.float32
    torch.testing.assert_close(enc[1].outputs.data, torch.tensor(cut.outputs.embedding))


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_prefix_caching_and_a_tight_pool_keep_embeddings(pooling: str) -> None:
    """Shared prefixes (LAST keeps the prefix cache; MEAN turns it off) in a pool of 12 blocks that holds one
    prompt and a bit: the same vectors as one prompt at a time in a roomy pool."""
    prefix = "You are a helpful assistant. Answer briefly and cite sources where you can. " * 4
    texts = [prefix + t for t in ("What is a cat?", "What is a dog?", "Name a river.", "Why is the sky blue?")] * 2
    cfg = {"pooling_type": pooling}
    alone = LLM(**ENGINE_KW, pooler_config=cfg)
    want = [_vectors(alone.embed(t, use_tqdm=False))[0] for t in texts]
    del alone
    tight = LLM(runner="pooling", pooler_config=cfg, num_gpu_blocks_override=12, block_size=8,
                max_num_batched_tokens=32, enable_prefix_caching=True)
    outs = tight.embed(texts, use_tqdm=False)
    for got, ref in zip(_vectors(outs), want):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)
    assert tight.llm_engine.config.cache_config.enable_prefix_caching == (pooling == "LAST")
    if pooling == "LAST":
        assert sum(o.num_cached_tokens for o in outs) > 0


def test_a_recomputed_prompt_is_reduced_once() -> None:
    """Preempted by recompute, a prompt's rows come again from position 0: MEAN and CLS count each position once."""
    from pagedllm.config import PoolerConfig
    from pagedllm.engine.pooling import PoolingState

    rows = torch.randn(10, 8)
    for kind, want in (("MEAN", rows.mean(0)), ("CLS", rows[0])):
        state = PoolingState.of(PoolingParams(normalize=False), PoolerConfig(kind))
        state.add_rows(0, rows[:4])
        state.add_rows(4, rows[4:7])
        state.add_rows(0, rows[:7])  # recomputed after a preemption
        state.add_rows(7, rows[7:])
        torch.testing.assert_close(state.finish(rows[-1], 10), want)


def test_wrong_runner_and_bad_requests_are_clear_errors() -> None:
    pooling = LLM(**ENGINE_KW)
    with pytest.raises(ValueError, match="LLM.embed"):
        pooling.generate("Hello", SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="PoolingParams, not SamplingParams"):
        pooling.llm_engine.add_request("r0", "Hello", SamplingParams())
    with pytest.raises(ValueError, match="Matryoshka"):
        pooling.embed("Hello", PoolingParams(dimensions=64), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
    assert not pooling.llm_engine.has_unfinished_requests()
    # The engine still serves after the refusals.
    assert len(pooling.embed("Hello", use_tqdm=False)[0].outputs.embedding) == 576
    generating = LLM(num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="runner='pooling'"):
        generating.embed("Hello", use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_type"):
        LLM(runner="pooling", pooler_config={"pooling_type": "MAX"}, num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="pooler_config applies to pooling models"):
        LLM(pooler_config={"pooling_type": "MEAN"}, num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="nothing to speculate"):
        LLM(runner="pooling", speculative_config={"method": "ngram"}, num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="convert='embed'"):
        LLM(runner="generate", convert="embed", num_gpu_blocks_override=64)


def _save_base_model(kind: str, path: Path, matryoshka: bool = False):
    """A random 2-layer base model (no LM head) as transformers saves it: the embedding checkpoints' layout."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512)
    if kind == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=32)
        model = transformers.Qwen3Model(cfg)
    else:
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaModel(cfg)
    for p in model.parameters():
        p.data.normal_(0, 0.08)
    if matryoshka:
        model.config.matryoshka_dimensions = [32, 64, 128]
    model = model.float().eval()
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_base_model_checkpoint_is_an_embedding_model(kind: str, tmp_path: Path) -> None:
    """A LlamaModel / Qwen3Model checkpoint (tensor names without `model.`, no LM head) runs the pooling runner
    by default and matches transformers; it cannot generate."""
    hf = _save_base_model(kind, tmp_path)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32", num_gpu_blocks_override=32,
              max_num_batched_tokens=16)
    assert llm.llm_engine.runner == "pooling"
    prompts = [[5, 17, 300, 2, 9], list(range(40, 80)), [7]]
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for p, vec in zip(prompts, _vectors(outs)):
        with torch.no_grad():
            ref = F.normalize(hf(input_ids=torch.tensor([p])).last_hidden_state[0, -1], dim=-1)
        torch.testing.assert_close(vec, ref, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="no LM head"):
        LLM(str(tmp_path), skip_tokenizer_init=True, runner="generate", num_gpu_blocks_override=32)


def test_tensor_parallel_tp2_embeddings(tmp_path: Path) -> None:
    """At tp=2 (real processes, gloo) the driver's hidden states are whole after the last all-reduce."""
    hf = _save_base_model("qwen3", tmp_path)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32", num_gpu_blocks_override=32,
              tensor_parallel_size=2, distributed_executor_backend="mp", pooler_config={"pooling_type": "MEAN"})
    prompts = [[5, 17, 300, 2, 9], list(range(40, 70))]
    try:
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    finally:
        llm.llm_engine.executor.shutdown()
    for p, vec in zip(prompts, _vectors(outs)):
        with torch.no_grad():
            ref = F.normalize(hf(input_ids=torch.tensor([p])).last_hidden_state[0].mean(0), dim=-1)
        torch.testing.assert_close(vec, ref, atol=1e-5, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,pooling,atol", [("float32", "LAST", 1e-4), ("bfloat16", "MEAN", 3e-2)])
def test_cuda_embeddings_match_transformers(dtype: str, pooling: str, atol: float, hf_model) -> None:
    """On the GPU's kernels and CUDA graphs (a 1-token prompt runs as a decode-graph step)."""
    llm = LLM(**{**ENGINE_KW, "device": "cuda"}, dtype=dtype, pooler_config={"pooling_type": pooling})
    outs = llm.embed(TEXTS, use_tqdm=False)
    for out, vec in zip(outs, _vectors(outs)):
        ref = _reference(hf_model, out.prompt_token_ids, pooling)
        torch.testing.assert_close(vec, ref, atol=atol, rtol=0)
        assert float(vec @ ref) > 0.999


def test_matryoshka_dimensions(tmp_path: Path) -> None:
    """A model trained for Matryoshka sizes cuts the vector to `dimensions`, then normalizes (vLLM's order)."""
    hf = _save_base_model("llama", tmp_path, matryoshka=True)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32", num_gpu_blocks_override=32)
    prompt = {"prompt_token_ids": [3, 1, 4, 1, 5, 9, 2, 6]}
    vec = torch.tensor(llm.embed(prompt, PoolingParams(dimensions=64), use_tqdm=False)[0].outputs.embedding)
    with torch.no_grad():
        h = hf(input_ids=torch.tensor([prompt["prompt_token_ids"]])).last_hidden_state[0, -1]
    torch.testing.assert_close(vec, F.normalize(h[:64], dim=-1), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"\[32, 64, 128\]"):
        llm.embed(prompt, PoolingParams(dimensions=48), use_tqdm=False)
