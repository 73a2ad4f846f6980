"""Partial rotary embeddings (``partial_rotary_factor``): Phi-4-mini rotates the first 96 of each head's 128 dims and
passes the other 32 through, with LongRoPE on top.

A tiny random Phi-4-mini-shaped model (head_dim 16, factor 0.75: 12 rotated dims, GQA, tied embeddings; with and
without LongRoPE past a 16-token pretraining length, as test_models_hf_gemma.py's Phi-3) must generate what
transformers generates, through the CPU direct forward, which gives the module path's bits; ``RotaryEmbedding`` against
a plain-torch reference and transformers' Phi-3 tables; the Triton kernel (Triton's interpreter without CUDA) and the
CPU's C kernel (at every ISA level this CPU runs) against ``forward_native``.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from triton_setup import DEVICE, ON_CUDA, interpreter_numpy_shim  # first: sets TRITON_INTERPRET without CUDA

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
    build_from_model,
    _assert_logprobs_match,
    _greedy,
    _model,
    _random_model,
)
from test_models_hf_gemma import _LONGROPE_ORIGINAL, _PHI3, LONGROPE_PROMPT_LENS, _longrope_scaling
from test_cpu_direct_forward import _assert_direct_equals_module_path, _runner

from pagedllm import LLM
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.kernels import cpu_isa
from pagedllm.kernels.cpu_kernels import load_cpu_kernels
from pagedllm.model.cpu_direct_forward import LlamaDirectForward, direct_forward_enabled
from pagedllm.model.layers.rotary import RotaryEmbedding, partial_rotary_factor
from pagedllm.model.models.llama import llama_rotary_embedding
from pagedllm.model.models.registry import get_model_class

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

HEAD_DIM = _PHI3["hidden_size"] // _PHI3["num_attention_heads"]  # 16
NUM_LAYERS = _PHI3["num_hidden_layers"]
ROTARY_DIM = 12  # int(16 · 0.75): even, and its half (6) not a power of two (the kernel's masked lanes)
_PHI4_MINI = {**_PHI3, "partial_rotary_factor": 0.75, "tie_word_embeddings": True}
FAMILIES: dict[str, Family] = {
    "phi4-mini": Family("Phi3Config", "Phi3ForCausalLM", _PHI4_MINI, "Phi3ForCausalLM"),
    # Phi-4-mini's LongRoPE: factors for the rotated dims only (rotary_dim / 2 of them), long ones at every position.
    "phi4-mini-longrope": Family("Phi3Config", "Phi3ForCausalLM", {
        **_PHI4_MINI, "original_max_position_embeddings": _LONGROPE_ORIGINAL,
        "rope_scaling": _longrope_scaling(ROTARY_DIM)}, "Phi3ForCausalLM"),
}
_PROMPT_LENS = {"phi4-mini": PROMPT_LENS, "phi4-mini-longrope": LONGROPE_PROMPT_LENS}


def _build(name: str, path: Path) -> Built:
    """test_models_hf's build (transformers' greedy tokens and log-probs), with this family's prompt lengths."""
    model = _random_model(FAMILIES[name])
    assert model.config.rope_parameters["partial_rotary_factor"] == 0.75
    return build_from_model(model, path, _PROMPT_LENS[name])


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Built]:
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in cache:
            cache[name] = _build(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


# ------------------------------------------------------------------------------------ the model against HF


def _direct_forward_runs() -> bool:
    """Whether the CPU direct forward serves here (native kernels built, not turned off by the environment)."""
    return load_cpu_kernels() is not None and direct_forward_enabled()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_parity_with_transformers(name: str, build, caplog: pytest.LogCaptureFixture) -> None:
    """Token for token and log-probs to float32 noise, under preemption; every step on the CPU direct forward (the C
    RoPE rotating the first rotary_dim dims of each head)."""
    built = build(name)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(model=str(built.path), num_gpu_blocks_override=SMALL_POOL, block_size=4, **ENGINE_KW)
    model = _model(llm)
    assert type(model).__name__ == FAMILIES[name].ours
    rope = model.model.layers[0].self_attn.rotary_emb
    assert (rope.head_dim, rope.rotary_dim, tuple(rope.cos_cache.shape)) == (HEAD_DIM, ROTARY_DIM, (128, ROTARY_DIM))
    assert getattr(model, "direct_forward_supported", True), "Phi-4-mini no longer opts out of the direct forward"
    runner = _runner(llm)
    if _direct_forward_runs():
        assert isinstance(runner.direct_forward, LlamaDirectForward)
        assert [lyr.rotary_dim for lyr in runner.direct_forward.layers] == [ROTARY_DIM] * NUM_LAYERS
        assert f"CPU direct forward: {NUM_LAYERS} layers on the native kernels" in caplog.text
    stats = runner.enable_step_stats()
    try:
        outs = _greedy(llm, built.prompts, logprobs=3)
    finally:
        runner.step_stats = None
    if _direct_forward_runs():
        assert {path for _, path, *_ in stats.records} == {"direct"}
    for prompt, ref, out in zip(built.prompts, built.reference, outs):
        assert list(out.outputs[0].token_ids) == ref, f"{name}: prompt of {len(prompt)} tokens diverged"
    _assert_logprobs_match(outs, built)
    stats = llm.stats()
    if name == "phi4-mini":
        assert stats["num_preemptions"] > 0, "the small pool should have forced preemption"
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == SMALL_POOL


@pytest.mark.parametrize("name", list(FAMILIES))
def test_direct_forward_is_bit_identical_to_the_module_path(name: str, build) -> None:
    """Prefills, mixed steps and decodes of up to 4 sequences: every step runs direct, and the sampled tokens, their
    log-probs and the prompt log-probs are the module path's (PAGEDLLM_CPU_DIRECT_FORWARD=0's) exactly."""
    if not _direct_forward_runs():
        pytest.skip("the CPU direct forward does not run here (no C compiler, or turned off)")
    built = build(name)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=48, block_size=4, max_num_seqs=4, **ENGINE_KW)
    direct = _assert_direct_equals_module_path(llm, [{"prompt_token_ids": p} for p in built.prompts[-4:]])
    assert [lyr.rotary_dim for lyr in direct.layers] == [ROTARY_DIM] * NUM_LAYERS


