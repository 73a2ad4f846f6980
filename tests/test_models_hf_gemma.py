"""Gemma, Gemma 2, Gemma 3 (text) and Phi-3, loaded from directories transformers wrote, must generate what
transformers generates (greedy, float32, eager attention), as the families of test_models_hf.py.

The tiny configs make every feature bite: sliding windows of 8 tokens under prompts of up to 30 (plus 16 generated),
attention and final-logit soft caps below the random model's score and logit ranges, query_pre_attn_scalar apart
from head_dim, a head_dim apart from hidden / heads, Gemma 3's local and global RoPE (the global one linearly scaled),
Phi-3's fused checkpoint tensors and LongRoPE.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch
import transformers
from test_models_hf import (
    ENGINE_KW,
    MAX_TOKENS,
    PROMPT_LENS,
    SMALL_POOL,
    VOCAB,
    Built,
    Family,
    _assert_logprobs_match,
    _greedy,
    _model,
    _random_model,
    build_from_model,
    greedy_on_cpu_path,
)

from pagedllm import LLM
from pagedllm.benchmarks.lower_bound import ModelShape
from pagedllm.core.kv_cache_groups import plan_kv_cache_groups
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.kernels.cpu_kernels import load_cpu_kernels
from pagedllm.model.cpu_direct_forward import direct_forward_enabled
from pagedllm.model.layers.linear import restore_dense_weights
from pagedllm.model.layers.norm import GemmaRMSNorm
from pagedllm.model.layers.rotary import (
    RotaryEmbedding,
    _inv_freq,
    attention_factor,
    rope_parameters,
)
from pagedllm.model.models.registry import get_model_class, layer_sliding_windows

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

WINDOW = 8
_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, attn_implementation="eager")
_GEMMA = {**_SHAPE, "head_dim": 32}  # wider than hidden / heads (16), as Gemma's 256
_PHI3 = {**_SHAPE, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # Phi-3's 32000s are past this vocab
# LongRoPE past a 16-token pretraining length (a 128k Phi-3 in miniature): every prompt is longer, so transformers
# uses the long factors throughout, as this engine does (layers/rotary.py: longrope_uses_long_factors).
_LONGROPE_ORIGINAL = 16
LONGROPE_PROMPT_LENS = (17, 20, 23, 30)


def _longrope_scaling(head_dim: int) -> dict:
    half = head_dim // 2
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "long_factor": [1.0 + 0.5 * i for i in range(half)]}


FAMILIES: dict[str, Family] = {
    # GeGLU (gelu tanh), (1 + w) norms, sqrt(hidden)-scaled embeddings, tied head, head_dim 32.
    "gemma": Family("GemmaConfig", "GemmaForCausalLM", _GEMMA, "GemmaForCausalLM"),
    # Local (window 8) / global layers, score soft cap 2 (scores reach ~3.5), final soft cap 3 (logits reach ~3.7),
    # scale 24**-0.5 rather than head_dim's.
    "gemma2": Family("Gemma2Config", "Gemma2ForCausalLM", {
        **_GEMMA, "sliding_window": WINDOW, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 3.0}, "Gemma2ForCausalLM"),
    # Per-head q/k norms; layers local, global, local; RoPE base 10 000 locally, 10⁶ linearly scaled ×2 globally.
    "gemma3": Family("Gemma3TextConfig", "Gemma3ForCausalLM", {
        **_GEMMA, "sliding_window": WINDOW, "query_pre_attn_scalar": 24, "final_logit_softcapping": 3.0,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}},
        "Gemma3ForCausalLM"),
    # Fused qkv_proj / gate_up_proj checkpoint tensors, a window of 8 on every layer.
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", {**_PHI3, "sliding_window": WINDOW}, "Phi3ForCausalLM"),
    "phi3-longrope": Family("Phi3Config", "Phi3ForCausalLM", {
        **_PHI3, "original_max_position_embeddings": _LONGROPE_ORIGINAL, "rope_scaling": _longrope_scaling(16)},
        "Phi3ForCausalLM"),
}


def _prompt_lens(name: str) -> tuple[int, ...]:
    return LONGROPE_PROMPT_LENS if name == "phi3-longrope" else PROMPT_LENS


def _build(name: str, path: Path) -> Built:
    """test_models_hf's build, with this family's prompt lengths."""
    return build_from_model(_random_model(FAMILIES[name]), path, _prompt_lens(name))




@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Built]:
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in cache:
            cache[name] = _build(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


def _check_parity(name: str, built: Built, outs: list, atol: float = 2e-5) -> None:
    for prompt, ref, out in zip(built.prompts, built.reference, outs):
        assert list(out.outputs[0].token_ids) == ref, f"{name}: prompt of {len(prompt)} tokens diverged"
    _assert_logprobs_match(outs, built, atol)


def _same_bytes(built: Built, blocks: int) -> int:
    """The pool of `blocks` one-table blocks in blocks of the model's KV cache groups (core/kv_cache_groups.py): a
    hybrid model's block holds only one group's layers, so the same memory holds more of them."""
    windows = layer_sliding_windows(transformers.AutoConfig.from_pretrained(built.path))
    return blocks * len(windows) // plan_kv_cache_groups(windows).num_slots


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_parity_with_preemption(name: str, build) -> None:
    built = build(name)
    pool = _same_bytes(built, SMALL_POOL)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=pool, block_size=4, **ENGINE_KW)
    assert type(_model(llm)).__name__ == FAMILIES[name].ours
    # every family here runs the CPU direct forward (model/cpu_direct_forward.py), Gemma's too
    direct = load_cpu_kernels() is not None and direct_forward_enabled()
    outs = greedy_on_cpu_path(llm, built.prompts, direct)
    _check_parity(name, built, outs)
    stats = llm.stats()
    if len(built.prompts) == len(PROMPT_LENS) and name != "phi3":  # phi3's window frees blocks as sequences grow
        assert stats["num_preemptions"] > 0, "the small pool should have forced preemption"
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == pool


@pytest.mark.parametrize("name", ["gemma2", "phi3"])
def test_parity_with_swap_preemption_and_block_size_8(name: str, build) -> None:
    """Swapped-out and swapped-in sequences keep their windows' K/V (Phi-3's freed blocks behind the window too)."""
    built = build(name)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=_same_bytes(built, 12), block_size=8,
              preemption_mode="swap", **ENGINE_KW)
    _check_parity(name, built, _greedy(llm, built.prompts, logprobs=3))
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_cpu_blocks_free"] == stats["num_cpu_blocks_total"]
    if name == "gemma2":
        assert stats["num_swap_preemptions"] > 0 and stats["num_swap_ins"] > 0


@pytest.mark.parametrize("name,device", [
    ("gemma3", "cpu"),
    pytest.param("gemma2", "cuda", marks=[pytest.mark.cuda,
                                         pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
    pytest.param("gemma3", "cuda", marks=[pytest.mark.cuda,
                                         pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
])
def test_bfloat16_runs_close_to_float32(name: str, device: str, build) -> None:
    """bfloat16 (the norms' torch path, (1 + w) applied before the one rounding; on CUDA with graphs): the first
    greedy token of each prompt is transformers' float32 one where its margin is clear."""
    built = build(name)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=64, block_size=4 if device == "cpu" else 16,
              **{**ENGINE_KW, "dtype": "bfloat16", "device": device})
    outs = _greedy(llm, built.prompts, logprobs=3)
    for out, ref, logprobs in zip(outs, built.reference, built.logprobs):
        top2 = logprobs[0].topk(2).values
        if top2[0] - top2[1] > 0.05:
            assert out.outputs[0].token_ids[0] == ref[0]
        assert abs(out.outputs[0].logprobs[0][ref[0]].logprob - logprobs[0, ref[0]].item()) < 0.05


