"""The CPU direct forward (model/cpu_direct_forward.py) for the Gemma family (Gemma, Gemma 2, Gemma 3 text), and the
native kernels it added (GeGLU's gelu_tanh·mul, Gemma's (1 + w) RMSNorm) at every ISA level.

The tiny models are test_models_hf_gemma.py's (transformers' configs): sliding windows of 8 tokens under prompts of up
to 30, attention and final-logit soft caps that bite, query_pre_attn_scalar apart from head_dim, Gemma 3's per-head
q/k norms and its local and global RoPE tables. Greedy parity with transformers is test_models_hf_gemma.py's, which
now runs the direct forward.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_cpu_direct_forward import (
    _assert_direct_equals_module_path,
    _runner,
    attach_q8_0_linears,
)
from test_models_hf import ENGINE_KW, VOCAB, random_checkpoints
from test_models_hf_gemma import FAMILIES, WINDOW

from pagedllm import LLM
from pagedllm.kernels import cpu_isa, cpu_kernels
from pagedllm.model.cpu_direct_forward import LlamaDirectForward
from pagedllm.model.layers.activation import gelu_and_mul
from pagedllm.model.layers.norm import GemmaRMSNorm
from pagedllm.worker.model_input import SequenceChunk

KERNELS = cpu_kernels.load_cpu_kernels()
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(KERNELS is None, reason="no C compiler: the CPU path runs torch")]

GEMMAS = ("gemma", "gemma2", "gemma3")
PROMPT_LENS = (3, 12, 20, 30)  # all but the first longer than the window


def _prompts() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [{"prompt_token_ids": torch.randint(0, VOCAB, (n,), generator=g).tolist()} for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """name → a directory holding transformers' tiny random model of that family (written once per module)."""
    return random_checkpoints(tmp_path_factory, FAMILIES)


def _llm(path: Path) -> LLM:
    return LLM(model=str(path), num_gpu_blocks_override=48, block_size=4, max_num_seqs=4, **ENGINE_KW)


@pytest.mark.parametrize("name", GEMMAS)
def test_direct_forward_is_bit_identical_to_the_module_path(name: str, checkpoint) -> None:
    """Prefills, mixed steps and decodes of up to 4 sequences past the window: every step runs direct, and the
    sampled tokens, their log-probs and the prompt log-probs are the module path's exactly."""
    llm = _llm(checkpoint(name))
    direct = _assert_direct_equals_module_path(llm, _prompts())
    assert (direct.unit_offset, direct.activation, direct.embed_scale) == (1, "gelu_tanh", 8.0)  # sqrt(64)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_each_layer_gets_its_own_settings(name: str, checkpoint) -> None:
    """The layer descriptions hold each layer's window, soft cap, scale, RoPE table and norms as its modules do,
    and each of them reaches its call: changing one layer's setting changes the hidden states."""
    llm = _llm(checkpoint(name))
    runner = _runner(llm)
    direct, model = runner.direct_forward, runner.model
    layers = direct.layers
    assert [lyr.window for lyr in layers] == [WINDOW, 0, WINDOW]
    assert [lyr.soft_cap for lyr in layers] == [2.0 if name == "gemma2" else 0.0] * 3
    assert all(lyr.scale == pytest.approx(24**-0.5) for lyr in layers)  # query_pre_attn_scalar, not head_dim
    assert all(lyr.pre_ff is not None and lyr.post_ff is not None for lyr in layers)
    for lyr, mod in zip(layers, model.model.layers):
        assert lyr.cos == mod.self_attn.rotary_emb.cos_cache.data_ptr()
        assert lyr.post_ff[0] == mod.post_feedforward_layernorm.weight.data_ptr()
    if name == "gemma3":  # one table per attention type; q/k norms
        assert layers[0].cos == layers[2].cos != layers[1].cos
        assert all(lyr.q_norm and lyr.k_norm for lyr in layers)

    kv = llm.llm_engine.executor.driver_worker.cache_engine.gpu_cache
    prompt = _prompts()[-1]["prompt_token_ids"]
    ids, pos, meta, _ = runner.prepare_inputs([SequenceChunk(0, prompt, 0, list(range(8)), sample=True)])

    def hidden() -> torch.Tensor:
        return direct(ids, pos, kv, meta).clone()

    base = hidden()
    torch.testing.assert_close(base, model(ids, pos, kv, meta), rtol=0, atol=0)
    changes = [(0, dict(window=0)), (2, dict(scale=layers[2].scale * 1.5))]
    changes.append((1, dict(soft_cap=0.0)) if name == "gemma2" else (1, dict(cos=layers[0].cos, sin=layers[0].sin)))
    changes.append((1, dict(post_ff=layers[1].ln2)))
    for i, change in changes:
        direct.layers = [dataclasses.replace(lyr, **change) if j == i else lyr for j, lyr in enumerate(layers)]
        try:
            assert not torch.equal(hidden(), base), f"layer {i}: {change} made no difference"
        finally:
            direct.layers = layers
    assert torch.equal(hidden(), base)