def test_partial_rotary_matters(build) -> None:
    """transformers' own model with whole-head RoPE (factor 1.0, same weights) gives other log-probs, so the parity
    above is not by accident."""
    built = build("phi4-mini")
    model = _random_model(Family("Phi3Config", "Phi3ForCausalLM", {**_PHI4_MINI, "partial_rotary_factor": 1.0}))
    ids = torch.tensor([built.prompts[-1] + built.reference[-1]])
    with torch.inference_mode():
        logits = torch.log_softmax(model(ids).logits[0, -MAX_TOKENS - 1:-1].float(), dim=-1)
    assert (logits - built.logprobs[-1]).abs().max() > 1e-3


def test_phi3_tables_and_no_direct_forward_opt_out() -> None:
    """factor 1.0 (Phi-3): rotary_dim = head_dim and whole-head tables; 0.75 (Phi-4-mini): tables of the rotated dims;
    neither opts out of the direct forward; an odd rotary dim is a clear error."""
    tp = TensorParallelGroup()
    for factor, rotary_dim in ((1.0, HEAD_DIM), (0.75, ROTARY_DIM)):
        config = transformers.Phi3Config(**_PHI3, vocab_size=VOCAB, partial_rotary_factor=factor)
        model = get_model_class(config)(config, tp, torch.float32)
        rope = model.model.layers[0].self_attn.rotary_emb
        assert (rope.head_dim, rope.rotary_dim, rope.cos_cache.shape[-1]) == (HEAD_DIM, rotary_dim, rotary_dim)
        assert getattr(model, "direct_forward_supported", True)
    odd = transformers.Phi3Config(**_PHI3, vocab_size=VOCAB, partial_rotary_factor=0.5625)  # 9 of 16 dims
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.5625 rotates 9 of head_dim 16 dims"):
        get_model_class(odd)(odd, tp, torch.float32)