def test_sliding_window_and_soft_caps_matter(build) -> None:
    """The features the parity tests exercise change the outputs: without Gemma 2's window and caps (and Phi-3's
    window) transformers' own greedy tokens or log-probs differ, so parity above is not by accident."""
    for name, off in [("gemma2", dict(sliding_window=4096)), ("gemma2", dict(attn_logit_softcapping=None)),
                      ("gemma2", dict(final_logit_softcapping=None)), ("phi3", dict(sliding_window=None))]:
        built = build(name)
        model = _random_model(Family(FAMILIES[name].config_cls, FAMILIES[name].model_cls,
                                     {**FAMILIES[name].kwargs, **off}))
        ids = torch.tensor([built.prompts[-1] + built.reference[-1]])
        with torch.inference_mode():
            logits = torch.log_softmax(model(ids).logits[0, -MAX_TOKENS - 1:-1].float(), dim=-1)
        assert (logits - built.logprobs[-1]).abs().max() > 1e-3, (name, off)


@pytest.mark.parametrize("name,kv_heads_per_rank", [("gemma", 1), ("gemma2", 1), ("gemma3", 1), ("phi3", 1)])
def test_tensor_parallel_tp2_matches_hf(name: str, kv_heads_per_rank: int, build) -> None:
    """tp=2 (real processes, gloo): each rank holds half the heads; Phi-3's fused tensors are split by rows per
    projection, so each rank gets its own q, k, v, gate and up rows."""
    built = build(name)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=_same_bytes(built, SMALL_POOL), block_size=4,
              tensor_parallel_size=2,
              distributed_executor_backend="mp", **ENGINE_KW)
    executor = llm.llm_engine.executor
    try:
        assert executor.driver.worker.cache_engine.gpu_cache[0][0].shape[2] == kv_heads_per_rank
        outs = _greedy(llm, built.prompts, logprobs=3)
    finally:
        executor.shutdown()
    _check_parity(name, built, outs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(FAMILIES))