def test_norm_weights_are_read_live(checkpoint) -> None:
    """(1 + w) is summed inside the C norm from the weights as they are now: weights reloaded in place reach
    both paths, which stay bit-identical."""
    llm = _llm(checkpoint("gemma3"))
    runner = _runner(llm)
    kv = llm.llm_engine.executor.driver_worker.cache_engine.gpu_cache
    ids, pos, meta, _ = runner.prepare_inputs([SequenceChunk(0, [5, 9, 11, 13], 0, [0], sample=True)])
    before = runner.direct_forward(ids, pos, kv, meta).clone()
    layer = runner.model.model.layers[1]
    with torch.no_grad():
        for norm in (layer.pre_feedforward_layernorm, layer.self_attn.k_norm):
            norm.weight.add_(0.25)
    after = runner.direct_forward(ids, pos, kv, meta).clone()
    assert not torch.equal(after, before)
    assert torch.equal(after, runner.model(ids, pos, kv, meta))


def test_gguf_linears_run_direct_and_bit_identical(checkpoint) -> None:
    """The linears' handling is generic: Gemma 3 with Q8_0 GGUF linears (the C GEMMs called by pointer) gives the
    module path's bits."""
    llm = _llm(checkpoint("gemma3"))
    runner = _runner(llm)
    assert attach_q8_0_linears(runner.model) == 12
    runner.direct_forward = LlamaDirectForward.build(runner.model, runner.attn_backend)
    assert runner.direct_forward.gemm_method != "dense"
    _assert_direct_equals_module_path(llm, _prompts())


def test_left_to_the_module_path_where_it_does_not_apply(checkpoint, monkeypatch) -> None:
    """Exact (erf) GELU has no native kernel, and `direct_forward_supported = False` (also on the instance) opts out."""
    llm = _llm(checkpoint("gemma"))
    runner = _runner(llm)
    model, backend = runner.model, runner.attn_backend
    assert LlamaDirectForward.build(model, backend) is not None
    for layer in model.model.layers:
        monkeypatch.setattr(layer.mlp, "gated_activation", "gelu")
    assert LlamaDirectForward.build(model, backend) is None
    monkeypatch.undo()
    monkeypatch.setattr(model, "direct_forward_supported", False, raising=False)
    assert LlamaDirectForward.build(model, backend) is None


# ------------------------------------------------------------------------------------ the kernels at every level

ISAS = [pytest.param(isa, marks=pytest.mark.skipif(
    cpu_isa.ISA_LEVELS.index(isa) > cpu_isa.ISA_LEVELS.index(
        cpu_isa.isa_from_flags(cpu_isa.cpu_flags()) if cpu_isa._is_x86_64() else "portable"),
    reason="above this CPU's level")) for isa in cpu_isa.ISA_LEVELS]


@pytest.mark.parametrize("isa", [i for i in ISAS if i.values[0] in ("avx2", "portable")])
def test_direct_forward_on_forced_levels(isa: str, checkpoint, monkeypatch) -> None:
    """Gemma 3 on the AVX2 and portable builds (what an AVX2-only or plain x86-64 CPU runs): the direct forward is
    still the module path bit for bit."""
    def reset() -> None:
        cpu_isa._resolve.cache_clear()
        cpu_kernels.load_cpu_kernels.cache_clear()

    monkeypatch.setenv(cpu_isa.ISA_ENV, isa)
    reset()
    try:
        llm = _llm(checkpoint("gemma3"))
        assert _runner(llm).attn_backend.kernels.isa == isa
        _assert_direct_equals_module_path(llm, _prompts()[1:3])
    finally:
        monkeypatch.delenv(cpu_isa.ISA_ENV)
        reset()