def test_llama_ignores_the_factor_as_transformers_does() -> None:
    """transformers' Llama rotates whole heads whatever partial_rotary_factor says; so does its Llama here."""
    config = transformers.LlamaConfig(**{k: v for k, v in _PHI3.items() if k != "attn_implementation"},
                                      vocab_size=VOCAB, partial_rotary_factor=0.5)
    assert partial_rotary_factor(config) == 0.5  # the config carries it ...
    hf = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    assert hf.inv_freq.shape == (HEAD_DIM // 2,)  # ... transformers' Llama ignores it
    assert llama_rotary_embedding(config).rotary_dim == HEAD_DIM


# ---------------------------------------------------------------------------------------- RotaryEmbedding


@pytest.mark.parametrize("longrope", [False, True], ids=["default", "longrope"])
def test_tables_match_transformers_phi3(longrope: bool) -> None:
    """cos / sin over the rotated dims as transformers' Phi-3 computes them (frequencies over rotary_dim, LongRoPE's
    long factors and cos/sin factor past the pretraining length)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    kwargs = FAMILIES["phi4-mini-longrope" if longrope else "phi4-mini"].kwargs
    config = transformers.Phi3Config(**kwargs, vocab_size=VOCAB)
    ours = llama_rotary_embedding(config, partial_rotary=True)
    max_pos = config.max_position_embeddings
    assert ours.cos_cache.shape == ours.sin_cache.shape == (max_pos, ROTARY_DIM)
    hf = Phi3RotaryEmbedding(config)
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), torch.arange(max_pos)[None])  # seq_len max_pos: long factors
    if longrope:
        assert hf.attention_scaling > 1 and ours.cos_cache[0, 0].item() == pytest.approx(hf.attention_scaling)
    torch.testing.assert_close(ours.cos_cache, cos[0], rtol=0, atol=2e-5)
    torch.testing.assert_close(ours.sin_cache, sin[0], rtol=0, atol=2e-5)


def _reference(positions: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               rotary_dim: int) -> torch.Tensor:
    """Plain torch, in float32: rotate-half RoPE on the first rotary_dim dims of each head of x [T, H, D], the rest
    passed through."""
    half = rotary_dim // 2
    c, s = cos[positions][:, None].float(), sin[positions][:, None].float()
    x = x.float()
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    out1 = x1 * c[..., :half] - x2 * s[..., :half]
    out2 = x2 * c[..., half:] + x1 * s[..., half:]
    return torch.cat([out1, out2, rest], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim,rotary_dim", [(16, 12), (128, 96), (64, 32)])
def test_forward_native_rotates_the_first_rotary_dims(head_dim: int, rotary_dim: int, dtype: torch.dtype) -> None:
    t, hq, hk, max_pos = 7, 4, 2, 64
    g = torch.Generator().manual_seed(head_dim + rotary_dim)
    emb = RotaryEmbedding(head_dim, max_pos, {"rope_type": "default", "rope_theta": 10000.0}, torch.float32,
                          rotary_dim)
    # frequencies over rotary_dim, not head_dim (transformers' Phi-3)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    torch.testing.assert_close(emb.cos_cache[5, :rotary_dim // 2].double(), (5 * inv_freq).cos(), rtol=0, atol=1e-6)
    positions = torch.tensor([0, 5, 63, 5, 1, 40, 17])
    q = torch.randn(t, hq * head_dim, generator=g).to(dtype)
    k = torch.randn(t, hk * head_dim, generator=g).to(dtype)
    rq, rk = emb.forward_native(positions, q, k)
    for x, h, got in ((q, hq, rq), (k, hk, rk)):
        want = _reference(positions, x.view(t, h, head_dim), emb.cos_cache, emb.sin_cache, rotary_dim)
        assert got.dtype == dtype and torch.equal(got, want.to(dtype).view(t, -1))
        assert torch.equal(got.view(t, h, head_dim)[..., rotary_dim:], x.view(t, h, head_dim)[..., rotary_dim:])
        assert not torch.equal(got.view(t, h, head_dim)[1:, :, :rotary_dim], x.view(t, h, head_dim)[1:, :, :rotary_dim])


def test_full_rotary_is_the_default_and_unchanged() -> None:
    """rotary_dim = head_dim is the former module: the same tables and the same rotation as the whole-head
    reference."""
    params = {"rope_type": "default", "rope_theta": 10000.0}
    full, explicit = RotaryEmbedding(32, 64, params, torch.float32), RotaryEmbedding(32, 64, params, torch.float32, 32)
    assert full.rotary_dim == 32 and torch.equal(full.cos_cache, explicit.cos_cache)
    assert full.init_args == (32, 64, params, torch.float32, 32)
    positions = torch.tensor([3, 0, 63])
    q, k = torch.randn(3, 4 * 32), torch.randn(3, 2 * 32)
    rq, rk = full.forward_native(positions, q, k)
    assert torch.equal(rq, _reference(positions, q.view(3, 4, 32), full.cos_cache, full.sin_cache, 32).view(3, -1))
    assert torch.equal(rk, _reference(positions, k.view(3, 2, 32), full.cos_cache, full.sin_cache, 32).view(3, -1))


def test_cpu_float32_forward_rotates_part_of_each_head_in_place() -> None:
    """On the CPU in float32 a partial RotaryEmbedding runs the C kernel: in place on column slices of a qkv buffer,
    with forward_native's bits; in bfloat16 (no C kernel) forward_native's new tensors."""
    if load_cpu_kernels() is None:
        pytest.skip("no C compiler: the CPU path runs torch")
    params = {"rope_type": "default", "rope_theta": 10000.0}
    positions = torch.tensor([3, 0, 9])
    qkv = torch.randn(3, 8 * 16)
    q, k, v = qkv.split([4 * 16, 2 * 16, 2 * 16], dim=-1)
    before = qkv.clone()
    partial = RotaryEmbedding(16, 32, params, torch.float32, 12)
    want_q, want_k = partial.forward_native(positions, q, k)
    rq, rk = partial(positions, q, k)
    assert rq.data_ptr() == q.data_ptr() and rk.data_ptr() == k.data_ptr(), "float32 on the CPU: in place"
    assert torch.equal(rq, want_q) and torch.equal(rk, want_k)
    assert torch.equal(v, before[:, 6 * 16:]) and not torch.equal(q, before[:, :4 * 16])
    q16, k16 = before[:, :4 * 16].bfloat16(), before[:, 4 * 16:6 * 16].bfloat16()
    rq16, rk16 = partial(positions, q16, k16)
    assert rq16.data_ptr() != q16.data_ptr()
    assert torch.equal(rq16, partial.forward_native(positions, q16, k16)[0])


def test_bad_rotary_dims_are_clear_errors() -> None:
    params = {"rope_type": "default", "rope_theta": 10000.0}
    for rotary_dim in (9, 18, 0):
        with pytest.raises(ValueError, match=f"rotary dim must be even and in \\(0, head_dim = 16\\], got {rotary_dim}"):
            RotaryEmbedding(16, 8, params, torch.float32, rotary_dim)
    longrope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
                "original_max_position_embeddings": 16, "max_position_embeddings": 64}
    with pytest.raises(ValueError, match="long_factor with rotary_dim / 2 = 6 entries, got 8"):
        RotaryEmbedding(16, 64, longrope, torch.float32, 12)


# ------------------------------------------------------------------------------------------ the CPU's C kernel


def _isa_param(isa: str):
    detected = cpu_isa.isa_from_flags(cpu_isa.cpu_flags()) if cpu_isa._is_x86_64() else "portable"
    above = cpu_isa.ISA_LEVELS.index(isa) > cpu_isa.ISA_LEVELS.index(detected)
    return pytest.param(isa, marks=pytest.mark.skipif(above, reason=f"above this CPU's level ({detected})"))


@pytest.mark.parametrize("isa", [_isa_param(isa) for isa in cpu_isa.ISA_LEVELS])
@pytest.mark.parametrize("head_dim,rotary_dim,hq,hk", [(16, 12, 4, 2), (128, 96, 6, 2), (80, 40, 3, 1), (32, 32, 3, 1)])
def test_c_kernel_partial_rotary_matches_forward_native(isa: str, head_dim: int, rotary_dim: int, hq: int, hk: int,
                                                        kernels_by_isa) -> None:
    """In place on column slices of a qkv buffer, at every ISA level this CPU runs (tests/conftest.py): the first
    rotary_dim dims of each head exactly as forward_native, the rest of each head and v untouched. Halves of 6 (under
    one vector of either width), 48 (whole vectors: Phi-4-mini's), 20 (a vector and a tail), and whole heads."""
    kernels = kernels_by_isa[isa]
    max_pos = 256
    g = torch.Generator().manual_seed(rotary_dim * 10 + hq)
    emb = RotaryEmbedding(head_dim, max_pos, {"rope_type": "default", "rope_theta": 10000.0}, torch.float32,
                          rotary_dim)
    positions = torch.tensor([5, 0, 5, max_pos - 1, 3, 130, 64])
    t, q_size, kv_size = len(positions), hq * head_dim, hk * head_dim
    qkv = 2 * torch.randn(t, q_size + 2 * kv_size, generator=g)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    before = qkv.clone()
    ref_q, ref_k = emb.forward_native(positions, q, k)
    kernels.rotary_embedding(positions, q, k, emb.cos_cache, emb.sin_cache, head_dim, rotary_dim=rotary_dim)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(v, before[:, q_size + kv_size:]), "v must be untouched"
    for got, old, h in ((q, before[:, :q_size], hq), (k, before[:, q_size:q_size + kv_size], hk)):
        assert torch.equal(got.reshape(t, h, head_dim)[..., rotary_dim:], old.reshape(t, h, head_dim)[..., rotary_dim:])
        assert not torch.equal(got.reshape(t, h, head_dim)[..., :rotary_dim], old.reshape(t, h, head_dim)[..., :rotary_dim])
    if rotary_dim == head_dim:  # the default is whole heads
        q2, k2 = before[:, :q_size].clone(), before[:, q_size:q_size + kv_size].clone()
        kernels.rotary_embedding(positions, q2, k2, emb.cos_cache, emb.sin_cache, head_dim)
        assert torch.equal(q2, q) and torch.equal(k2, k)


def test_c_wrapper_checks_the_rotary_dim() -> None:
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C compiler: the CPU path runs torch")
    q, k = torch.zeros(2, 32), torch.zeros(2, 16)
    cache, whole = torch.zeros(8, 12), torch.zeros(8, 16)
    positions = torch.zeros(2, dtype=torch.long)
    for rotary_dim in (11, 18, 0):
        with pytest.raises(ValueError, match=rf"rotary_dim must be even and in \(0, head_dim = 16\], got {rotary_dim}"):
            kernels.rotary_embedding(positions, q, k, cache, cache, 16, rotary_dim=rotary_dim)
    with pytest.raises(ValueError, match=r"cos_cache must be a contiguous \[max_position, 16\] tensor, got \(8, 12\)"):
        kernels.rotary_embedding(positions, q, k, cache, cache, 16)  # a partial table for whole heads
    with pytest.raises(ValueError, match=r"sin_cache must be a contiguous \[max_position, 12\] tensor, got \(8, 16\)"):
        kernels.rotary_embedding(positions, q, k, cache, whole, 16, rotary_dim=12)
    with pytest.raises(ValueError, match=r"beyond the rotary cache \(4 positions\)"):
        kernels.rotary_embedding(positions + 5, q, k, cache, cache[:4], 16, rotary_dim=12)


# ------------------------------------------------------------------------------------------ Triton kernel


def _triton_ops():
    pytest.importorskip("triton")
    interpreter_numpy_shim()
    from pagedllm.kernels import triton_fused_ops

    return triton_fused_ops


_KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])