def test_cuda_greedy_parity(name: str, build) -> None:
    """The GPU's kernels (Triton attention with windows and soft caps, fused norms on (1 + w) in float32, CUDA
    graphs) in float32: transformers' greedy tokens, its log-probs to float32-on-GPU noise."""
    built = build(name)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=64, **{**ENGINE_KW, "device": "cuda"})
    assert type(_model(llm)).__name__ == FAMILIES[name].ours
    _check_parity(name, built, _greedy(llm, built.prompts, logprobs=3), atol=2e-3)


def test_weights_loaded_exactly(build) -> None:
    """Gemma's norm offsets and tied head; Phi-3's fused tensors as the merged parameters' rows."""
    gemma3 = build("gemma3")
    m = _model(LLM(model=str(gemma3.path), num_gpu_blocks_override=8, **ENGINE_KW))
    restore_dense_weights(m)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    layer = m.model.layers[1]
    for ours, theirs in [(layer.pre_feedforward_layernorm, "pre_feedforward_layernorm"),
                         (layer.self_attn.k_norm, "self_attn.k_norm")]:
        want = gemma3.state[f"model.layers.1.{theirs}.weight"]
        assert want.abs().sum() > 0  # offsets moved off 0 by _random_model
        torch.testing.assert_close(ours.weight, want, rtol=0, atol=0)
    assert [lyr.self_attn.attn.sliding_window for lyr in m.model.layers] == [WINDOW, None, WINDOW]
    assert m.model.layers[0].self_attn.rotary_emb is m.model.layers[2].self_attn.rotary_emb  # one table per type
    assert m.model.layers[0].self_attn.attn.scale == 24**-0.5

    phi3 = build("phi3")
    m = _model(LLM(model=str(phi3.path), num_gpu_blocks_override=8, **ENGINE_KW))
    restore_dense_weights(m)
    for ours, theirs in [("self_attn.qkv_proj", "self_attn.qkv_proj"), ("mlp.gate_up_proj", "mlp.gate_up_proj")]:
        got = m.model.layers[2].get_submodule(ours).weight
        torch.testing.assert_close(got, phi3.state[f"model.layers.2.{theirs}.weight"], rtol=0, atol=0)
    assert all(lyr.self_attn.attn.sliding_window == WINDOW for lyr in m.model.layers)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_fp8_checkpoint_dequantized_on_cpu(name: str, build, tmp_path: Path) -> None:
    """An FP8 (compressed-tensors, per-channel) Gemma checkpoint loads through the FP8 path (model built on the meta
    device, shared rotary tables recomputed) and, dequantized on the CPU, generates what transformers generates
    from the dequantized weights."""
    from fp8_checkpoints import write_fp8_checkpoint

    built = build(name)
    twin = write_fp8_checkpoint(built.path, tmp_path / "fp8", "ct-channel")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(twin), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None
    prompts = built.prompts[-3:]
    want = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
                              pad_token_id=0)
            want.append(out[0, len(p):].tolist())
    llm = LLM(model=str(tmp_path / "fp8"), num_gpu_blocks_override=64, block_size=4, **ENGINE_KW)
    assert [list(o.outputs[0].token_ids) for o in _greedy(llm, prompts)] == want


