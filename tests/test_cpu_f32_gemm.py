"""The native float32 GEMM of decode-sized row counts (kernels/cpu/f32_gemm.c) against F.linear, at every ISA
level this CPU runs (so an AVX-512 machine also proves the AVX2 and portable builds), and the layers that use it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_isa
from pagedllm.kernels.cpu_f32_gemm import load_f32_gemm

_DETECTED = cpu_isa.detect_cpu_isa().detected
LEVELS = [lv for lv in cpu_isa.ISA_LEVELS if cpu_isa.ISA_LEVELS.index(lv) <= cpu_isa.ISA_LEVELS.index(_DETECTED)]


def _gemm(level):
    g = load_f32_gemm(level)
    if g is None:
        pytest.skip("no C compiler")
    return g


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n,k", [(96, 80), (50, 33), (7, 1), (1, 129), (576, 1536)])
def test_matches_f_linear_for_every_row_count_and_shape(level, n, k):
    gemm = _gemm(level)
    g = torch.Generator().manual_seed(n * 131 + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    panels = gemm.pack(w)
    for m in [1, 2, gemm.tile_rows - 1, gemm.tile_rows, gemm.tile_rows + 1, gemm.max_rows, 3 * gemm.max_rows + 5]:
        if m < 1:
            continue
        x = torch.randn(m, k, generator=g)
        torch.testing.assert_close(gemm.linear(x, panels, n, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5 * k ** 0.5)
        torch.testing.assert_close(gemm.linear(x, panels, n, None), F.linear(x, w), rtol=1e-5, atol=1e-5 * k ** 0.5)


@pytest.mark.parametrize("level", LEVELS)
def test_a_rows_bits_do_not_depend_on_its_batch(level):
    """Speculative verification runs a sequence's rows with others'; plain decoding runs them alone."""
    gemm = _gemm(level)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 96, generator=g)
    panels = gemm.pack(w)
    x = torch.randn(2 * gemm.max_rows, 96, generator=g)
    whole = gemm.linear(x, panels, 200, None)
    for i in (0, 1, gemm.tile_rows, x.shape[0] - 1):
        assert torch.equal(gemm.linear(x[i:i + 1], panels, 200, None), whole[i:i + 1])
    assert torch.equal(gemm.linear(x[3:3 + gemm.tile_rows], panels, 200, None), whole[3:3 + gemm.tile_rows])


def test_unpack_gives_back_the_weight_exactly_and_bad_input_is_refused():
    gemm = _gemm(None)
    w = torch.randn(45, 70)
    panels = gemm.pack(w)
    assert torch.equal(gemm.unpack(panels, 45, 70), w)
    with pytest.raises(ValueError, match="float32 CPU matrix"):
        gemm.pack(w.double())
    with pytest.raises(ValueError, match="do not hold"):
        gemm.linear(torch.randn(2, 70), panels, 45 + gemm.panel_width, None)
    with pytest.raises(ValueError, match="bias"):
        gemm.linear(torch.randn(2, 70), panels, 45, torch.randn(44))


def test_packed_layer_releases_its_dense_copy_runs_few_rows_natively_and_reloads():
    """A float32 layer keeps oneDNN's copy and the panels; its dense weight comes back, exactly, for a reload."""
    from pagedllm.kernels import cpu_linear
    from pagedllm.model.layers.linear import ReplicatedLinear, pack_weights_for_cpu, restore_dense_weights

    if not cpu_linear.onednn_linear_available():
        pytest.skip("torch built without oneDNN")
    gemm = _gemm(None)
    layer = ReplicatedLinear(48, 40, bias=True, dtype=torch.float32)
    w, b = torch.randn(40, 48), torch.randn(40)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(b)
    model = torch.nn.Sequential(layer)
    pack_weights_for_cpu(model, gemm)
    assert layer.weight.numel() == 0 and layer.weight_shape() == (40, 48) and layer.packed_weight is not None
    for m in (1, gemm.max_rows, gemm.max_rows + 1, 300):
        x = torch.randn(m, 48)
        torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    restore_dense_weights(model)
    assert torch.equal(layer.weight, w)


def test_a_weight_shared_with_an_embedding_keeps_its_dense_copy():
    from pagedllm.kernels import cpu_linear
    from pagedllm.model.layers.linear import ReplicatedLinear, pack_weights_for_cpu

    if not cpu_linear.onednn_linear_available():
        pytest.skip("torch built without oneDNN")
    head = ReplicatedLinear(16, 30, bias=False, dtype=torch.float32)
    emb = torch.nn.Embedding(30, 16)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    pack_weights_for_cpu(model, _gemm(None))
    assert head.weight.shape == (30, 16) and head.dense_shape is None and head.f32_panels is not None


def test_row_limit_follows_the_build_and_the_cpu_onednn_runs_on():
    from pagedllm.kernels.cpu_f32_gemm import ROWS_AVX2_CPU, native_row_limit

    assert native_row_limit("avx512_bf16", "avx512_bf16", 12) == 96
    assert native_row_limit("avx512", "avx512_bf16", 12) == 96
    # oneDNN runs AVX2 as well only where the CPU has nothing higher; forced AVX2 on AVX-512 keeps 2 tiles.
    assert native_row_limit("avx2", "avx2", 6) == ROWS_AVX2_CPU >= 256
    assert native_row_limit("avx2", "avx512", 6) == 12
    assert native_row_limit("portable", "avx2", 4) == 8