@pytest.mark.parametrize("dtype", _KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,rotary_dim,hq,hk", [(16, 12, 4, 2), (128, 96, 6, 2), (32, 8, 3, 1)])
def test_triton_kernel_partial_rotary_matches_forward_native(head_dim: int, rotary_dim: int, hq: int, hk: int,
                                                             dtype: torch.dtype) -> None:
    """In place on column slices of a qkv buffer: the first rotary_dim dims of each head exactly as forward_native,
    the rest of each head and v untouched (compiled on CUDA, Triton's interpreter on the CPU)."""
    ops = _triton_ops()
    max_pos = 256
    g = torch.Generator().manual_seed(rotary_dim * 10 + hq)
    emb = RotaryEmbedding(head_dim, max_pos, {"rope_type": "default", "rope_theta": 10000.0}, torch.float32,
                          rotary_dim).to(DEVICE)
    positions = torch.tensor([5, 0, 5, max_pos - 1, 3], device=DEVICE)
    q_size, kv_size = hq * head_dim, hk * head_dim
    qkv = (2 * torch.randn(len(positions), q_size + 2 * kv_size, generator=g)).to(DEVICE, dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    before = qkv.clone()
    ref_q, ref_k = emb.forward_native(positions, q.clone(), k.clone())
    ops.rotary_embedding(positions, q, k, emb.cos_cache, emb.sin_cache, head_dim, rotary_dim=rotary_dim)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(v, before[:, q_size + kv_size:]), "v must be untouched"
    t = len(positions)
    for got, old, h in ((q, before[:, :q_size], hq), (k, before[:, q_size:q_size + kv_size], hk)):
        assert torch.equal(got.reshape(t, h, head_dim)[..., rotary_dim:], old.reshape(t, h, head_dim)[..., rotary_dim:])
        assert not torch.equal(got.reshape(t, h, head_dim)[..., :rotary_dim], old.reshape(t, h, head_dim)[..., :rotary_dim])


def test_triton_wrapper_checks_the_rotary_dim() -> None:
    ops = _triton_ops()
    q, k = torch.zeros(2, 32, device=DEVICE), torch.zeros(2, 16, device=DEVICE)
    cache = torch.zeros(8, 12, device=DEVICE)
    positions = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=r"rotary_dim must be even and in \(0, head_dim = 16\], got 11"):
        ops.rotary_embedding(positions, q, k, cache, cache, 16, rotary_dim=11)
    with pytest.raises(ValueError, match=r"cos_cache must be \[max_pos, 16\]"):
        ops.rotary_embedding(positions, q, k, cache, cache, 16)  # a partial table for whole heads


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_forward_rotates_part_of_each_head_in_place(dtype: torch.dtype) -> None:
    """On CUDA a partial RotaryEmbedding dispatches to the Triton kernel (in place), at Phi-4-mini's sizes."""
    t, head_dim, rotary_dim, hq, hk = 9, 128, 96, 24, 8
    emb = RotaryEmbedding(head_dim, 4096, {"rope_type": "default", "rope_theta": 10000.0}, torch.float32,
                          rotary_dim).to("cuda")
    qkv = torch.randn(t, (hq + 2 * hk) * head_dim, device="cuda", dtype=dtype)
    q, k, _ = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    positions = torch.randint(0, 4096, (t,), device="cuda")
    ref_q, ref_k = emb.forward_native(positions, q.clone(), k.clone())
    rq, rk = emb(positions, q, k)
    assert rq.data_ptr() == q.data_ptr() and rk.data_ptr() == k.data_ptr()
    assert torch.equal(rq, ref_q) and torch.equal(rk, ref_k)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(FAMILIES))
def test_cuda_greedy_parity(name: str, build) -> None:
    """The GPU path (the Triton kernel's partial rotary, CUDA graphs) in float32."""
    built = build(name)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=64, **{**ENGINE_KW, "device": "cuda"})
    outs = _greedy(llm, built.prompts, logprobs=3)
    for ref, out in zip(built.reference, outs):
        assert list(out.outputs[0].token_ids) == ref
    _assert_logprobs_match(outs, built, atol=2e-3)