@pytest.mark.parametrize("name", list(FAMILIES))
def test_dummy_load_format(name: str, build) -> None:
    llm = LLM(model=str(build(name).path), load_format="dummy", num_gpu_blocks_override=32, block_size=8,
              **ENGINE_KW)
    outs = _greedy(llm, build(name).prompts[:2])
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_model_construction_draws_no_random_numbers(name: str) -> None:
    family = FAMILIES[name]
    config = getattr(transformers, family.config_cls)(vocab_size=VOCAB, **family.kwargs)
    state = torch.get_rng_state()
    model = get_model_class(config)(config, TensorParallelGroup(), torch.float32)
    assert torch.equal(torch.get_rng_state(), state)
    assert type(model).__name__ == family.ours


def test_registry_by_architecture_and_model_type() -> None:
    for cfg_cls, ours in [("GemmaConfig", "GemmaForCausalLM"), ("Gemma2Config", "Gemma2ForCausalLM"),
                          ("Gemma3TextConfig", "Gemma3ForCausalLM"), ("Phi3Config", "Phi3ForCausalLM")]:
        config = getattr(transformers, cfg_cls)()  # no `architectures`: model_type decides
        assert get_model_class(config).__name__ == ours


def test_gemma_layer_types_default_rules() -> None:
    """Without layer_types: Gemma 2 alternates local/global, Gemma 3 has one global layer in six."""
    from pagedllm.model.models.gemma import layer_types

    g2 = transformers.Gemma2Config(num_hidden_layers=4)
    g2.layer_types = None
    assert layer_types(g2, 2) == ["sliding_attention", "full_attention"] * 2
    g3 = transformers.Gemma3TextConfig(num_hidden_layers=7)
    g3.layer_types = None
    assert layer_types(g3, 6) == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    g3.layer_types = ["sliding_attention"] * 6
    with pytest.raises(ValueError, match="must name 7 layers"):
        layer_types(g3, 6)


def test_gemma3_rope_per_layer_type() -> None:
    config = transformers.Gemma3TextConfig(**{k: v for k, v in FAMILIES["gemma3"].kwargs.items()
                                              if k != "attn_implementation"}, vocab_size=VOCAB)
    local, full = rope_parameters(config, "sliding_attention"), rope_parameters(config, "full_attention")
    assert (local["rope_type"], local["rope_theta"]) == ("default", 10000.0)
    assert (full["rope_type"], full["factor"], full["rope_theta"]) == ("linear", 2.0, 1e6)
    assert rope_parameters(config) == full  # the global one where no type is named