def _gelu_tolerance(gate: torch.Tensor, up: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Float32 rounding of gelu_tanh(g)·up: 2^-21.5 of |g·up| (torch's 1 + tanh(u) loses up to ~|g|·2^-24 where g < 0)
    plus a few ulps of the result."""
    return 3.5e-7 * (gate.double() * up.double()).abs() + 1e-6 * ref.abs()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("tokens,inter", [(1, 2048), (5, 100), (3, 7)])  # tails of 4 and 7 lanes
def test_gelu_tanh_and_mul_matches_torch(isa: str, tokens: int, inter: int, kernels_by_isa) -> None:
    k = kernels_by_isa[isa]
    g = torch.Generator().manual_seed(inter)
    gate = torch.linspace(-12, 12, tokens * inter).view(tokens, inter)[:, torch.randperm(inter, generator=g)]
    x = torch.cat([gate, 3 * torch.randn(tokens, inter, generator=g)], 1)
    up = x[:, inter:]
    out = k.gelu_tanh_and_mul(x)
    ref = F.gelu(gate, approximate="tanh") * up
    exact = F.gelu(gate.double(), approximate="tanh") * up.double()
    for want in (ref.double(), exact):
        assert bool(((out.double() - want).abs() <= _gelu_tolerance(gate, up, want)).all())
    # each element's bits depend on its gate and up alone, not on its column or the row's width
    assert torch.equal(k.gelu_tanh_and_mul(torch.cat([gate[:, :3], up[:, :3]], 1)), out[:, :3])
    assert torch.equal(k.gelu_tanh_and_mul(torch.cat([gate.flip(1), up.flip(1)], 1)), out.flip(1))


@pytest.mark.parametrize("isa", ISAS)
def test_gelu_tanh_edge_values(isa: str, kernels_by_isa) -> None:
    """±inf, NaN, overflow of g³ and signed zeros as torch's gelu gives them."""
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e20, -1e20, 0.0, -0.0, 1e-30, -1e-30, -60.0])
    x = torch.stack([special, torch.ones_like(special)], 1)
    out = kernels_by_isa[isa].gelu_tanh_and_mul(x)[:, 0]
    ref = F.gelu(special, approximate="tanh")
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(out[~out.isnan()]), torch.signbit(ref[~ref.isnan()]))


@pytest.mark.parametrize("isa", ISAS)
def test_gemma_rms_norm_is_the_norm_of_one_plus_w(isa: str, kernels_by_isa) -> None:
    """The (1 + w) kernel gives exactly the plain kernel's bits on a float32 weight + 1.0 (the module path before it),
    with and without the residual add, and transformers' math to float32 rounding."""
    k = kernels_by_isa[isa]
    g = torch.Generator().manual_seed(11)
    x, res, w = torch.randn(9, 640, generator=g), torch.randn(9, 640, generator=g), 0.3 * torch.randn(640, generator=g)
    assert torch.equal(k.gemma_rms_norm(x, w, 1e-6), k.rms_norm(x, w + 1.0, 1e-6))
    out, summed = k.fused_add_gemma_rms_norm(x, res, w, 1e-6)
    want, want_sum = k.fused_add_rms_norm(x, res, w + 1.0, 1e-6)
    assert torch.equal(out, want) and torch.equal(summed, want_sum)
    norm = GemmaRMSNorm(640, 1e-6, torch.float32)
    norm.weight.data.copy_(w)
    torch.testing.assert_close(k.gemma_rms_norm(x, w, 1e-6), norm.forward_native(x), rtol=2e-6, atol=2e-6)


def test_module_path_calls_the_native_kernels() -> None:
    """On the CPU in float32 the module path's GeGLU and Gemma norms are the kernels the direct forward calls (the
    same bits); exact GELU and bfloat16 stay on torch."""
    g = torch.Generator().manual_seed(5)
    x = 4 * torch.randn(6, 2 * 96, generator=g)
    assert torch.equal(gelu_and_mul(x, "tanh"), KERNELS.gelu_tanh_and_mul(x))
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(gelu_and_mul(x, "none"), F.gelu(gate) * up)
    gate16, up16 = x.bfloat16().chunk(2, dim=-1)
    assert torch.equal(gelu_and_mul(x.bfloat16(), "tanh"), F.gelu(gate16, approximate="tanh") * up16)
    norm = GemmaRMSNorm(96, 1e-6, torch.float32)
    norm.weight.data.normal_(0, 0.3, generator=g)
    h, r = torch.randn(6, 96, generator=g), torch.randn(6, 96, generator=g)
    assert torch.equal(norm(h), KERNELS.gemma_rms_norm(h, norm.weight, 1e-6))
    out, summed = norm(h, r)
    want, want_sum = KERNELS.fused_add_gemma_rms_norm(h, r, norm.weight, 1e-6)
    assert torch.equal(out, want) and torch.equal(summed, want_sum)
