"""MoE layers: routing as Hugging Face routes, the torch experts against a dense per-token reference, and the Triton
grouped GEMM (kernels/triton_fused_moe.py) against the torch experts: compiled on CUDA, Triton's interpreter on
CPU. Model-level parity with transformers (Mixtral, Qwen2-MoE, Qwen3-MoE) is in test_models_hf.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from triton_setup import DEVICE, ON_CUDA, interpreter_numpy_shim  # noqa: I001  (sets TRITON_INTERPRET first)
from pagedllm.kernels import triton_fused_moe
from pagedllm.model.layers.fused_moe import FusedMoE, fused_experts_torch, select_experts
from pagedllm.model.mxfp4 import Mxfp4Weight
from pagedllm.distributed.parallel_state import TensorParallelGroup

interpreter_numpy_shim()


def _problem(t: int, h: int, inter: int, experts: int, top_k: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(device, dtype)
    w13 = (torch.randn(experts, 2 * inter, h, generator=g) / h ** 0.5).to(device, dtype)
    w2 = (torch.randn(experts, h, inter, generator=g) / inter ** 0.5).to(device, dtype)
    logits = torch.randn(t, experts, generator=g).to(device)
    return x, w13, w2, logits


def _dense_reference(x, w13, w2, weights, ids):
    """Every token through each of its experts, one token at a time, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    x64, w13_64, w2_64 = x.double().cpu(), w13.double().cpu(), w2.double().cpu()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13_64[e] @ x64[t]).chunk(2)
            out[t] += float(weights[t, j]) * (w2_64[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_select_experts_as_hf_routes(renormalize: bool) -> None:
    logits = torch.randn(9, 6, generator=torch.Generator().manual_seed(1))
    weights, ids = select_experts(logits, 2, renormalize)
    probs = torch.softmax(logits.float(), dim=-1)
    top, idx = torch.topk(probs, 2, dim=-1)
    if renormalize:
        top = top / top.sum(-1, keepdim=True)
    assert torch.equal(ids, idx) and torch.equal(weights, top)
    assert torch.allclose(weights.sum(-1), torch.ones(9)) == renormalize


def test_torch_experts_match_dense_reference() -> None:
    x, w13, w2, logits = _problem(13, 32, 24, 5, 2, torch.float32, "cpu")
    weights, ids = select_experts(logits, 2, True)
    got = fused_experts_torch(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.double(), _dense_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("t,experts,top_k", [(1, 4, 2), (7, 8, 2), (40, 6, 3), (3, 16, 1), (300, 5, 2)])
def test_align_pairs_tiles_hold_one_expert(t: int, experts: int, top_k: int, use_kernel: bool) -> None:
    """Torch ops and the one-program Triton kernel lay the pairs out identically (each expert's run in pair order)."""
    ids = torch.stack([torch.randperm(experts, generator=torch.Generator().manual_seed(i))[:top_k] for i in range(t)])
    block_m = 4
    sorted_ids, tile_expert = triton_fused_moe.align_pairs(ids.to(DEVICE), experts, block_m, use_kernel)
    want_ids, want_tiles = triton_fused_moe.align_pairs(ids, experts, block_m, use_kernel=False)
    sorted_ids, tile_expert = sorted_ids.cpu(), tile_expert.cpu()
    assert torch.equal(sorted_ids, want_ids) and torch.equal(tile_expert, want_tiles)
    pairs = t * top_k
    assert sorted_ids.numel() % block_m == 0 and sorted_ids.numel() >= pairs + experts * (block_m - 1)
    real = sorted_ids[sorted_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair once
    flat = ids.reshape(-1)
    for tile, expert in enumerate(tile_expert.tolist()):
        members = sorted_ids[tile * block_m:(tile + 1) * block_m]
        members = members[members < pairs]
        if expert == experts:
            assert members.numel() == 0  # past the last expert's run: unused
        else:
            assert torch.all(flat[members.long()] == expert)


@pytest.mark.parametrize("t,h,inter,experts,top_k", [(1, 64, 32, 4, 2), (9, 64, 48, 8, 2), (37, 96, 64, 6, 3)])
def test_triton_experts_match_torch_float32(t: int, h: int, inter: int, experts: int, top_k: int) -> None:
    x, w13, w2, logits = _problem(t, h, inter, experts, top_k, torch.float32, DEVICE, seed=t)
    weights, ids = select_experts(logits, top_k, True)
    got = triton_fused_moe.fused_experts(x, w13, w2, weights, ids)
    want = fused_experts_torch(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 64, 700])
def test_triton_experts_bf16_and_cuda_graph(t: int) -> None:
    """bf16 (Mixtral / Qwen3-MoE serving dtype) within bf16 rounding of the float32 result; a captured graph
    replays new inputs and new routings exactly as the eager call computes them."""
    x, w13, w2, logits = _problem(t, 256, 128, 8, 2, torch.bfloat16, "cuda", seed=t)
    weights, ids = select_experts(logits, 2, True)
    got = triton_fused_moe.fused_experts(x, w13, w2, weights, ids)
    want = fused_experts_torch(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)

    moe = FusedMoE(8, 2, 256, 128, True, TensorParallelGroup(), torch.bfloat16).cuda()
    moe.w13_weight.data.copy_(w13)
    moe.w2_weight.data.copy_(w2)
    static_x, static_logits = x.clone(), logits.clone()
    moe(static_x, static_logits)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe(static_x, static_logits)
    x2, _, _, logits2 = _problem(t, 256, 128, 8, 2, torch.bfloat16, "cuda", seed=t + 100)
    static_x.copy_(x2)
    static_logits.copy_(logits2)
    graph.replay()
    torch.testing.assert_close(static_out, moe(x2, logits2), rtol=0, atol=0)


def test_relu2_experts_match_dense_reference_on_both_paths() -> None:
    """Non-gated ReLU² experts (Nemotron-H): w13 holds up only; the torch path against a per-token float64 reference,
    and the Triton grouped GEMM against the torch path."""
    x, w13, w2, logits = _problem(11, 32, 24, 6, 2, torch.float32, "cpu", seed=3)
    up = w13[:, :24].contiguous()
    weights, ids = select_experts(logits, 2, True)
    want = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(2):
            e = int(ids[t, j])
            want[t] += float(weights[t, j]) * (w2[e].double() @ torch.relu(up[e].double() @ x[t].double()).square())
    got = fused_experts_torch(x, up, w2, weights, ids, activation="relu2")
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    kernel = triton_fused_moe.fused_experts(x.to(DEVICE), up.to(DEVICE), w2.to(DEVICE), weights.to(DEVICE),
                                            ids.to(DEVICE), activation="relu2")
    torch.testing.assert_close(kernel.cpu(), got, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="activation"):
        FusedMoE(4, 2, 32, 24, True, TensorParallelGroup(), torch.float32, activation="gelu")


def test_warm_up_builds_every_tile_height_once_per_layer_shape(monkeypatch) -> None:
    """warm_up_fused_moe runs each distinct expert layer (two identical layers: once) through the one-program
    alignment and both GEMMs at every tile height a step can pick, with the layer's activation and biases."""
    calls = []
    real_align = triton_fused_moe.align_pairs

    def spy_align(topk_ids, num_experts, block_m, use_kernel=None):
        calls.append((block_m, -(-topk_ids.numel() // max(16, 4096 // 8)) <= triton_fused_moe.ALIGN_KERNEL_MAX_CHUNKS))
        return real_align(topk_ids, num_experts, block_m, use_kernel)

    monkeypatch.setattr(triton_fused_moe, "align_pairs", spy_align)
    tp = TensorParallelGroup()
    layers = torch.nn.ModuleList([FusedMoE(8, 2, 32, 16, True, tp, torch.float32, activation="swigluoai", bias=True)
                                  for _ in range(2)] + [FusedMoE(8, 2, 32, 16, True, tp, torch.float32)])
    for m in layers:
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.1)
    layers.to(DEVICE)
    done = triton_fused_moe.warm_up_fused_moe(layers)
    assert len(done) == 2  # the two swigluoai layers share their binaries
    assert calls == [(bm, True) for bm in triton_fused_moe.BLOCK_M_CHOICES] * 2


def _random_mxfp4(experts: int, rows: int, k: int, gen: torch.Generator) -> Mxfp4Weight:
    """Every FP4 code (both signs, zeros, E2M1's subnormal 0.5) and exponents 2^-9 … 2^0."""
    blocks = torch.randint(0, 256, (experts, rows, k // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(118, 128, (experts, rows, k // 32), dtype=torch.uint8, generator=gen)
    return Mxfp4Weight(blocks.to(DEVICE), scales.to(DEVICE))


def _dequantized(w: Mxfp4Weight) -> torch.Tensor:
    return torch.stack([w.dequantize_expert(e, torch.float32) for e in range(w.shape[0])]).cpu()


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
@pytest.mark.parametrize("t,h,inter,experts,top_k", [(1, 64, 32, 4, 2), (9, 96, 64, 8, 2), (40, 160, 96, 6, 3)])
def test_triton_mxfp4_experts_match_their_dequantized_weights(t: int, h: int, inter: int, experts: int, top_k: int,
                                                               activation: str) -> None:
    """GPT-OSS's MXFP4 experts decoded in the GEMM's tiles (even / odd columns, a scale per 32 values) against the
    torch experts on the dequantized weights; float32 (products of the same values: the accumulation order is the
    only difference), with the experts' biases."""
    gen = torch.Generator().manual_seed(t)
    w13, w2 = _random_mxfp4(experts, 2 * inter, h, gen), _random_mxfp4(experts, h, inter, gen)
    x = torch.randn(t, h, generator=gen)
    b13, b2 = torch.randn(experts, 2 * inter, generator=gen), torch.randn(experts, h, generator=gen)
    weights, ids = select_experts(torch.randn(t, experts, generator=gen), top_k, True)
    want = fused_experts_torch(x, _dequantized(w13), _dequantized(w2), weights, ids, activation, b13, b2)
    got = triton_fused_moe.fused_experts(x.to(DEVICE), w13, w2, weights.to(DEVICE), ids.to(DEVICE),
                                         activation=activation, w13_bias=b13.to(DEVICE), w2_bias=b2.to(DEVICE))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-3 * want.abs().max().item())
    # The torch experts on MXFP4 (an expert dequantized per product) are the same computation.
    torch.testing.assert_close(fused_experts_torch(x, Mxfp4Weight(w13.blocks.cpu(), w13.scales.cpu()),
                                                   Mxfp4Weight(w2.blocks.cpu(), w2.scales.cpu()), weights, ids,
                                                   activation, b13, b2), want, rtol=0, atol=0)


@pytest.mark.parametrize("scaled_dot", [None, False, True])
@pytest.mark.parametrize("t", [3, 70] if not ON_CUDA else [1, 64, 700])
def test_triton_mxfp4_experts_half_precision(t: int, scaled_dot: bool | None) -> None:
    """bf16 (CUDA) / float16 (the interpreter): the MXFP4 tiles of the 16-bit configs (K tiles of 64, 128 and 256;
    K = 192 is not a multiple of 128 or 256), decoded by the kernel's bit decode or by Triton's `tl.dot_scaled`, and
    by whichever the default tile of that size picks (None)."""
    dtype = torch.bfloat16 if ON_CUDA else torch.float16
    gen = torch.Generator().manual_seed(t)
    w13, w2 = _random_mxfp4(8, 256, 192, gen), _random_mxfp4(8, 192, 128, gen)
    x = torch.randn(t, 192, generator=gen)
    weights, ids = select_experts(torch.randn(t, 8, generator=gen), 2, True)
    want = fused_experts_torch(x, _dequantized(w13), _dequantized(w2), weights, ids)
    block_m = triton_fused_moe.block_m_for(2 * t, 8)
    configs = None
    if scaled_dot is not None:
        tiles = triton_fused_moe.gemm_config(block_m, dtype, True, 2 * t)
        configs = (dataclasses.replace(tiles, mxfp4_scaled_dot=scaled_dot),) * 2
    got = triton_fused_moe.fused_experts(x.to(DEVICE, dtype), w13, w2, weights.to(DEVICE), ids.to(DEVICE), block_m,
                                         configs)
    torch.testing.assert_close(got.float().cpu(), want, rtol=3e-2, atol=3e-2 * want.abs().max().item())


def test_mxfp4_tiles_by_size() -> None:
    """MXFP4 experts take their own tiles (BENCHMARKS.md §88.1): one token's pairs a 256-deep K tile, 128-row tiles
    Triton's `tl.dot_scaled`, the rest the kernel's bit decode; bf16 experts keep theirs."""
    bf16 = torch.bfloat16
    assert triton_fused_moe.gemm_config(16, bf16, True, 4).block_k == 256
    assert triton_fused_moe.gemm_config(16, bf16, True, 256).block_k == 128
    assert triton_fused_moe.gemm_config(128, bf16, True, 4096).mxfp4_scaled_dot
    assert not any(triton_fused_moe.gemm_config(m, bf16, True, 4096).mxfp4_scaled_dot for m in (16, 32, 64))
    assert triton_fused_moe.gemm_config(16, bf16, False, 4).block_k == 128


def test_mxfp4_layer_holds_bytes_and_refuses_split_groups() -> None:
    moe = FusedMoE(4, 2, 64, 64, True, TensorParallelGroup(), torch.float32, activation="swigluoai", bias=True)
    moe.hold_mxfp4()
    assert moe.w13_weight.numel() == 0 and moe.w13_blocks.shape == (4, 128, 32) and moe.w2_scales.shape == (4, 64, 2)
    with pytest.raises(ValueError, match="hidden_size \\(48\\) in multiples of 32"):
        FusedMoE(4, 2, 48, 64, True, TensorParallelGroup(), torch.float32).hold_mxfp4()