def test_unsupported_configs_are_clear_errors() -> None:
    tp = TensorParallelGroup()
    gemma3 = transformers.Gemma3TextConfig(**_GEMMA, vocab_size=VOCAB, use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        get_model_class(gemma3)(gemma3, tp, torch.float32)
    odd_rotary = transformers.Phi3Config(**_PHI3, vocab_size=VOCAB, partial_rotary_factor=0.5625)
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5625 rotates 9 of head_dim 16 dims"):
        get_model_class(odd_rotary)(odd_rotary, tp, torch.float32)
    gemma = transformers.GemmaConfig(**_GEMMA, vocab_size=VOCAB, hidden_act="relu")
    with pytest.raises(ValueError, match="Gemma's MLP supports the activations .* got 'relu'"):
        get_model_class(gemma)(gemma, tp, torch.float32)


@pytest.mark.parametrize("max_pos", [64, _LONGROPE_ORIGINAL])
def test_longrope_matches_transformers(max_pos: int) -> None:
    """Frequencies and cos/sin factor as transformers computes them: the long factors past the pretraining length
    (its choice for a sequence longer than that, ours for every sequence), the short ones (and factor 1) within."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.Phi3Config(**_PHI3, vocab_size=VOCAB, original_max_position_embeddings=_LONGROPE_ORIGINAL,
                                     rope_scaling=_longrope_scaling(16) | {"type": "su"})
    config.max_position_embeddings = max_pos
    params = rope_parameters(config)
    assert params["rope_type"] == "longrope"
    seq_len = _LONGROPE_ORIGINAL + 1 if max_pos > _LONGROPE_ORIGINAL else None
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
    torch.testing.assert_close(_inv_freq(16, params).float(), want_inv.float(), rtol=2e-6, atol=0)
    assert attention_factor(params) == pytest.approx(want_factor, rel=1e-12)
    assert (want_factor > 1) == (max_pos > _LONGROPE_ORIGINAL)
    rope = RotaryEmbedding(16, max_pos, params, torch.float32)
    assert rope.cos_cache[0, 0].item() == pytest.approx(want_factor)


def test_longrope_factor_count_is_checked() -> None:
    params = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 3, "long_factor": [1.0] * 3,
              "original_max_position_embeddings": 16, "max_position_embeddings": 64}
    with pytest.raises(ValueError, match="long_factor with head_dim / 2 = 8 entries, got 3"):
        _inv_freq(16, params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_matches_transformers(dtype: torch.dtype) -> None:
    """(1 + w) in float32, one rounding (transformers' GemmaRMSNorm); the fused float32 path equals the torch one;
    the residual form adds first and returns the sum."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as HFGemmaRMSNorm

    torch.manual_seed(0)
    x, residual = torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype)
    ours = GemmaRMSNorm(64, 1e-6, dtype)
    ours.weight.data.normal_(0, 0.3)
    theirs = HFGemmaRMSNorm(64, eps=1e-6).to(dtype)
    theirs.weight.data.copy_(ours.weight)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6 if dtype == torch.float32 else 0, atol=1e-6
                                   if dtype == torch.float32 else 0)
        torch.testing.assert_close(ours.forward_native(x), theirs(x), rtol=0, atol=0)
        out, summed = ours(x, residual)
        torch.testing.assert_close(summed, x + residual, rtol=0, atol=0)
        torch.testing.assert_close(out, theirs(x + residual), rtol=1e-6, atol=1e-6)


def test_gemma_embedding_scale_rounds_to_the_model_dtype() -> None:
    """sqrt(3072) = 55.4256 is 55.5 in bfloat16, as transformers multiplies."""
    from pagedllm.model.models.gemma import GemmaModel

    config = transformers.GemmaConfig(**{**_GEMMA, "hidden_size": 3072, "num_hidden_layers": 1,
                                         "intermediate_size": 8}, vocab_size=VOCAB)
    expected = [(torch.bfloat16, 55.5), (torch.float32, float(torch.tensor(3072**0.5)))]
    with torch.device("meta"):  # as the executor builds every rank's skeleton (check_model_parallelizable)
        for dtype, want in expected:
            model = GemmaModel(config, TensorParallelGroup(), dtype, get_model_class(config))
            assert model.normalizer == want


@pytest.mark.parametrize("name", list(FAMILIES))
def test_lower_bound_shape(name: str) -> None:
    """The benchmarks' FLOP/byte model reads these configs: gated (three-matrix) MLPs, the explicit head_dim."""
    family = FAMILIES[name]
    config = getattr(transformers, family.config_cls)(vocab_size=VOCAB, **family.kwargs)
    shape = ModelShape.from_hf_config(config)
    head_dim = family.kwargs.get("head_dim", 16)
    assert shape.mlp_matrices == 3 and shape.head_dim == head_dim
    assert shape.matmul_params == 3 * (64 * 4 * head_dim * 2 + 2 * 64 * 2 * head_dim + 3 * 64 * 128)
